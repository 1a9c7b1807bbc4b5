"""Reading rows through the Hugging Face `datasets` library.

A path is a .jsonl/.json/.parquet file, a glob of them, a `save_to_disk` directory (a Dataset or a
DatasetDict), or a hub id found in the local cache (offline: nothing is downloaded). `datasets` is
imported here only, when rows are read. Non-goals: checking rows (rows.py), a reader of our own.
"""

from __future__ import annotations

import glob
import json
import os

from miles.data.rows import DataError

_SAVED = ("dataset_dict.json", "state.json")  # what save_to_disk writes
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def load_rows(path: str, split: str) -> list[dict]:
    """Every row of `path` (its `split`, where it holds several) as a plain dict."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    try:
        if os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in _SAVED):
            ds = datasets.load_from_disk(path)
        elif glob.has_magic(path):
            files = sorted(glob.glob(path))
            if not files:
                raise DataError(f"{path}: no file matches")
            ds = datasets.load_dataset(_builder(files, path), data_files=files, split="train")
        elif os.path.isfile(path):
            ds = datasets.load_dataset(_builder([path], path), data_files=[path], split="train")
        elif os.path.splitext(path)[1].lower() in _BUILDERS:
            raise DataError(f"{path}: no such file")
        else:
            ds = datasets.load_dataset(path)  # a directory of data files, or a hub id from the local cache
    except DataError:
        raise
    except Exception as exc:  # the library's own errors, named with the path (and the row, for JSON)
        _diagnose_json(path)
        raise DataError(f"{path}: could not be read as a dataset ({type(exc).__name__}: {exc}); give a "
                        ".jsonl, .json or .parquet file, a glob, a save_to_disk directory or a cached hub id") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{path}: no split {split!r}; it has {', '.join(ds)} (set rollout.task.data.split)")
        ds = ds[split]
    return ds.to_list()


def _builder(files: list[str], path: str) -> str:
    kinds = {_BUILDERS.get(os.path.splitext(f)[1].lower()) for f in files}
    if None in kinds or len(kinds) != 1:
        raise DataError(f"{path}: give .jsonl, .json or .parquet files of one kind (found "
                        f"{', '.join(sorted({os.path.basename(f) for f in files})[:5])})")
    return kinds.pop()


def _diagnose_json(path: str) -> None:
    """Raise a DataError naming the row and field that kept `datasets` from reading JSON rows: a
    malformed line, or a field whose type differs from the first row that has it (a column holds one
    type). Returns when it finds neither, or for other kinds of file."""
    files = sorted(glob.glob(path)) if glob.has_magic(path) else [path]
    types: dict[str, tuple[str, str]] = {}  # field -> (its type, where first seen)
    for f in files:
        ext = os.path.splitext(f)[1].lower()
        if ext not in (".jsonl", ".json") or not os.path.isfile(f):
            return
        with open(f) as fh:
            if ext == ".json":
                try:
                    rows = json.load(fh)
                except ValueError as exc:
                    raise DataError(f"{f}: not valid JSON ({exc})") from None
                rows = rows if isinstance(rows, list) else []
            else:
                rows = []
                for i, line in enumerate(l for l in fh if l.strip()):
                    try:
                        rows.append(json.loads(line))
                    except ValueError as exc:
                        raise DataError(f"{f} row {i}: not valid JSON ({exc})") from None
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise DataError(f"{f} row {i}: a row must be a JSON object, got {type(row).__name__}")
            for key, value in row.items():
                if value is None:
                    continue
                kind = type(value).__name__
                seen = types.setdefault(key, (kind, f"{f} row {i}"))
                if seen[0] != kind and {seen[0], kind} != {"int", "float"}:
                    raise DataError(f"{f} row {i}: field {key!r} is a {kind}, but in {seen[1]} it is a "
                                    f"{seen[0]}; every row's field needs one type (quote numbers as text, or "
                                    "fix the row)")
