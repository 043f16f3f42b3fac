"""Imports flow one way (docs/architecture.md has the tables this enforces): pure parts know no
network, the averaging protocols know no gRPC, the network layer builds no model, and the
benchmarks drive the averaging objects themselves instead of the daemon. Within the package,
each sub-package imports only what its rule says (`MAY_IMPORT`)."""

from __future__ import annotations

import ast
import itertools
from collections.abc import Mapping
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "neuronode"

PURE = ("diloco", "codec", "training")
FORBIDDEN_IN_PURE = ("grpc", "asyncio", "socket", "neuronode.averaging", "neuronode.swarm", "neuronode.node",
                     "neuronode.v1")
FORBIDDEN_IN_AVERAGING = ("grpc", "neuronode.swarm", "neuronode.node", "neuronode.v1", "neuronode.training",
                          "torch.nn")
FORBIDDEN_IN_SWARM = ("torch.nn", "neuronode.training", "neuronode.diloco", "neuronode.node")
FORBIDDEN_IN_BENCH = ("neuronode.node.daemon", "neuronode.node.rounds")
FORBIDDEN_IN_LIBRARY = ("grpc", "neuronode.swarm", "neuronode.averaging", "neuronode.codec", "neuronode.v1")
ARCHITECTURE = PKG.parent / "docs" / "architecture.md"

# What the modules of each sub-package may import from neuronode, besides their own folder (and the
# folders below it): folders or modules, named relative to neuronode. A module keeps the rule of
# the deepest folder that has one; a folder without one is not checked here. Imports from
# outside neuronode are the forbidden lists' business above.
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "codec": ("memory",),
    "diloco": ("errors", "events", "memory"),
    "training": ("events",),
    "security": ("errors",),
    "averaging": ("clock", "codec", "config", "diloco", "events", "memory", "quorum"),
    "swarm": ("averaging", "clock", "codec", "config", "errors", "events", "quorum", "security", "state", "v1"),
    "swarm.guard": ("averaging", "clock", "events", "quorum", "security", "v1", "swarm.context", "swarm.membership.lineage",
                    "swarm.membership.table", "swarm.receipts.wire", "swarm.wire"),
    "swarm.links": ("clock", "codec", "config", "errors", "events", "v1", "swarm.context", "swarm.guard.admission",
                    "swarm.guard.interceptors", "swarm.guard.proofs", "swarm.guard.ratelimit", "swarm.membership.table", "swarm.server",
                    "swarm.streams.chunks", "swarm.wire"),
    "swarm.membership": ("averaging", "clock", "config", "errors", "events", "quorum", "security", "v1", "swarm.context",
                         "swarm.guard.bans", "swarm.guard.trust", "swarm.links", "swarm.receipts", "swarm.wire"),
    "swarm.receipts": ("averaging", "codec", "events", "quorum", "security", "v1", "swarm.context",
                       "swarm.membership.table", "swarm.wire"),
    "swarm.statesync": ("codec", "events", "security", "state", "v1", "swarm.context", "swarm.guard.proofs",
                        "swarm.guard.trust", "swarm.links", "swarm.wire"),
    "swarm.streams": ("averaging", "codec", "events", "quorum", "security", "v1", "swarm.context", "swarm.guard",
                      "swarm.links", "swarm.membership.hosts", "swarm.membership.table", "swarm.statesync.serving",
                      "swarm.wire"),
}


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def offending(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    files = sorted((PKG / folder).rglob("*.py"))
    assert files, f"no python files under {folder}"
    for path in files:
        for name in imports_of(path):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(PKG.parent)} imports {name}")
    return bad


def test_pure_packages_import_no_network() -> None:
    for folder in PURE:
        assert offending(folder, FORBIDDEN_IN_PURE) == []


def test_averaging_knows_no_grpc() -> None:
    assert offending("averaging", FORBIDDEN_IN_AVERAGING) == []


