"""The package's parts import one way only (``_LAYERS`` in fastload/__init__.py), and
neither the package nor the benchmarks have an import cycle. Every import counts,
function-level ones too; only ``if TYPE_CHECKING:`` blocks are exempt."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import fastload
from kit.tools import missing

PACKAGE = Path(fastload.__file__).resolve().parent
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def parse_layers(text: str) -> list[list[str]]:
    """``_LAYERS``: one line per layer, top first, siblings separated by ``|``."""
    return [[p.strip() for p in line.split("|")] for line in text.strip().splitlines()]


def module_name(path: Path, root: Path, package: str) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = [package, *rel.parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(path: Path, module: str, is_package: bool) -> Iterator[tuple[str, int]]:
    """The absolute names ``module`` imports (submodule names where ``from X import y``
    names one), with their line numbers."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    base = module.split(".") if is_package else module.split(".")[:-1]

    def walk(nodes: list[ast.stmt] | list[ast.AST]) -> Iterator[tuple[str, int]]:
        for node in nodes:
            if isinstance(node, ast.If) and _type_checking(node):
                yield from walk(node.orelse)
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield alias.name, node.lineno
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = base[: len(base) - node.level + 1]
                    target = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    # A submodule, or a name in `target` (graph() falls back to it).
                    yield f"{target}.{alias.name}", node.lineno
            yield from walk(list(ast.iter_child_nodes(node)))

    yield from walk(tree.body)


def graph(root: Path, package: str, known: set[str] | None = None
          ) -> dict[str, dict[str, int]]:  # fmt: skip
    """module -> {imported module of the same tree: line}."""
    files = {module_name(p, root, package): p for p in sorted(root.rglob("*.py"))}
    names = set(files) | (known or set())
    out: dict[str, dict[str, int]] = {}
    for mod, path in files.items():
        edges: dict[str, int] = {}
        for name, line in imports(path, mod, path.name == "__init__.py"):
            # The longest prefix that is a module of this tree.
            parts = name.split(".")
            while parts and ".".join(parts) not in names:
                parts.pop()
            if parts and ".".join(parts) != mod:
                edges.setdefault(".".join(parts), line)
        out[mod] = edges
    return out


def part_of(module: str, layers: list[list[str]]) -> tuple[int, str] | None:
    for depth, siblings in enumerate(layers):
        for part in siblings:
            if module == part or module.startswith(part + "."):
                return depth, part
    return None


def layer_violations(edges: dict[str, dict[str, int]], layers: list[list[str]],
                     top: str) -> list[str]:  # fmt: skip
    errors = []
    for mod, targets in edges.items():
        if mod == top:
            continue  # the public facade re-exports everything
        here = part_of(mod, layers)
        for target, line in targets.items():
            if target == top:
                errors.append(f"{mod}:{line} imports the package facade {top} itself")
                continue
            there = part_of(target, layers)
            if here is None or there is None:
                missing = mod if here is None else target
                errors.append(f"{mod}:{line}: {missing} is in no layer of _LAYERS")
                continue
            if there[1] == here[1]:
                continue
            if there[0] == here[0]:
                errors.append(f"{mod}:{line} imports {target}: siblings {here[1]} and "
                              f"{there[1]} must not import each other")  # fmt: skip
            elif there[0] < here[0]:
                errors.append(f"{mod}:{line} imports {target}: {here[1]} is below "
                              f"{there[1]} and may only import downwards")  # fmt: skip
    return errors


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The cycles (one per strongly connected component of two or more modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _package_cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    # A package's __init__ re-exporting its own modules is not a cycle of the code.
    return cycles({
        m: {t: ln for t, ln in ts.items() if not t.startswith(m + ".")}
        for m, ts in edges.items()
    })  # fmt: skip


def test_parts_import_only_downwards() -> None:
    layers = parse_layers(fastload._LAYERS)
    edges = graph(PACKAGE, "fastload", {"fastload._core"})
    errors = layer_violations(edges, layers, "fastload")
    assert not errors, "\n".join(errors)
    # Every folder of the package is a part of the order.
    parts = {p for siblings in layers for p in siblings}
    for sub in PACKAGE.iterdir():
        if sub.is_dir() and (sub / "__init__.py").exists():
            assert f"fastload.{sub.name}" in parts, f"fastload.{sub.name} is in no layer"


def test_no_import_cycles_in_the_package() -> None:
    found = _package_cycles(graph(PACKAGE, "fastload", {"fastload._core"}))
    assert not found, f"import cycles: {found}"


def test_no_import_cycles_in_the_benchmarks() -> None:
    if not BENCHMARKS.is_dir():
        missing("no benchmarks/ beside the tests (an installed test run)")
    edges = graph(BENCHMARKS, "benchmarks")
    # The benchmarks import each other by plain name (their folder is on sys.path).
    plain = {m.split(".", 1)[1]: m for m in edges}
    fixed = {
        m: {plain.get(t.split(".")[0], t): ln for t, ln in _plain_imports(m).items()}
        for m in edges
    }
    found = cycles(fixed)
    assert not found, f"import cycles in benchmarks/: {found}"


def _plain_imports(module: str) -> dict[str, int]:
    rel = module.split(".", 1)[1].replace(".", "/")
    path = BENCHMARKS / f"{rel}.py"
    if not path.exists():
        path = BENCHMARKS / rel / "__init__.py"
    out: dict[str, int] = {}
    local = {p.stem for p in BENCHMARKS.glob("*.py")}
    for name, line in imports(path, module, False):
        head = name.split(".")[0]
        if head in local:
            out.setdefault(head, line)
    return out


def test_the_checker_catches_an_upward_import_a_sibling_and_a_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "toy"
    for sub in ("low", "mid", "side"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .mid import thing\n")
    (pkg / "low" / "a.py").write_text("def f():\n    from ..mid import b\n")  # upwards
    (pkg / "mid" / "b.py").write_text("from ..low import a\nfrom ..side import c\n")
    (pkg / "side" / "c.py").write_text("from . import d\n")
    (pkg / "side" / "d.py").write_text("from .c import x\n")  # c <-> d
    layers = parse_layers("toy.mid | toy.side\ntoy.low")
    edges = graph(pkg, "toy")
    errors = layer_violations(edges, layers, "toy")
    assert any("toy.low.a:2 imports toy.mid.b" in e and "downwards" in e for e in errors)
    assert any("toy.mid.b:2 imports toy.side.c" in e and "siblings" in e for e in errors)
    assert sorted(_package_cycles(edges)) == [["toy.low.a", "toy.mid.b"],
                                              ["toy.side.c", "toy.side.d"]]
