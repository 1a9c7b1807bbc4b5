"""Verification that engines hold exactly the trainer's weights.

Two checks, both answering "did the transport write every tensor, bit for bit?":
  * noise fill (first update): before the first update every engine tensor is overwritten with
    random values; after it, every engine tensor is compared with the trainer's converted tensor by
    xxh3-128 checksum. A tensor the transport skipped still holds noise and fails, by name.
  * per-bucket checksums (later updates): one xxh3-128 digest per bucket, compared after commit.
    Cheap (one hash pass over the bytes already in memory) and catches drift or a dropped tensor.
Two digests: xxh3-128 over the bytes on the host (the default), and `sum64` for tensors on a GPU: two
position-weighted sums of the bytes as 64-bit words, wrapping, computed where the tensors are, so a
push from GPU memory is verified without copying the weights to the host (the `device_digest`
extension; any changed word or two swapped words change it, like a checksum and unlike a hash
against an adversary, which verification does not defend against).
Checksums are taken over the bytes in the trainer's wire dtype; the engine casts its copy to that
dtype first (an upcast on receive and a downcast here is exact), so an fp32 engine fed bf16 passes.
Tied weights (one storage, two names) count once, under the first name, on both sides.
Non-goals: tolerance-based comparisons; a mismatch is a bug, never noise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from miles.sync.transports.base import TransportError

if TYPE_CHECKING:
    import torch


class VerificationError(TransportError):
    """An engine's weights differ from the trainer's; the message names the engine and tensors."""


def tensor_bytes(t: "torch.Tensor"):
    """A numpy view of the tensor's bytes (works for bf16, which numpy lacks): zero-copy on the host, one
    copy to the host for a tensor on a GPU."""
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()


# Odd multipliers and offsets of sum64's two word weights (the 64-bit golden ratio, and constants
# of splitmix64): each weight is odd for every position, so one changed word always changes the sum.
_K1, _C1 = -7046029254386353131, 0x632BE59BD9B4E019  # 0x9E3779B97F4A7C15 as int64
_K2, _C2 = -4658895280553007687, 0x3C6EF372FE94F82A  # 0xBF58476D1CE4E5B9 as int64
_CHUNK = 1 << 24  # words per pass: bounds the temporaries on the device (3 x 128 MiB)
_MASK = (1 << 64) - 1


def sum64(tensors: Iterable["torch.Tensor"]) -> str:
    """Two position-weighted sums mod 2**64 over the tensors' bytes as 64-bit words (each tensor padded
    with zero bytes to whole words), on the tensors' own device: 32 hex digits."""
    import torch

    s1 = s2 = pos = 0
    for t in tensors:
        b = t.detach().contiguous().reshape(-1).view(torch.uint8)
        if b.numel() % 8:
            b = torch.cat([b, b.new_zeros(8 - b.numel() % 8)])
        words = b.view(torch.int64)
        for a in range(0, words.numel(), _CHUNK):
            x = words[a:a + _CHUNK]
            i = torch.arange(pos + a, pos + a + x.numel(), dtype=torch.int64, device=x.device)
            w1 = (i * _K1 + _C1) | 1  # (n,) int64, wrapping; odd
            w2 = ((i ^ 0x5555555555555555) * _K2 + _C2) | 1
            s1 = (s1 + int((x * w1).sum())) & _MASK
            s2 = (s2 + int((x * w2).sum())) & _MASK
        pos += words.numel()
    return f"{s1:016x}{s2:016x}"


def tensor_checksum(t: "torch.Tensor", digest: str = "xxh3") -> str:
    if digest == "sum64":
        return sum64([t])
    import xxhash

    return xxhash.xxh3_128_hexdigest(tensor_bytes(t))


def bound_checksum(name: str, dtype: str, shape, data) -> str:
    """xxh3-128 over a tensor's name, dtype and shape, then its bytes: a digest that vouches for these
    bytes AS this tensor, so entries swapped between two tensors of equal shape fail it."""
    import xxhash

    h = xxhash.xxh3_128()
    h.update(f"{name}\0{dtype}\0{','.join(str(d) for d in shape)}\0".encode())
    h.update(data)
    return h.hexdigest()


def bucket_checksum(tensors: Iterable["torch.Tensor"], digest: str = "xxh3") -> str:
    if digest == "sum64":
        return sum64(tensors)
    import xxhash

    h = xxhash.xxh3_128()
    for t in tensors:
        h.update(tensor_bytes(t))
    return h.hexdigest()


def checksum_of_table(checksums: dict[str, str]) -> str:
    """One digest over a {name: checksum} table, independent of its order."""
    import xxhash

    h = xxhash.xxh3_128()
    for name in sorted(checksums):
        h.update(name.encode() + b"\0" + checksums[name].encode() + b"\0")
    return h.hexdigest()


def dtype_name(t: "torch.Tensor") -> str:
    return str(t.dtype).removeprefix("torch.")


# ---- engine side ------------------------------------------------------------------------------


def unique_tensors(model) -> dict[str, "torch.Tensor"]:
    """The model's tensors by HF name, tied aliases dropped (first name wins, as on the trainer)."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        # Tied names are one tensor: same first element, same size. Not the storage: tensors received
        # as one flat bucket are views of one storage without being tied.
        key = _storage(t)
        if key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def noise_fill_(model, seed: int = 0) -> int:
    """Overwrite every tensor with random values (floats ~ N(0,1), ints random bits); returns the count."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tensors = unique_tensors(model)
    with torch.no_grad():
        for t in tensors.values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32))
            else:
                t.copy_(torch.randint(0, 2**7, t.shape, generator=g).to(t.dtype))
    return len(tensors)


