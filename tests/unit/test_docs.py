"""The README stays a few screens long and its links into docs/ land on a page and a
heading that exist; nothing in the README or the docs points outside the repository.

Anchors are checked with the slug MkDocs gives a heading (Python-Markdown's toc:
lowercase, punctuation dropped, spaces to '-', a repeated heading suffixed `_1`), so a
README link that GitHub follows also works on the built site. The docs pages' own links
are checked by `mkdocs build --strict`.
"""

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text.replace("`", "").replace("*", ""))
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def outside_fences(text: str) -> str:
    return re.sub(r"^```.*?^```$", "", text, flags=re.DOTALL | re.MULTILINE)


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+?)#*$", outside_fences(page.read_text()), re.M):
        base, n = slug(heading.strip()), 0
        name = base
        while name in found:
            n += 1
            name = f"{base}_{n}"
        found.add(name)
    return found


def relative_links(page: Path) -> list[str]:
    return [
        target
        for target in LINK.findall(outside_fences(page.read_text()))
        if not re.match(r"^[a-z]+:", target)  # http:, https:, mailto:
    ]


def test_the_readme_is_a_few_screens():
    lines = len(README.read_text().splitlines())
    assert lines <= 250, f"README.md has {lines} lines; move sections into docs/ (<= 250)"


def test_the_readme_links_to_pages_and_headings_that_exist():
    broken = []
    for target in relative_links(README):
        path, _, anchor = target.partition("#")
        page = (ROOT / path) if path else README
        if not page.is_file():
            broken.append(f"{target}: no file {page.relative_to(ROOT)}")
        elif anchor and page.suffix == ".md" and anchor not in anchors(page):
            broken.append(f"{target}: no heading with anchor #{anchor} in {path or 'README.md'}")
    assert not broken, broken


def test_the_readme_links_into_the_docs():
    pages = {t.partition("#")[0] for t in relative_links(README)}
    assert "docs/index.md" in pages, "the README should link the docs' first page"


def test_nothing_points_outside_the_repository():
    outside = []
    for page in [README, *sorted(DOCS.rglob("*.md"))]:
        for target in relative_links(page):
            path = target.partition("#")[0]
            if path and not (page.parent / path).resolve().is_relative_to(ROOT):
                outside.append(f"{page.relative_to(ROOT)}: {target}")
        if "/work/shared" in page.read_text() or "../shared" in page.read_text():
            outside.append(f"{page.relative_to(ROOT)}: names a path outside the repository")
    assert not outside, outside


def test_the_slug_is_the_one_mkdocs_gives():
    toc = pytest.importorskip("markdown.extensions.toc")
    for heading in [
        "Warm start: SFT and distillation",
        "Scaling out: Ray, replicas, data-parallel training",
        "The Responses API and Anthropic's Messages API",
        "Précision (bf16) -- on every CPU",
    ]:
        assert slug(heading) == toc.slugify(heading, "-"), heading
    assert slug("`engine.type`: local, vLLM, SGLang") == "enginetype-local-vllm-sglang"
    assert slug("Tests that need a GPU: `make test-gpu`") == "tests-that-need-a-gpu-make-test-gpu"


def test_the_agent_shown_is_the_example_in_the_repository():
    example = (ROOT / "examples" / "custom_workflow.py").read_text()
    code = example[example.index("import re\n") :]
    for page in [README, DOCS / "your-agent.md"]:
        blocks = re.findall(r"^```python\n(.*?)^```$", page.read_text(), re.DOTALL | re.MULTILINE)
        assert code in blocks, f"{page.relative_to(ROOT)} should show examples/custom_workflow.py"
