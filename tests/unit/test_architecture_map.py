"""The docs' architecture map names every module under looprl/, and nothing that is gone.

The map is the fenced block that starts with `looprl/` on docs/architecture.md. Each
top-level entry (a line indented by two spaces: `cli.py`, `config/`, ...) owns the lines
under it up to the next one. A module `a/b/c.py` must be named in the entry of its
top-level folder `a/` as `c.py`, or as `b/c.py` where two folders hold a file of that
name; a top-level module as its own entry. Package `__init__.py` files are described by
their folder's entry.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "looprl"
PAGE = ROOT / "docs" / "architecture.md"


def map_entries() -> dict[str, str]:
    """Top-level entry name ('cli.py', 'config/') -> the text of its lines."""
    blocks = re.findall(r"^```\n(looprl/\n.*?)^```$", PAGE.read_text(), re.DOTALL | re.MULTILINE)
    assert len(blocks) == 1, f"{PAGE} should hold one fenced block starting with looprl/"
    block = blocks[0]
    entries: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        top = re.match(r"^  (\S+)", line)
        if top:
            current = top.group(1)
            entries[current] = ""
        if current is not None:
            entries[current] += line + "\n"
    return entries


def modules() -> list[Path]:
    return sorted(
        p.relative_to(PACKAGE)
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    )


def test_every_module_is_on_the_map():
    entries = map_entries()
    missing = []
    for module in modules():
        if len(module.parts) == 1:
            if module.name not in entries:
                missing.append(str(module))
            continue
        text = entries.get(module.parts[0] + "/", "")
        names = {module.name, "/".join(module.parts[-2:])}
        if not any(re.search(rf"(?<![\w/]){re.escape(n)}\b", text) for n in names):
            missing.append(str(module))
    assert not missing, f"modules missing from the map in {PAGE}: {missing}"


def test_the_map_names_no_module_that_is_gone():
    present = {str(m) for m in modules()} | {"__init__.py"}
    gone = []
    for entry, text in map_entries().items():
        if entry.endswith(".py"):
            if entry not in present:
                gone.append(entry)
            continue
        if not (PACKAGE / entry).is_dir():
            gone.append(entry)
            continue
        folder = entry.rstrip("/")
        for name in set(re.findall(r"(?<![\w.])([\w/]+\.py)\b", text)):
            found = any(
                m == f"{folder}/{name}" or m.endswith("/" + name) and m.startswith(folder + "/")
                for m in present
            ) or (name == "__init__.py")
            if not found:
                gone.append(f"{folder}/{name}")
    assert not gone, f"the map in {PAGE} names modules that are gone: {gone}"


def test_the_package_keeps_its_size_limits():
    top_level = [p.name for p in PACKAGE.glob("*.py")]
    assert len(top_level) <= 12, f"{len(top_level)} top-level modules: {sorted(top_level)}"
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert not long, f"modules over 600 lines: {long}"
