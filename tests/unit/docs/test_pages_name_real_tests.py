"""Pages that back each claim with a test they name (`tests/...py::test_name`): every name must be a
test that exists, and each page keeps citing its evidence."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("page, cited", [("security.md", 20), ("precision.md", 20), ("scaling.md", 8),
                                         ("resume.md", 15),
                                         ("cluster.md", 8), ("rewards.md", 13), ("data.md", 6),
                                         ("eval.md", 5), ("models.md", 20)])
def test_every_test_the_page_names_exists(page, cited):
    text = (ROOT / "docs" / page).read_text()
    refs = re.findall(r"`(tests/[\w/]+\.py)::(\w+)(?:\[[\w-]+\])?`", text)
    assert len(refs) >= cited  # the page keeps citing its evidence
    missing = []
    for path, name in set(refs):
        file = ROOT / path
        defined = {n.name for n in ast.walk(ast.parse(file.read_text())) if isinstance(n, ast.FunctionDef)} \
            if file.is_file() else set()
        if name not in defined:
            missing.append(f"{path}::{name}")
    assert not missing, f"docs/{page} names tests that do not exist: {missing}"
