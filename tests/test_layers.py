"""The package's shape, read from the code itself (``ast``, nothing imported), and what loads
at run time:

- no import cycle between modules of ``kvstore/`` (imports inside functions and under
  ``TYPE_CHECKING`` count: they are dependencies all the same);
- lower layers never import higher ones (``LAYERS``, bottom up), and the daemon's tiers never
  import each other: what one needs of another is passed in;
- the ledger (``kvstore.daemon.ledger``) is the only writer of block state: no other daemon
  module assigns into the index's fields, the payload checksums or the slot quarantine, or calls
  the index's, the CPU and NVMe policies' or the slot tables' mutators;
- no module over ``MAX_LINES`` lines (generated protobuf code aside).

``from package import name`` is resolved to the module that defines ``name`` where the
package's ``__init__`` re-exports it, so a re-export is not mistaken for a dependency on the
whole package.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvstore"
MAX_LINES = 800

# Bottom up. A module's layer is the first whose patterns match its name; an import may reach
# its own layer or a lower one, never a higher one.
LAYERS: list[tuple[str, list[str]]] = [
    ("kernels", ["kvstore.kernels", "kvstore.kernels.*"]),
    (
        "core types",
        [
            "kvstore.version",
            "kvstore.errors",
            "kvstore.units",
            "kvstore.keys",
            "kvstore.layout",
            "kvstore.checksum",
            "kvstore.address",
            "kvstore.ratelog",
            "kvstore.stats_table",
            "kvstore.local_calls",
            "kvstore.v1",
            "kvstore.v1.*",
            "kvstore.policy",
            "kvstore.index",
            "kvstore.presence",
        ],
    ),
    ("tier mechanism", ["kvstore.tiers", "kvstore.tiers.*"]),
    ("configuration", ["kvstore.config", "kvstore.config.*", "kvstore.configs"]),
    ("client", ["kvstore.client", "kvstore.client.*", "kvstore.paged"]),
    (
        "daemon books",
        [
            "kvstore.daemon",
            "kvstore.daemon.auth",
            "kvstore.daemon.block_events",
            "kvstore.daemon.namespaces",
            "kvstore.daemon.quotas",
            "kvstore.daemon.tierstats",
            "kvstore.daemon.cpu_tier",
            "kvstore.daemon.disk_tier",
            "kvstore.daemon.pool_slots",
            "kvstore.daemon.presence_books",
            "kvstore.daemon.tier_contract",
            "kvstore.daemon.room",
            "kvstore.daemon.side_streams",
            "kvstore.daemon.writeback",
        ],
    ),
    ("daemon ledger", ["kvstore.daemon.ledger"]),
    ("daemon movement parts", ["kvstore.daemon.cpu_room", "kvstore.daemon.prefetch"]),
    ("daemon tiers", ["kvstore.daemon.device", "kvstore.daemon.shared", "kvstore.daemon.movement"]),
    ("daemon checks and views", ["kvstore.daemon.invariants", "kvstore.daemon.snapshots"]),
    ("daemon store", ["kvstore.daemon.store", "kvstore.daemon.store_*"]),
    (
        "daemon faces",
        [
            "kvstore.daemon.service",
            "kvstore.daemon.session",
            "kvstore.daemon.local_calls",
            "kvstore.daemon.metrics",
        ],
    ),
    ("daemon process", ["kvstore.daemon.server"]),
    (
        "applications",
        [
            "kvstore.worker",
            "kvstore.worker.*",
            "kvstore.integrations",
            "kvstore.integrations.*",
            "kvstore.models",
            "kvstore.demo",
            "kvstore.chat_demo",
            "kvstore.cli",
        ],
    ),
    ("package face", ["kvstore", "kvstore.__main__"]),
]
# Layers whose modules are peers that never import each other.
PEERS = {"daemon tiers"}

LEDGER = "kvstore.daemon.ledger"
# Block state the ledger alone writes: a daemon module other than the ledger that assigns into
# these (``x.index.tier[e] |= ...``), or calls these mutators on them, breaks the rule.
STATE_FIELDS = {"index", "payload_sums", "quarantine"}
MUTATORS = {
    "index": {"add", "add_many", "commit", "drop", "add_lease", "drop_lease", "orphan",
              "add_unkeyed_many", "key_many"},
    "policy": {"insert", "insert_touched", "remove"},
    "nvme_policy": {"insert", "insert_touched", "remove"},
    "gpu_policy": {"insert", "insert_touched", "remove"},
    "cpu_slots": {"place", "place_dirty", "vacate", "quarantine", "release_quarantined",
                  "note_clean", "relocate", "alloc", "unalloc"},
    "disk": {"place", "vacate"},
    "gpu_slots": {"place", "complete", "vacate", "detach", "quarantine", "release_quarantined",
                  "alloc", "unalloc"},
    "payload_sums": {"pop", "clear", "update", "setdefault"},
}  # fmt: skip


def _modules() -> dict[str, Path]:
    found = {}
    for directory, _, files in os.walk(PACKAGE, followlinks=True):  # tiers/ etc. are links
        for name in files:
            if not name.endswith(".py") or name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            path = Path(directory) / name
            parts = path.relative_to(ROOT).with_suffix("").parts
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[module] = path
    return found


MODULES = _modules()


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _reexports(package: str) -> dict[str, str]:
    """Names a package's ``__init__`` takes from its own modules: name -> defining module."""
    out = {}
    tree = ast.parse(MODULES[package].read_text())
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and not node.level and node.module in MODULES:
            for alias in node.names:
                out[alias.asname or alias.name] = node.module
    return out


