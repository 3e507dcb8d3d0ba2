"""The package's stages import one way (docs/design-overview.md §1): config and errors (and the
model zoo and data sets) → compiler, kernels → engine → training → tuning → api → cli; inside
the engine its rooms import one way too: data → state → learning → transport → sync → rounds →
backends → the scheduler; and the product never imports the testing package.

Every import between the package's files counts: one deferred into a function, and one under
``if TYPE_CHECKING:`` (a type hint names a module as much as a call does).
"""

from __future__ import annotations

import ast
from pathlib import Path

import crossbow_graph

PACKAGE = Path(crossbow_graph.__file__).parent
E = "crossbow_graph.engine"
STAGES = {  # module prefix → stage; a module imports only from its own stage or earlier ones
    "crossbow_graph.errors": 0, "crossbow_graph.config": 0, "crossbow_graph.models": 0,
    "crossbow_graph.datasets": 0, "crossbow_graph.fields": 0,
    "crossbow_graph.compiler": 1, "crossbow_graph.kernels": 1,
    f"{E}.data": 2.0, f"{E}.state": 2.1, f"{E}.learning": 2.2, f"{E}.transport": 2.3,
    f"{E}.sync": 2.4, f"{E}.rounds": 2.5, f"{E}.backends": 2.6,
    f"{E}.backends.inline": 2.61, f"{E}.backends.streams": 2.62, f"{E}.backends.graphs": 2.63,
    f"{E}.backends.process": 2.61,
    E: 2.9,  # the run settings and the scheduler, over every room
    "crossbow_graph.training": 3,
    "crossbow_graph.tuning": 4,
    "crossbow_graph.api": 5, "crossbow_graph.compile_options": 5, "crossbow_graph.build": 5,
    "crossbow_graph.cli": 6, "crossbow_graph.__main__": 6, "crossbow_graph": 6,
    "crossbow_graph.testing": 7,  # scaffolding for tests and bench/: nothing in the product imports it
}
SIDE_BY_SIDE = [  # one stage, independent of each other
    {"crossbow_graph.compiler", "crossbow_graph.kernels"},
    {f"{E}.backends.inline", f"{E}.backends.process"},
]


def _module(path: Path) -> str:
    parts = ["crossbow_graph", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _group(module: str) -> str:
    return max((p for p in STAGES if module == p or module.startswith(p + ".")), key=len)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported crossbow_graph module) of every import in ``path``, those under
    ``if TYPE_CHECKING:`` and those inside functions included."""
    tree = ast.parse(path.read_text())
    me = _module(path)
    package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            names = [f"{target}.{a.name}" for a in node.names] if not node.module else [target]
            found += [(node.lineno, t) for t in names if t.startswith("crossbow_graph")]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("crossbow_graph")]
    return found


def _wrong(me: str, target: str) -> bool:
    a, b = _group(me), _group(target)
    if a == b:
        return False
    if STAGES[b] > STAGES[a]:
        return True
    return any(a != b and {a, b} <= pair for pair in SIDE_BY_SIDE)


def test_every_import_goes_to_the_same_or_an_earlier_stage():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _module(path)
        for line, target in _imports(path):
            if _wrong(me, target):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {me} imports {target}")
    assert not wrong, "imports against the stage order:\n" + "\n".join(wrong)


def test_the_product_never_imports_the_testing_package():
    """Simulators and recorders (crossbow_graph/testing/) are scaffolding: a product module that
    imports one would run test code in training."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: imports {target}"
             for path in sorted(PACKAGE.rglob("*.py")) if _group(_module(path)) != "crossbow_graph.testing"
             for line, target in _imports(path) if _group(target) == "crossbow_graph.testing"]
    assert not found, "\n".join(found)


def test_the_stage_order_names_every_engine_room():
    """Each sub-package of engine/ has a stage of its own (a new room needs its place here and in
    docs/design-overview.md §1)."""
    rooms = {_module(p.parent) for p in (PACKAGE / "engine").rglob("__init__.py")}
    assert rooms <= set(STAGES), sorted(rooms - set(STAGES))


def test_no_import_cycle_between_files():
    """A depth-first search over file → file imports finds no back edge."""
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    edges = {m: set() for m in files}
    for m, p in files.items():
        for _, target in _imports(p):
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != m and not files[target].name == "__init__.py" \
                   :
                edges[m].add(target)
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                return path + [m, n]
            if n not in state and (cycle := visit(n, path + [m])):
                return cycle
        state[m] = 2
        return None

    for m in sorted(files):
        if m not in state:
            cycle = visit(m, [])
            assert cycle is None, "import cycle: " + " → ".join(cycle[cycle.index(cycle[-1]):])
