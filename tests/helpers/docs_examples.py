"""The example files of a docs page (blocks marked `<!-- file: NAME -->`), written out importable.

Docs examples are tested by loading them exactly as a user would: as modules on sys.path, named in a
run config as `module:attr`.
"""

from __future__ import annotations

import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

DOCS = Path(__file__).resolve().parents[2] / "docs"


def example_files(page: str) -> dict[str, str]:
    """{file name: code} of the blocks marked `<!-- file: NAME -->` in a docs page."""
    text = (DOCS / page).read_text()
    return dict(re.findall(r"<!-- file: (\S+) -->\n```python\n(.*?)```", text, flags=re.S))


@contextmanager
def importable_examples(page: str, where: Path) -> Iterator[dict[str, str]]:
    """Write the page's example files into `where`, put it on sys.path, and forget them afterwards."""
    files = example_files(page)
    for name, code in files.items():
        (where / name).write_text(code)
    sys.path.insert(0, str(where))
    try:
        yield files
    finally:
        sys.path.remove(str(where))
        for name in files:
            sys.modules.pop(name.removesuffix(".py"), None)