def test_swarm_builds_no_model() -> None:
    assert offending("swarm", FORBIDDEN_IN_SWARM) == []


def test_bench_drives_the_protocols_not_the_daemon() -> None:
    assert offending("bench", FORBIDDEN_IN_BENCH) == []


def test_library_talks_to_the_node_not_the_wire() -> None:
    """neuronode.library drives a node (neuronode.node) around a model; the network is the node's."""
    assert offending("library", FORBIDDEN_IN_LIBRARY) == []


def test_architecture_page_states_this_table() -> None:
    """docs/architecture.md's table says exactly what these tests enforce."""
    text = ARCHITECTURE.read_text()
    rows = {
        "`diloco`, `codec`, `training`": FORBIDDEN_IN_PURE, "`averaging`": FORBIDDEN_IN_AVERAGING,
        "`swarm`": FORBIDDEN_IN_SWARM, "`bench`": FORBIDDEN_IN_BENCH, "`library`": FORBIDDEN_IN_LIBRARY,
    }
    for package, forbidden in rows.items():
        line = next(ln for ln in text.splitlines() if ln.startswith(f"| {package} |"))
        assert line == f"| {package} | {', '.join(f'`{name}`' for name in forbidden)} |"


def test_architecture_page_states_the_sub_package_rules() -> None:
    table = ARCHITECTURE.read_text().partition("| sub-package | may import from neuronode |")[2]
    rows = list(itertools.takewhile(lambda line: line.startswith("|"), table.splitlines()[2:]))
    assert rows == [f"| `{package}` | {', '.join(f'`{name}`' for name in allowed)} |"
                    for package, allowed in MAY_IMPORT.items()]


