"""Generate the Python code for proto/neuronode/v1/*.proto (the one command: `make proto`).

Output goes to neuronode/v1/ (the package path follows the proto package). The generator is
pinned (grpcio-tools==1.85.1 in the `dev` extra) and pyproject's protobuf range starts at the
runtime version that generator emits for, so users never get a gencode/runtime mismatch.
tests/test_proto.py regenerates into a temporary folder and fails when the committed files
are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every .proto under proto/ into out_dir; return the files written."""
    from grpc_tools import protoc  # dev dependency only

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    gen_dir = out_dir / "neuronode" / "v1"
    (gen_dir / "__init__.py").touch()
    return sorted(p for p in gen_dir.iterdir() if p.suffix in (".py", ".pyi"))


if __name__ == "__main__":
    files = generate(ROOT if len(sys.argv) < 2 else Path(sys.argv[1]))
    print("\n".join(str(f) for f in files))
