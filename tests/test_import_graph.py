"""The import structure of `moeplan`, read from the source with `ast` (nothing is imported):
no module imports itself through others, and the planner packages never reach torch.

Every import counts, at module level or inside a function, since a lazy import that closes a
cycle still ties the two modules together; imports under `if TYPE_CHECKING:` do not (they never
run). An edge goes to the module an import names: `from .loader import build` to
`moeplan.specs.loader`, `from . import micro` to the submodule `micro` when there is one, else
to the package whose `__init__` defines the name.
"""

from __future__ import annotations

import ast
from pathlib import Path

from .conftest import REPO

PACKAGE = REPO / "moeplan"
PLANNER_PACKAGES = ("moeplan.specs", "moeplan.cost_models", "moeplan.planner")
FORBIDDEN_IN_PLANNER = ("torch", "moeplan.runtime", "moeplan.kernels", "moeplan.calibrate")

# Cycles allowed to remain, each the set of modules it runs through (none now: the ones known
# when this test was written are gone). A cycle not listed fails the test by name.
KNOWN_CYCLES: tuple[frozenset[str], ...] = ()


def module_files() -> dict[str, Path]:
    """Dotted module name → source file, for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of `tree` except those under `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)  # the `else:` branch does run
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules `name` imports: moeplan modules by their dotted name, others by their
    top-level package (`torch`, `numpy`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
            out.update(t if t in modules else t.split(".")[0] for t in targets)
            continue
        if node.level:
            base_parts = package.split(".")
            base_parts = base_parts[: len(base_parts) - (node.level - 1)]
            base = ".".join(base_parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        if base not in modules:  # not ours: the top-level package
            out.add(base.split(".")[0])
            continue
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            out.add(sub if sub in modules else base)
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root] & graph.keys())))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child] & graph.keys()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One concrete loop through `component`, start module repeated at the end, for the
    failure message (`a → b → a`)."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth-first back to `start` inside the component
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if child not in parents:
                    parents[child] = node
                    nxt.append(child)
        frontier = nxt
    return component


def test_the_import_graph_sees_relative_and_submodule_imports():
    graph = import_graph()
    assert "moeplan.specs.loader" in graph["moeplan.specs"]            # from .loader import ...
    assert "moeplan.errors" in graph["moeplan.specs.loader"]           # from ..errors import ...
    assert "moeplan.calibrate.micro" in graph["moeplan.calibrate.bench"]  # from . import micro
    assert "torch" in graph["moeplan.calibrate.micro"] and "yaml" in graph["moeplan.specs.loader"]
    toy = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(toy) == [["a", "b", "c"]]
    assert cycle_path(toy, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_no_moeplan_module_imports_itself_through_others():
    graph = import_graph()
    found = [c for c in cycles(graph) if frozenset(c) not in KNOWN_CYCLES]
    assert not found, "import cycles: " + "; ".join(" → ".join(cycle_path(graph, c))
                                                    for c in found)


def test_the_planner_packages_never_import_torch_or_the_runtime():
    graph = import_graph()
    for root in (m for m in graph if m.startswith(PLANNER_PACKAGES)):
        seen, todo, via = {root}, [root], {root: root}
        while todo:
            node = todo.pop()
            for child in graph.get(node, ()):
                if child.startswith(FORBIDDEN_IN_PLANNER) or child == "torch":
                    chain = [node]
                    while chain[-1] != root:
                        chain.append(via[chain[-1]])
                    raise AssertionError(f"{' → '.join(reversed(chain))} → {child}: the planner "
                                         "stays torch-free")
                if child in graph and child not in seen:
                    seen.add(child)
                    via[child] = node
                    todo.append(child)


def test_no_module_imports_a_private_name_from_another_module():
    root = (REPO / 'moeplan')
    private = []
    for f in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                private += [f"{f.relative_to(root)}: {a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    assert private == []


def _functions(pkg: str):
    """(lines, "package/module.py:name") of every function of a `moeplan` package."""
    root = PACKAGE / pkg
    for f in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield node.end_lineno - node.lineno + 1, f"{f.relative_to(root.parent)}:{node.name}"


def test_no_planner_or_cost_model_function_is_over_100_lines():
    long = [(n, where) for pkg in ("planner", "cost_models") for n, where in _functions(pkg)
            if n > 100]
    assert long == []


def test_no_planner_function_is_over_80_lines():
    # the search reads as small steps (the branch and bound's state, the objective's answers,
    # the enumeration's two loops), not one function of closures
    assert [(n, where) for n, where in _functions("planner") if n > 80] == []


def test_the_planner_imports_a_narrow_api_of_the_estimator():
    # the MILP prices stages with the estimator's own step function (`stage_terms`), so the
    # planner needs the estimate, its breakdown, the lower bound and that function, not the
    # internals the two once added up separately
    root = PACKAGE / "planner"
    names = set()
    for f in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith(
                    "cost_models.estimate"):
                names |= {a.name for a in node.names}
    assert len(names) <= 5, sorted(names)
