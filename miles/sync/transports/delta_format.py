"""The disk-delta transport's wire format: one version of the weights as a directory of XOR-zstd
frames and an index, and the local copy an engine host patches with it (disk_delta.py has the
layout, the encoding and the two-phase apply that use it).

Written by the trainer (encode, write_atomic), read on every engine host (DeltaCopy.patch: each
frame decompressed, XORed onto the previous bytes, checked against its checksum bound to the name,
dtype and shape). A malformed index is refused field by field (check_index).
Non-goals: the transport's connect, send and commit, and the engine's routes (disk_delta.py).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from miles.sync import files, verify

if TYPE_CHECKING:
    import torch

FORMAT = "miles-delta/2"  # /2: checksums bound to the name, dtype and shape
ENCODING = "xor-zstd"
INDEX = "index.json"


class DeltaError(RuntimeError):
    """A delta that cannot be applied; the message names the tensor (or file) and the cause."""


def version_dir(delta_dir: str, version: int) -> str:
    return os.path.join(delta_dir, f"v{version:08d}")


def join_dir(delta_dir: str, version: int) -> str:
    """Where the catch-up delta from the base to `version` is written for engines that joined mid-run."""
    return version_dir(os.path.join(delta_dir, "join"), version)


# ---- encoding ---------------------------------------------------------------------------------


def xor(a, b):
    """XOR two equal-length uint8 numpy arrays, 8 bytes at a time where the length allows."""
    import numpy as np

    if a.size % 8 == 0:
        return np.bitwise_xor(a.view(np.uint64), b.view(np.uint64)).view(np.uint8)
    return np.bitwise_xor(a, b)


def encode(cctx, name: str, t: "torch.Tensor", prev: "torch.Tensor", shard: str, offset: int) -> tuple:
    """(compressed frame, XOR bytes, index entry) of tensor `t` against `prev` (same dtype and shape)."""
    import torch

    new = t.reshape(-1).view(torch.uint8).numpy()
    x = xor(new, prev.reshape(-1).view(torch.uint8).numpy())
    frame = cctx.compress(x.data)
    dtype = str(t.dtype).removeprefix("torch.")
    entry = {"shard": shard, "offset": offset, "length": len(frame), "nbytes": int(x.size), "dtype": dtype,
             "shape": list(t.shape), "xxh3_128": verify.bound_checksum(name, dtype, list(t.shape), new)}
    return frame, x, entry


def write_atomic(path: str, data: bytes | list) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        for chunk in (data if isinstance(data, list) else [data]):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_base(base_path: str) -> dict[str, "torch.Tensor"]:
    """All tensors of a safetensors checkpoint directory (or single file), by name."""
    import glob

    from safetensors.torch import load_file

    files = [base_path] if os.path.isfile(base_path) else sorted(glob.glob(os.path.join(base_path, "*.safetensors")))
    if not files:
        raise DeltaError(f"base checkpoint {base_path!r} has no *.safetensors files")
    out = {}
    for f in files:
        out.update(load_file(f))
    return out


# ---- engine side: the local copy --------------------------------------------------------------


@dataclass
class DeltaCopy:
    """One host's local copy of the weights: the base checkpoint patched up to `version`."""

    version: int
    tensors: dict  # name -> tensor in the wire dtype (base tensors are cast on first use)

    @classmethod
    def from_base(cls, base_path: str, local_dir: str, base_version: int = 0,
                  check: Callable[[dict], str | None] | None = None) -> "DeltaCopy":
        """Load the base checkpoint, refuse it if `check` names a problem (tensors the served model does
        not have), and only then copy its files into `local_dir`: nothing is copied for a refused base."""
        if os.path.isfile(base_path):
            src = [base_path]
        elif os.path.isdir(base_path):
            src = [os.path.join(base_path, f) for f in sorted(os.listdir(base_path)) if f.endswith(".safetensors")]
        else:
            raise DeltaError(f"base checkpoint {base_path!r} is neither a checkpoint directory nor a file")
        if not src:
            raise DeltaError(f"base checkpoint {base_path!r} has no *.safetensors files")
        try:
            for f in src:
                files.check_regular(f)
            tensors = load_base(base_path)
        except files.UnsafePath as exc:
            raise DeltaError(f"base checkpoint: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - safetensors' own error types: not a checkpoint
            if isinstance(exc, DeltaError):
                raise
            raise DeltaError(f"base checkpoint {base_path!r} is not a safetensors checkpoint ({exc})") from None
        err = check(tensors) if check is not None else None
        if err is not None:
            raise DeltaError(f"base checkpoint {base_path!r} does not fit the served model: {err}")
        if os.path.exists(local_dir) and not os.path.isdir(local_dir):
            raise DeltaError(f"local_dir {local_dir!r} exists and is not a directory")
        os.makedirs(local_dir, exist_ok=True)
        for f in src:  # copied once per host: engines sharing a local dir find it already there
            dst = os.path.join(local_dir, os.path.basename(f))
            if not (os.path.isfile(dst) and os.path.getsize(dst) == os.path.getsize(f)):
                tmp = f"{dst}.tmp-{os.getpid()}"
                shutil.copyfile(f, tmp)
                os.replace(tmp, dst)
        return cls(base_version, tensors)

    def patch(self, vdir: str) -> tuple[int, dict]:
        """Decode and verify every tensor of the delta in `vdir`; returns (version, new tensors).
        Leaves this copy unchanged (advance() applies the result after the fleet commits)."""
        import numpy as np
        import torch
        import zstandard

        from miles.precision import wire

        if not os.path.isdir(vdir):
            raise DeltaError(f"model_path: {vdir!r} is not a directory (send a delta version directory)")
        version, base_version, entries = check_index(self._read_index(vdir), os.path.join(vdir, INDEX))
        if base_version != self.version:
            raise DeltaError(f"delta {vdir} is built on version {base_version} but this host's local copy is at "
                             f"version {self.version}: refusing to apply it (the trainer must send a delta "
                             f"against version {self.version})")
        if version <= self.version:
            raise DeltaError(f"delta {vdir} is version {version}, not newer than this host's local copy "
                             f"(version {self.version})")
        out = {}
        shards: dict[str, bytes] = {}
        dctx = zstandard.ZstdDecompressor()
        for name, e in entries.items():
            where = f"tensor {name!r} (shard {e['shard']!r} of {vdir})"
            prev = wire.from_base(self.tensors, name)  # a quantized weight's first base: the checkpoint's, quantized
            dtype = getattr(torch, e["dtype"], None)
            if prev is None:
                raise DeltaError(f"{where}: the local copy has no tensor of that name")
            if not isinstance(dtype, torch.dtype):
                raise DeltaError(f"{where}: unknown dtype {e['dtype']!r}")
            if list(prev.shape) != e["shape"]:
                raise DeltaError(f"{where}: shape {e['shape']} does not match the local copy's {list(prev.shape)}")
            prev = prev.to(dtype)
            size = prev.numel() * prev.element_size()
            if e["nbytes"] != size:  # checked before decoding: it bounds what the decoder may allocate
                raise DeltaError(f"{where}: nbytes {e['nbytes']} is not the tensor's size ({size} bytes)")
            if e["shard"] not in shards:
                try:
                    shards[e["shard"]] = files.read_inside(vdir, e["shard"])
                except FileNotFoundError:
                    raise DeltaError(f"{where}: the shard file is missing") from None
                except files.UnsafePath as exc:
                    raise DeltaError(f"{where}: {exc}") from None
            data = shards[e["shard"]]
            end = e["offset"] + e["length"]
            if len(data) < end:
                raise DeltaError(f"{where}: the shard file is truncated ({len(data)} bytes, the tensor's frame "
                                 f"ends at byte {end})")
            try:
                raw = dctx.decompress(data[e["offset"]:end], max_output_size=e["nbytes"])
            except zstandard.ZstdError as exc:
                raise DeltaError(f"{where}: the compressed frame is corrupt ({exc})") from None
            if len(raw) != e["nbytes"]:
                raise DeltaError(f"{where}: decoded {len(raw)} bytes, expected {e['nbytes']}")
            new = xor(np.frombuffer(raw, dtype=np.uint8), prev.reshape(-1).view(torch.uint8).numpy())
            digest = verify.bound_checksum(name, e["dtype"], e["shape"], new)
            if digest != e["xxh3_128"]:
                raise DeltaError(f"{where}: checksum mismatch after applying the delta (xxh3-128 of the tensor's "
                                 f"name, dtype, shape and bytes {digest} != {e['xxh3_128']})")
            out[name] = torch.from_numpy(new).view(dtype).reshape(e["shape"])
        return version, out

    def advance(self, version: int, tensors: dict) -> None:
        self.tensors.update(tensors)
        self.version = version

    @staticmethod
    def _read_index(vdir: str) -> dict:
        path = os.path.join(vdir, INDEX)
        try:
            index = json.loads(files.read_inside(vdir, INDEX))
        except FileNotFoundError:
            raise DeltaError(f"delta index {path} is missing (the version was never completely written)") from None
        except files.UnsafePath as exc:
            raise DeltaError(f"delta index {exc}") from None
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise DeltaError(f"delta index {path} is unreadable ({exc})") from None
        if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("encoding") != ENCODING:
            raise DeltaError(f"delta index {path} is not a {FORMAT} / {ENCODING} index")
        return index


# What each tensor's index entry holds, and the type each field must have.
ENTRY = {"shard": str, "offset": int, "length": int, "nbytes": int, "dtype": str, "shape": list, "xxh3_128": str}


def check_index(index: dict, path: str) -> tuple[int, int, dict]:
    """(version, base_version, entries) of an index, every field checked: a malformed index is a
    DeltaError naming the field, never a crash and never a version that is not a number."""
    version, base = index.get("version"), index.get("base_version")
    for key, v in (("version", version), ("base_version", base)):
        if type(v) is not int or v < 0:
            raise DeltaError(f"delta index {path}: {key} must be a non-negative integer, got {v!r}")
    entries = index.get("tensors")
    if not isinstance(entries, dict) or not entries:
        raise DeltaError(f"delta index {path}: tensors must be a non-empty object {{name: entry}}")
    for name, e in entries.items():
        if not isinstance(e, dict) or set(e) != set(ENTRY):
            raise DeltaError(f"delta index {path}: the entry of tensor {name!r} must have exactly the fields "
                             f"{sorted(ENTRY)}")
        for key, kind in ENTRY.items():
            v = e[key]
            if type(v) is not kind or (kind is int and v < 0):
                raise DeltaError(f"delta index {path}: tensor {name!r} field {key!r} must be a "
                                 f"{'non-negative integer' if kind is int else kind.__name__}, got {v!r}")
        if not all(type(d) is int and d >= 0 for d in e["shape"]):
            raise DeltaError(f"delta index {path}: tensor {name!r} shape must be a list of non-negative integers")
    return version, base, entries
