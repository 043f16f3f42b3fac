"""`neuronode status`: the same fields from a live node (gRPC) or a stopped one (checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neuronode.errors import StatusError

STATUS_KEYS = (
    "node_id", "round", "phase", "peers", "last_round_contributors", "param_digest", "loss",
    "val_loss", "bytes_sent", "bytes_received",
)


def from_peer(address: str, *, timeout_s: float = 5.0, secret_file: str | None = None,
              swarm_id: str = "neuronode-default",
              tls: tuple[str | None, str | None, str | None] = (None, None, None)) -> dict[str, Any]:
    """Ask a live node over gRPC (with the swarm's secret or TLS files for a closed swarm)."""
    import grpc

    from neuronode.swarm.wire import CHANNEL_OPTIONS, status_to_dict
    from neuronode.v1 import node_pb2 as pb
    from neuronode.v1 import node_pb2_grpc as pb_grpc

    metadata = None
    if secret_file:
        from neuronode.security.auth import load_secret
        from neuronode.swarm.guard.proofs import Security

        metadata = Security(node_id="status-cli", swarm_id=swarm_id, secret=load_secret(secret_file)).metadata("Status")
    if all(tls):
        from pathlib import Path as P

        from neuronode.security.tls import channel_credentials

        creds = channel_credentials(P(tls[0] or ""), P(tls[1] or ""), P(tls[2] or ""))
        channel = grpc.secure_channel(address, creds, options=CHANNEL_OPTIONS)
    else:
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    with channel:
        try:
            resp = pb_grpc.NodeStub(channel).Status(pb.StatusRequest(), timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            raise StatusError(
                f"no answer from {address} ({exc.code().name}: {exc.details()}); is the node "
                "running and is that its --listen/--advertise address?") from None
    return status_to_dict(resp)


def from_data_dir(data_dir: str) -> dict[str, Any]:
    """Read what a (stopped) node's newest good checkpoint knows."""
    from neuronode.node import checkpoint

    folder = Path(data_dir)
    if not folder.is_dir():
        raise StatusError(f"--data-dir: '{data_dir}' does not exist")
    loaded = checkpoint.load_latest(folder, meta_only=True)
    node_id_file = folder / "node_id"
    if loaded is None:
        if not node_id_file.exists():
            raise StatusError(f"--data-dir: '{data_dir}' holds no neuronode node")
        return {"node_id": node_id_file.read_text().strip(), "round": 0, "phase": "new",
                "peers": [], "last_round_contributors": 0, "param_digest": "", "loss": None,
                "val_loss": None, "bytes_sent": 0, "bytes_received": 0}
    meta = dict(loaded.meta)
    meta.pop("manifest_hash", None)
    meta["checkpoint"] = str(loaded.path)
    return {k: none_if_nan(v) for k, v in meta.items()}


def none_if_nan(value: Any) -> Any:
    return None if isinstance(value, float) and value != value else value


def format_table(report: dict[str, Any]) -> str:
    """A human-readable view for terminals; scripts get JSON."""
    lines = []
    for key in STATUS_KEYS:
        if key == "peers":
            continue
        value = report.get(key)
        if isinstance(value, float):
            value = f"{value:.4f}"
        lines.append(f"{key:<24} {value}")
    for key in sorted(set(report) - set(STATUS_KEYS)):
        value = report[key]
        if not isinstance(value, (list, dict)):
            lines.append(f"{key:<24} {value}")
    peers = report.get("peers") or []
    lines.append(f"{'peers':<24} {len(peers)}")
    for p in peers:
        state = "alive" if p.get("alive") else "gone"
        lines.append(f"  {p.get('node_id', ''):<22} {p.get('address', ''):<22} {state:<6} "
                     f"seen {p.get('last_seen_s', 0):.1f}s ago")
    return "\n".join(lines)
