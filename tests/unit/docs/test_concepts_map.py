"""The package map in docs/concepts.md names every module of miles/ and nothing that is not there."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def mapped_modules() -> set[str]:
    """Paths under miles/ the map names: a line's first word is a file or a folder/, later lines with
    comma-separated files belong to the folder above them."""
    text = (ROOT / "docs" / "concepts.md").read_text()
    block = re.search(r"## The package\n.*?```\nmiles/\n(.*?)```", text, flags=re.S).group(1)
    names: set[str] = set()
    stack: list[tuple[int, str]] = []  # (indent, folder)
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        head = re.split(r"\s{2,}", line.strip())[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        folder = "/".join(f for _, f in stack)
        for word in [w.strip() for w in head.split(",")]:
            if word.endswith("/"):
                stack.append((indent, word.rstrip("/")))
                names.add(f"{folder}/{word.rstrip('/')}/".lstrip("/"))
            elif "/" in word and word.endswith(".py"):  # e.g. backends/fsdp.py
                names.add(f"{folder}/{word}".lstrip("/"))
                names.add(f"{folder}/{word.rsplit('/', 1)[0]}/".lstrip("/"))
            elif word.endswith(".py"):
                names.add(f"{folder}/{word}".lstrip("/"))
    return names


def test_the_map_matches_the_tree():
    pkg = ROOT / "miles"
    tree = {str(p.relative_to(pkg)) for p in pkg.rglob("*.py")
            if p.name not in ("__init__.py", "__main__.py") and "__pycache__" not in p.parts}
    mapped = mapped_modules()
    files = {m for m in mapped if m.endswith(".py")}
    folders = {m.rstrip("/") for m in mapped if m.endswith("/")}
    unnamed = sorted(tree - files)
    assert not unnamed, f"modules missing from the map in docs/concepts.md: {unnamed}"
    assert not sorted(f for f in files if f not in tree), "the map names modules that do not exist"
    assert not sorted(d for d in folders if not (pkg / d).is_dir()), "the map names folders that do not exist"
