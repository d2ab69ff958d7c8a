"""The map of the code (docs/DESIGN.md) against the code, where a test can read both: the
layer diagram against ``_LAYERS``, what ``import fastload`` imports, where torch is
imported, the index's tables against docs/index-format.md. A change that makes the map
wrong fails here, naming the line to fix."""

from __future__ import annotations

import re
from pathlib import Path

import fastload
from test_imports import _run
from test_layers import PACKAGE, imports, module_name, parse_layers

ROOT = Path(__file__).resolve().parents[1]
DESIGN = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")


def _diagram() -> list[list[str]]:
    """The layers the Layout section draws: its first block's lines whose left column
    names parts (a line starting with spaces or ``|`` continues the one above)."""
    layout = DESIGN[DESIGN.index("## Layout"):]
    block = layout[layout.index("```\n") + 4:]
    block = block[: block.index("```")]
    layers = []
    for line in block.splitlines():
        left = re.split(r"\s{2,}", line, maxsplit=1)[0]
        if not left.strip() or left.startswith((" ", "|")):
            continue
        layers.append([p.strip() for p in left.split("|")])
    return layers


def test_the_layer_diagram_is_layers() -> None:
    want = [[name.removeprefix("fastload.") for name in layer]
            for layer in parse_layers(fastload._LAYERS)]  # fmt: skip
    assert _diagram() == want


# What `import fastload` imports, and the words the map says it with.
IMPORTED = {
    "fastload": "`import fastload`",
    "fastload.errors": "the exceptions",
    "fastload._util": "`_util`",
    "fastload.sources": "`sources` (the package",
    "fastload.sources.base": "base.py",
    "fastload.sources.http": "http.py",
    "fastload.sources.download": "download.py",
}


def test_what_import_fastload_imports_is_what_the_map_says() -> None:
    ours = {m for m in _run("import fastload") if m == "fastload" or m.startswith("fastload.")}
    assert ours == set(IMPORTED), "update the map's `import fastload` line and IMPORTED"
    start = DESIGN.index("imports fastload): `import fastload` imports")
    claim = " ".join(DESIGN[start: DESIGN.index("nothing", start)].split())
    for module, words in IMPORTED.items():
        assert words in claim, (module, claim)


def test_torch_is_imported_where_the_map_says() -> None:
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path, PACKAGE, "fastload")
        if any(name == "torch" or name.startswith("torch.")
               for name, _ in imports(path, module, path.name == "__init__.py")):  # fmt: skip
            found.add(str(path.relative_to(PACKAGE)))
    outside = {p for p in found if not p.startswith("data/")}
    assert outside == {"staging/fanout/run.py", "staging/fanout/over_torch.py",
                       "torchvision.py"}, outside  # fmt: skip
    start = DESIGN.index("torch is imported only in")
    claim = " ".join(DESIGN[start: DESIGN.index("\n- ", start)].split())
    assert "`fastload.data`" in claim and all(p in claim for p in sorted(outside)), claim


def test_the_index_tables_are_the_formats() -> None:
    layout = (ROOT / "docs" / "index-format.md").read_text(encoding="utf-8")
    tables = re.findall(r"^\| (\w+) table \|", layout, flags=re.M)
    assert len(tables) >= 6, tables
    start = DESIGN.index("Reading: an index file describes")
    claim = " ".join(DESIGN[start: DESIGN.index("tables", start)].split())
    assert all(t in claim for t in tables), (tables, claim)
