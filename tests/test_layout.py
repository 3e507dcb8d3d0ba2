"""The package's stages import one way (docs/design-overview.md §1): config and errors (and the
model zoo and data sets) → compiler, kernels → engine → training → tuning → api → cli.

Every import between the package's files counts, one deferred into a function too; imports under
``if TYPE_CHECKING:`` (type hints only, never run) do not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import crossbow_graph

PACKAGE = Path(crossbow_graph.__file__).parent
STAGES = {  # module prefix → stage; a module imports only from its own stage or earlier ones
    "crossbow_graph.errors": 0, "crossbow_graph.config": 0, "crossbow_graph.models": 0,
    "crossbow_graph.datasets": 0, "crossbow_graph.fields": 0,
    "crossbow_graph.compiler": 1, "crossbow_graph.kernels": 1,
    "crossbow_graph.engine": 2,
    "crossbow_graph.training": 3,
    "crossbow_graph.tuning": 4,
    "crossbow_graph.api": 5, "crossbow_graph.compile_options": 5, "crossbow_graph.build": 5,
    "crossbow_graph.cli": 6, "crossbow_graph.__main__": 6, "crossbow_graph": 6,
}
SIDE_BY_SIDE = {"crossbow_graph.compiler", "crossbow_graph.kernels"}  # one stage, independent


def _module(path: Path) -> str:
    parts = ["crossbow_graph", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _group(module: str) -> str:
    return max((p for p in STAGES if module == p or module.startswith(p + ".")), key=len)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported crossbow_graph module) of every import in ``path`` outside TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    hidden = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
              and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    me = _module(path)
    package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            names = [f"{target}.{a.name}" for a in node.names] if not node.module else [target]
            found += [(node.lineno, t) for t in names if t.startswith("crossbow_graph")]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("crossbow_graph")]
    return found


def test_every_import_goes_to_the_same_or_an_earlier_stage():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _module(path)
        for line, target in _imports(path):
            a, b = _group(me), _group(target)
            if STAGES[b] > STAGES[a] or (a != b and {a, b} <= SIDE_BY_SIDE):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {me} imports {target}")
    assert not wrong, "imports against the stage order:\n" + "\n".join(wrong)


def test_no_import_cycle_between_files():
    """A depth-first search over file → file imports finds no back edge."""
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    edges = {m: set() for m in files}
    for m, p in files.items():
        for _, target in _imports(p):
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != m and not files[target].name == "__init__.py":
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