def engine_checksums(model, expected: dict[str, list], digest: str = "xxh3") -> dict:
    """Compare the engine with {name: [dtype, checksum]}: mismatched, missing and unexpected names."""
    import torch

    everything = model.state_dict()  # tied aliases included: a trainer may send either name
    mismatched, covered = [], set()
    for name, (dtype, want) in expected.items():
        t = everything.get(name)
        if t is None:
            continue
        covered.add(_storage(t))
        if tensor_checksum(t.to(getattr(torch, dtype)), digest) != want:
            mismatched.append(name)
    unexpected = [n for n, t in unique_tensors(model).items() if _storage(t) not in covered]
    return {"mismatched": mismatched, "missing": sorted(set(expected) - set(everything)),
            "unexpected": sorted(unexpected), "checked": len(expected)}


def _storage(t) -> tuple | int:
    """What tied tensors share and untied ones never do."""
    return (t.data_ptr(), t.numel() * t.element_size()) if t.numel() else id(t)


def engine_bucket_checksums(model, buckets: list[list[list[str]]], digest: str = "xxh3") -> list[str]:
    """One digest per bucket of [[name, dtype], ...], over the engine's copies cast to those dtypes."""
    import torch

    mine = model.state_dict()
    return [bucket_checksum((mine[n].to(getattr(torch, dt)) for n, dt in b), digest) for b in buckets]


# ---- trainer side -----------------------------------------------------------------------------


def noise_fill(client, urls: list[str], seed: int = 0) -> None:
    # The engine fills with noise only inside a verification session, and holds generation until
    # the session's compare passes.
    client.post_all(urls, "/weights_checker", {"action": "begin_session"})
    client.post_all(urls, "/weights_checker", {"action": "reset_tensors", "seed": seed})


def compare_full(client, urls: list[str], expected: dict[str, list], digest: str = "xxh3") -> None:
    """Every engine tensor must equal the trainer's; raise VerificationError naming what differs."""
    problems = []
    body = {"action": "compare", "expected": expected, **_digest_field(digest)}
    for url, r in zip(urls, client.post_all(urls, "/weights_checker", body)):
        parts = []
        if r["mismatched"]:
            parts.append(f"{len(r['mismatched'])} tensor(s) differ from the trainer's (never written by the "
                         f"update, so still holding the noise fill, or corrupted): {_names(r['mismatched'])}")
        if r["unexpected"]:
            parts.append(f"{len(r['unexpected'])} engine tensor(s) the trainer never prepared (check the "
                         f"converter): {_names(r['unexpected'])}")
        if r["missing"]:
            parts.append(f"the trainer sent tensor(s) the engine does not have: {_names(r['missing'])}")
        if parts:
            problems.append(f"engine {url}: " + "; ".join(parts))
    if problems:
        raise VerificationError("weight verification failed: " + " | ".join(problems))


def compare_buckets(client, urls: list[str], buckets: list[list[list[str]]], digests: list[str],
                    digest: str = "xxh3") -> None:
    problems = []
    body = {"action": "checksum", "buckets": buckets, **_digest_field(digest)}
    for url, r in zip(urls, client.post_all(urls, "/weights_checker", body)):
        bad = [i for i, (a, b) in enumerate(zip(r["checksums"], digests)) if a != b]
        if bad:
            problems.append(f"engine {url}: bucket(s) {bad} differ from the trainer (first tensors: "
                            f"{_names([buckets[i][0][0] for i in bad])})")
    if problems:
        raise VerificationError("per-bucket checksum mismatch after commit: " + " | ".join(problems))


def compare_across_engines(client, urls: list[str]) -> None:
    """SGLang's per-engine checksums (/weights_checker action "checksum") must agree on every engine;
    raise VerificationError naming the tensors where an engine differs from the first one."""
    replies = client.post_all(urls, "/weights_checker", {"action": "checksum"})
    first = _table(replies[0])
    problems = []
    for url, r in zip(urls[1:], replies[1:]):
        mine = _table(r)
        diff = sorted(n for n in set(first) | set(mine) if first.get(n) != mine.get(n))
        if diff:
            problems.append(f"engine {url} differs from {urls[0]} in {len(diff)} tensor(s): {_names(diff)}")
    if problems:
        raise VerificationError("engines hold different weights after the update: " + " | ".join(problems))


def _table(reply: dict) -> dict[str, str]:
    """{tensor name: checksum} over every rank of one engine's checksum reply."""
    out = {}
    for rank in reply.get("ranks") or []:
        out.update(rank.get("checksums", {}))
    return out


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def finite(t: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN/Inf (what an engine refuses to stage)."""
    import torch

    # The sum is a fast screen (a NaN or Inf makes it non-finite); only then is the exact, several
    # times slower, element-wise check paid, to tell a real NaN from a sum overflow.
    return not t.is_floating_point() or bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _digest_field(digest: str) -> dict:
    # Sent only when it is not the default, so engines without the device_digest extension see the body
    # they always did.
    return {} if digest == "xxh3" else {"digest": digest}
