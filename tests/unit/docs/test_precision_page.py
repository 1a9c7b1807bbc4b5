"""docs/precision.md lists every format the code knows (its cited tests are checked in
test_pages_name_real_tests.py)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_every_format_the_code_knows_is_on_the_page():
    from miles.precision.types import FORMATS

    page = (ROOT / "docs" / "precision.md").read_text()
    assert not [n for n in FORMATS if f"| `{n}` |" not in page]