def module_graph(root: Path) -> dict[str, set[str]]:
    """Every module of the package under `root` and the package modules it imports, statically:
    every import in the file counts, function-level ones included (a package's __init__
    re-exporting its own modules aside)."""
    files = {".".join(f.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): f
             for f in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                deps.update([base, *(f"{base}.{alias.name}" for alias in node.names)])
        graph[name] = {d for d in deps if d in files and d != name
                       and not (name.startswith(d + ".") and files[d].name == "__init__.py")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_anywhere_in_the_package() -> None:
    assert cycles(module_graph(PKG)) == []


def test_the_cycle_check_sees_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub import a\n")  # a re-export: no cycle
    (pkg / "sub" / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n")
    (pkg / "sub" / "c.py").write_text("from .a import f\n")
    (pkg / "d.py").write_text("import pkg.sub.a\n")
    assert cycles(module_graph(pkg)) == [["pkg.sub.a", "pkg.sub.b", "pkg.sub.c"]]


def rule_breaks(root: Path, rules: Mapping[str, tuple[str, ...]]) -> list[str]:
    """Every import within the package under `root` that its module's rule in `rules` does not
    allow (`MAY_IMPORT` says how rules read), seen as `module_graph` sees imports: function-level
    and TYPE_CHECKING ones included."""
    top = root.name

    def within(name: str, folder: str) -> bool:
        return name == f"{top}.{folder}" or name.startswith(f"{top}.{folder}.")

    bad = []
    for module, deps in sorted(module_graph(root).items()):
        ruled = [folder for folder in rules if within(module, folder)]
        if not ruled:
            continue
        folder = max(ruled, key=lambda f: f.count("."))  # the deepest
        for dep in sorted(deps):
            if not any(within(dep, allowed) for allowed in (folder, *rules[folder])):
                bad.append(f"{module} imports {dep}, which {folder}'s rule does not allow")
    return bad


def test_each_sub_package_imports_what_its_rule_allows() -> None:
    assert rule_breaks(PKG, MAY_IMPORT) == []


def test_every_rule_names_what_exists() -> None:
    """A rule naming a folder or module that is gone (moved, renamed) would allow nothing or
    check nothing: every name in the table is a folder or module of neuronode."""
    def exists(name: str) -> bool:
        path = PKG.joinpath(*name.split("."))
        return path.is_dir() or path.with_suffix(".py").is_file()

    assert [name for name in MAY_IMPORT if not PKG.joinpath(*name.split(".")).is_dir()] == []
    assert [name for names in MAY_IMPORT.values() for name in names if not exists(name)] == []


def test_the_rule_check_fails_on_an_import_that_breaks_a_rule(tmp_path: Path) -> None:
    """A synthetic package: `core` may import `base`; `core.links` (a folder of core with a rule
    of its own) may import `core.wire` only; `guard` nothing. Each import below that breaks its
    module's rule is reported, function-level and relative ones included; each allowed one is not."""
    pkg = tmp_path / "pkg"
    for folder in ("core/links", "guard"):
        (pkg / folder).mkdir(parents=True)
    for init in ("", "core/", "core/links/", "guard/"):
        (pkg / f"{init}__init__.py").write_text("")
    (pkg / "base.py").write_text("")
    (pkg / "core" / "wire.py").write_text("from pkg import base\n")  # core may import base
    (pkg / "core" / "node.py").write_text("from pkg.core.links import relay\nfrom pkg.core import wire\n")  # its own folder
    (pkg / "core" / "links" / "relay.py").write_text("from ..wire import x\nfrom pkg.base import y\n")  # base: not links'
    (pkg / "core" / "links" / "route.py").write_text("def f():\n    import pkg.core.node\n")  # up the tree: no
    (pkg / "guard" / "bans.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.core import wire\n")
    rules = {"core": ("base",), "core.links": ("core.wire",), "guard": ()}
    assert rule_breaks(pkg, rules) == [
        "pkg.core.links.relay imports pkg.base, which core.links's rule does not allow",
        "pkg.core.links.route imports pkg.core.node, which core.links's rule does not allow",
        "pkg.guard.bans imports pkg.core, which guard's rule does not allow",  # its __init__, then the module
        "pkg.guard.bans imports pkg.core.wire, which guard's rule does not allow",
    ]
    assert rule_breaks(pkg, {**rules, "guard": ("core",), "core.links": ("core.wire", "core.node", "base")}) == []


def test_the_rule_check_fails_on_a_real_module_that_breaks_its_sub_packages_rule(tmp_path: Path) -> None:
    """The package as it is, with three imports added that break the rules of `swarm/`'s
    sub-packages: the bans reaching up to the inbound path, a link to the peers, a receipt check
    to state transfer (a function-level import). Each is reported, and nothing else."""
    import shutil

    copy = tmp_path / "neuronode"
    shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("__pycache__", "static"))
    added = {"swarm/guard/bans.py": "from neuronode.swarm.streams.inbound import Inbound\n",
             "swarm/links/route.py": "import neuronode.swarm.membership.peers\n",
             "swarm/receipts/checks.py": "def late():\n    from neuronode.swarm.statesync import download\n"}
    for name, line in added.items():
        with (copy / name).open("a") as f:
            f.write(line)
    assert rule_breaks(copy, MAY_IMPORT) == [
        "neuronode.swarm.guard.bans imports neuronode.swarm.streams.inbound, which swarm.guard's rule does not allow",
        "neuronode.swarm.links.route imports neuronode.swarm.membership.peers, which swarm.links's rule does not allow",
        "neuronode.swarm.receipts.checks imports neuronode.swarm.statesync, which swarm.receipts's rule does not allow",
        "neuronode.swarm.receipts.checks imports neuronode.swarm.statesync.download, which swarm.receipts's rule does not allow",
    ]


def parts_and_methods(trees: list[ast.AST]) -> set[str]:
    """Names of methods, and of attributes holding a part (`self.x = Part(...)`), in these modules."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign) and constructed(node.value):
                names.update(t.attr for t in node.targets if isinstance(t, ast.Attribute))
    return names


def constructed(value: ast.expr) -> bool:
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id[:1].isupper()


def wired(value: ast.expr, handed: set[str]) -> bool:
    """A value that hands one part to another: a lambda, a part built on the spot, or a method
    or part of ours (`self.x`, `self.x.y` naming one of `handed`)."""
    if isinstance(value, ast.Lambda) or constructed(value):
        return True
    if isinstance(value, ast.Attribute) and value.attr in handed:
        root: ast.expr = value
        while isinstance(root, ast.Attribute):
            root = root.value
        return isinstance(root, ast.Name) and root.id == "self"
    return False


def wiring_in(paths: list[Path]) -> list[str]:
    """TYPE_CHECKING imports (each hides a cycle), and parts or callbacks handed to another
    object's attribute after it was built (`other.x = self.method`)."""
    trees = {path: ast.parse(path.read_text()) for path in paths}
    handed = parts_and_methods(list(trees.values()))
    bad = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id == "TYPE_CHECKING":
                bad.append((path.name, node.lineno, "uses TYPE_CHECKING"))
            if isinstance(node, ast.Assign) and wired(node.value, handed):
                for target in node.targets:
                    for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                        if isinstance(t, ast.Attribute) and not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                            bad.append((path.name, node.lineno, f"sets {ast.unparse(t)}"))
    return [f"{name}:{line} {what}" for name, line, what in sorted(bad)]


def test_swarm_wires_nothing_after_construction() -> None:
    """Parts of swarm/ get what they need when they are built (constructor arguments)."""
    assert wiring_in(sorted((PKG / "swarm").rglob("*.py"))) == []


def test_the_wiring_check_sees_handed_parts(tmp_path: Path) -> None:
    code = tmp_path / "node.py"
    code.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\nclass N:\n    def __init__(self):\n"
                    "        self.peers.on_news = self.news\n        self.a = self.b.c = B()\n"
                    "        self.peers.carried = lambda: []\n        peer.last_seen = now\n"
                    "        self.ctx.advertise = host + port\n        out.key = self.key.public\n"
                    "    def news(self):\n        pass\n")
    assert wiring_in([code]) == ["node.py:2 uses TYPE_CHECKING", "node.py:6 sets self.peers.on_news",
                               "node.py:7 sets self.b.c", "node.py:8 sets self.peers.carried"]


def test_scan_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import grpc\nfrom neuronode.swarm.node import SwarmNode\n")
    assert {"grpc", "neuronode.swarm.node", "neuronode.swarm.node.SwarmNode"} <= imports_of(bad)


def test_keep_freed_buffers_is_accepted_by_this_machines_malloc() -> None:
    """On Linux with glibc (this machine, the image) the allocator setting takes."""
    import sys

    from neuronode.memory import keep_freed_buffers

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc only")
    assert keep_freed_buffers() is True


ARENAS_SCRIPT = """
import ctypes, sys, threading
from neuronode.memory import keep_freed_buffers
if sys.argv[1] == "tuned":
    assert keep_freed_buffers()
together = threading.Barrier(4)

def work():  # four threads holding big buffers at once, as the codec, work and gRPC threads do
    together.wait()
    bufs = [bytearray(1 << 20) for _ in range(4)]
    together.wait()

threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
ctypes.CDLL(None).malloc_stats()  # one "Arena k:" paragraph per arena, on stderr
"""


def test_keep_freed_buffers_gives_threads_one_arena() -> None:
    """Thread arenas unmap their empty heaps, so buffers freed in worker threads come back as
    fresh pages every round (neuronode/memory.py has the figures); one arena keeps them."""
    import os
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc only")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}

    def arenas(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", ARENAS_SCRIPT, mode], capture_output=True, text=True,
                             timeout=60, check=True, env=env)
        return sum(line.startswith("Arena ") for line in out.stderr.splitlines())

    assert arenas("default") > 1  # what glibc does unasked: the test can tell the difference
    assert arenas("tuned") == 1
