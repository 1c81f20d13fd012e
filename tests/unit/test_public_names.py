"""The public names: what `looprl/__init__.py` exports is what the README and the docs
import."""

import re
from pathlib import Path

import looprl

ROOT = Path(__file__).parents[2]
TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_all_is_pinned_and_every_name_resolves():
    assert sorted(looprl.__all__) == [
        "Config",
        "RLVRWorkflow",
        "TrainSummary",
        "Workflow",
        "load_config",
        "train",
    ]
    for name in looprl.__all__:
        assert getattr(looprl, name).__name__ == name


def test_the_readme_and_the_docs_import_only_public_names():
    imported = set()
    for text in TEXTS:
        for names in re.findall(r"^from looprl import (.+)$", text.read_text(), re.MULTILINE):
            imported |= {n.strip() for n in names.split(",")}
    assert imported and imported <= set(looprl.__all__), imported - set(looprl.__all__)