def _owner(name: str) -> str | None:
    """The module of ``kvstore`` a dotted name lives in (None: outside the package)."""
    while name:
        if name in MODULES:
            return name
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return None


def _imports(module: str) -> set[str]:
    """Every module of ``kvstore`` that ``module`` imports, anywhere in its code."""
    path = MODULES[module]
    package = module if _is_package(module) else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                owner = _owner(alias.name)
                if owner:
                    out.add(owner)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            owner = _owner(source)
            if owner is None:
                continue
            reexported = _reexports(owner) if _is_package(owner) else {}
            for alias in node.names:
                if f"{source}.{alias.name}" in MODULES:  # a submodule
                    out.add(f"{source}.{alias.name}")
                elif alias.name in reexported:
                    out.add(reexported[alias.name])
                else:
                    out.add(owner)
    out.discard(module)
    return out


GRAPH = {m: _imports(m) for m in MODULES}


def _layer(module: str) -> int:
    for i, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch(module, p) for p in patterns):
            return i
    raise AssertionError(f"{module} is in no layer of tests/test_layers.py: give it one")


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    counter = 0
    for root in sorted(GRAPH):
        if root in index:
            continue
        work = [(root, iter(sorted(GRAPH[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(GRAPH[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        _layer(module)


def test_no_import_cycle() -> None:
    assert _cycles() == []


def test_imports_run_downward_only() -> None:
    upward = []
    for module, targets in sorted(GRAPH.items()):
        for target in sorted(targets):
            if _layer(target) > _layer(module):
                upward.append(
                    f"{module} ({LAYERS[_layer(module)][0]}) imports {target} "
                    f"({LAYERS[_layer(target)][0]})"
                )
    assert upward == []


def test_peer_tiers_never_import_each_other() -> None:
    crossing = [
        f"{module} imports {target}"
        for module, targets in sorted(GRAPH.items())
        for target in sorted(targets)
        if _layer(module) == _layer(target) and LAYERS[_layer(module)][0] in PEERS
    ]
    assert crossing == []


def _chain(node: ast.AST) -> list[str]:
    """``a.b.c`` as ["a", "b", "c"] (subscripts looked through); [] for anything else."""
    names: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Name):
            names.append(node.id)
            return names[::-1]
        else:
            return []


def _state_writes(module: str) -> list[str]:
    tree = ast.parse(MODULES[module].read_text())
    found = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        for target in targets:
            if isinstance(target, ast.Subscript):
                chain = _chain(target)
                if any(part in STATE_FIELDS for part in chain[1:]):
                    found.append(f"line {target.lineno}: writes {'.'.join(chain)}[...]")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            chain = _chain(node.func.value)
            owner = chain[-1] if chain else None
            if owner in MUTATORS and node.func.attr in MUTATORS[owner]:
                found.append(f"line {node.lineno}: calls {'.'.join(chain)}.{node.func.attr}()")
    return found


def test_the_ledger_is_the_only_writer_of_block_state() -> None:
    writes = {
        module: _state_writes(module)
        for module in MODULES
        if module.startswith("kvstore.daemon.") and module != LEDGER
    }
    assert {m: w for m, w in writes.items() if w} == {}


def test_the_checks_can_fail() -> None:
    """The checkers see what they look for (a test that cannot fail proves nothing)."""
    assert _chain(ast.parse("a.index.tier[e]").body[0].value) == ["a", "index", "tier"]  # type: ignore[attr-defined]
    assert _reexports("kvstore")  # the package face re-exports the client and its types
    assert GRAPH["kvstore.daemon.store"] >= {LEDGER, "kvstore.daemon.movement"}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_too_long(module: str) -> None:
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module}: {lines} lines, more than {MAX_LINES}"


# ----------------------------------------------------------------- at run time
CHECK = """
import sys
import {module}
loaded = sorted(m for m in sys.modules if m.startswith({forbidden!r}))
print(",".join(loaded))
"""


def loaded_by(module: str, forbidden: tuple[str, ...]) -> list[str]:
    code = CHECK.format(module=module, forbidden=forbidden)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [m for m in out.stdout.strip().split(",") if m]


def test_the_daemon_imports_no_client_code() -> None:
    faces = ("kvstore.client", "kvstore.paged", "kvstore.worker", "kvstore.integrations")
    assert loaded_by("kvstore.daemon.server", faces) == []


def test_the_client_imports_no_daemon_code() -> None:
    assert loaded_by("kvstore.client", ("kvstore.daemon",)) == []


def test_the_faces_import_no_circle() -> None:
    # The demos show the stats table without importing the CLI, which starts them.
    faces = {"kvstore.cli", "kvstore.demo", "kvstore.chat_demo"}

    def faces_loaded_by(module: str) -> set[str]:
        return set(loaded_by(module, tuple(faces))) & (faces - {module})

    assert faces_loaded_by("kvstore.stats_table") == set()
    assert faces_loaded_by("kvstore.demo") == set()
    assert faces_loaded_by("kvstore.chat_demo") == set()
