"""The engine's end of distributed weight updates: join a trainer's group, receive, stage, apply.

Wire contract (SGLang's `update_weights_from_distributed`, plus miles' staging):
  * `init_group` joins a stand-alone gloo group whose rank 0 (the trainer's source) hosts the TCPStore.
    The default process group is never created or touched, so an engine can share a process with
    other torch.distributed users and a trainer can keep its own FSDP group.
  * `receive` first completes the broadcast(s) - always, even when the metadata is wrong, so every
    member of the collective stays in step - then validates names/shapes against the model and puts
    the tensors into staging. Any error discards the whole staging and poisons the pending version:
    its commit is refused, because applying the remainder would publish a version that never existed.
  * `commit` applies all staged tensors in one go under the engine's model lock (between two decode
    steps), sets the weight version, and clears staging. Staged memory nobody else holds (broadcast
    receives, copies out of a sender's buffer, checkpoint loads) becomes the parameters' memory
    outright; the memory it displaces is kept (config `reuse_weight_memory`) as the receive buffers
    of the next version, so a steady-state update neither copies the model again nor faults in fresh
    pages. Memory still owned elsewhere (the disk-delta local copy) is copied. A version that arrived
    whole in one of this engine's p2p buffers is adopted too when the sender opts in (`swap_buffers`):
    the parameters then live in that buffer, and the commit's reply names the buffer the sender must
    write the next version into (the one the parameters just left), so no byte is copied twice.
  * `reset_staging` (a miles extension, sent with the first bucket of each version) drops whatever an
    abandoned earlier version left staged or poisoned, so one failed push does not block the next.
Two wire formats: load_format "flattened_bucket" = ONE uint8 broadcast holding every tensor's bytes
in order (sum of numel * itemsize); load_format None = one broadcast per tensor in its own dtype.

The other transports stage through the same staging and commit:
  * `receive_shm` copies a bucket out of a shared-memory buffer on this host (p2p writes into a
    buffer this engine owns, from `open_p2p_buffer`; colocated hands over a buffer the trainer owns).
  * `stage_delta` patches this engine's local copy of the run's base checkpoint with one disk delta,
    verifies every tensor's checksum, and stages the result; the local copy advances only at commit.
  * the weights checker fills the model with noise and compares it with the trainer's checksums.
Non-goals: NCCL/CUDA (the built-in engine is CPU-only), tensor-parallel resharding on receive.
"""

from __future__ import annotations

import datetime
import logging
import threading
from dataclasses import dataclass

import torch

from miles.rollout.engine.types import InvalidRequest

log = logging.getLogger(__name__)


class WeightUpdateError(InvalidRequest):
    """A weight update the engine refused; the old weights stay in force (HTTP 400)."""


@dataclass
class _Group:
    pg: object  # torch.distributed.ProcessGroupGloo
    store: object  # keeps the TCPStore client alive as long as the group
    rank: int
    world_size: int


class WeightReceiver:
    def __init__(self, engine, timeout_s: float = 120.0):
        self.engine = engine
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._groups: dict[str, _Group] = {}
        self._staging: dict[str, torch.Tensor] = {}
        self._owned: set[str] = set()  # staged names whose memory only staging holds (adoptable at commit)
        self._spares: dict[int, list[torch.Tensor]] = {}  # nbytes -> uint8 buffers displaced by the last commit
        self._from_p2p: dict[str, str] = {}  # staged name -> the own p2p buffer its bytes are in
        self._serving: str | None = None  # the own p2p buffer the parameters live in, if any
        self._write_next: dict[str, str] = {}  # p2p buffer committed from -> buffer to write the next version to
        self._poisoned: str | None = None  # why the pending version can no longer be committed
        self._lock = threading.Lock()  # one update at a time: collectives must not interleave
        self._p2p_buffers: dict[str, torch.Tensor] = {}  # path -> mapping of buffers this engine owns
        # Mappings of senders' buffers (colocated), most recent last: mapping anew for every bucket
        # would fault in every page again. Bounded, since a sender's unlinked buffer stays mapped here.
        self._foreign: dict[str, torch.Tensor] = {}
        self._delta = None  # DeltaCopy: the local copy of the base checkpoint, at its current version
        self._delta_pending = None  # (version, tensors) staged from a delta; becomes the local copy at commit
        self._snapshot: dict[str, torch.Tensor] | None = None

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str = "weight_update_group", backend: str = "gloo") -> str:
        import torch.distributed as dist

        if backend != "gloo":
            raise WeightUpdateError(f"backend: the built-in engine runs on CPU and only supports 'gloo', "
                                    f"got {backend!r}")
        if not 1 <= rank_offset < world_size:
            raise WeightUpdateError(f"rank_offset: {rank_offset} must be in [1, world_size={world_size}); "
                                    "rank 0 is the trainer's source")
        with self._lock:
            store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=self.timeout)
            # The prefix keeps several groups (or a re-initialised one) from colliding in one store.
            pg = dist.ProcessGroupGloo(dist.PrefixStore(group_name, store), rank_offset, world_size, self.timeout)
            self._groups[group_name] = _Group(pg, store, rank_offset, world_size)
            self._clear_staging()
            self._poisoned = None
        return f"joined {group_name!r} as rank {rank_offset} of {world_size}"

    def destroy_group(self, group_name: str) -> None:
        with self._lock:
            self._groups.pop(group_name, None)

    def reset_staging(self) -> None:
        with self._lock:
            self._clear_staging()
            self._poisoned = None
            self._delta_pending = None

    def drop_spares(self) -> None:
        """Free the kept receive buffers (the engine is releasing its memory)."""
        with self._lock:
            self._spares.clear()

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                group_name: str = "weight_update_group", load_format: str | None = None) -> None:
        """Receive one bucket into staging; raises WeightUpdateError (staging discarded) on bad data."""
        if not names:
            return
        with self._lock:
            group = self._groups.get(group_name)
            if group is None:
                raise WeightUpdateError(f"group_name: no weight-update group {group_name!r}; call "
                                        "/init_weights_update_group first")
            # Without dtypes and shapes the receive cannot be sized, so the sender's broadcast will
            # time out: nothing better can be done than refusing at once.
            if not len(names) == len(dtypes) == len(shapes):
                raise self._fail(f"names, dtypes and shapes must have equal lengths, got "
                                 f"{len(names)}, {len(dtypes)}, {len(shapes)}")
            specs = self._specs(names, dtypes, shapes)

            try:
                received, nonfinite = self._broadcast(group, specs, load_format)
            except WeightUpdateError:
                raise
            except Exception as exc:  # noqa: BLE001 - a dead or late peer; the group is unusable now
                self._groups.pop(group_name, None)
                raise self._fail(f"receiving from group {group_name!r} failed ({exc}); re-initialise the "
                                 "group with /init_weights_update_group") from None
            err = self._validate(received, nonfinite)
            if err is not None:
                raise self._fail(err)
            self._stage(received, owned=True)

    def commit(self, weight_version: int | None, flush_cache: bool = True, swap_buffers: bool = False) -> int:
        """Apply everything staged. swap_buffers: the sender will write its next version wherever
        `write_next` says, so a whole version staged in one own p2p buffer may be adopted in place."""
        with self._lock:
            if self._poisoned is not None:
                why, self._poisoned = self._poisoned, None
                self._clear_staging()
                raise WeightUpdateError(f"commit refused: an earlier bucket of this version failed ({why}); "
                                        "the old weights stay in force, resend the whole version")
            staged, owned, from_p2p = self._staging, self._owned, self._from_p2p
            self._clear_staging()
            sources = set(from_p2p.get(n) for n in staged)
            source = sources.pop() if len(sources) == 1 else None
            swap = swap_buffers and source is not None and self.engine.covers_parameters(staged)
            version, displaced = self.engine.apply_weights(staged, weight_version,
                                                           adopt=set(staged) if swap else owned)
            self._spares = {}  # spares the last version did not use are not kept twice
            if swap:
                self._write_next[source] = self._swap_serving(source)
            elif self.engine.config.reuse_weight_memory:
                for t in displaced:
                    flat = t.reshape(-1).view(torch.uint8)
                    self._spares.setdefault(flat.numel(), []).append(flat)
            if self._delta_pending is not None:
                self._delta.advance(*self._delta_pending)
                self._delta_pending = None
            if flush_cache:
                self.engine.flush_cache()
            return version

    def write_next(self, path: str) -> str:
        """The p2p buffer a sender that committed from `path` must write its next version into."""
        return self._write_next.get(path, path)

    # ---- shared memory (p2p on one host, colocated) --------------------------------------------

    def _swap_serving(self, source: str) -> str:
        """The parameters now live in `source`; return the buffer the next version goes to: the one
        they left if nothing points into it any more, else a fresh one of the same size."""
        from miles.sync import shm

        old, self._serving = self._serving, source
        size = self._p2p_buffers[source].numel()
        if old is not None and old != source and old in self._p2p_buffers:
            buf = self._p2p_buffers[old]
            if buf.numel() >= size and not self.engine.points_into(buf):
                return old
        path, buf = shm.create(size, tag="p2p", touch=True)
        self._p2p_buffers[path] = buf
        return path

    def open_p2p_buffer(self, nbytes: int) -> str:
        """Create a receive buffer this engine owns; a p2p sender writes a whole version straight into it."""
        from miles.sync import shm

        path, buf = shm.create(nbytes, tag="p2p", touch=True)
        with self._lock:
            self._p2p_buffers[path] = buf
        return path

    def close_p2p_buffer(self, path: str) -> None:
        from miles.sync import shm

        with self._lock:
            # The buffer the parameters live in outlives its sender: only the engine's exit frees it.
            if path != self._serving and self._p2p_buffers.pop(path, None) is not None:
                shm.unlink(path)
            nxt = self._write_next.pop(path, None)
            if nxt is not None and nxt != self._serving and self._p2p_buffers.pop(nxt, None) is not None:
                shm.unlink(nxt)

    def close(self) -> None:
        from miles.sync import shm

        with self._lock:
            for path in self._p2p_buffers:
                shm.unlink(path)  # mappings the parameters still use stay valid until they are freed
            self._p2p_buffers.clear()

    def receive_shm(self, path: str, names: list[str], dtypes: list[str], shapes: list[list[int]],
                    offsets: list[int]) -> None:
        """Stage one bucket from a shared-memory buffer (this engine's own p2p buffer, or a sender's)."""
        from miles.sync import shm

        if not names:
            return
        with self._lock:
            if not len(names) == len(dtypes) == len(shapes) == len(offsets):
                raise self._fail(f"names, dtypes, shapes and offsets must have equal lengths, got {len(names)}, "
                                 f"{len(dtypes)}, {len(shapes)}, {len(offsets)}")
            specs = self._specs(names, dtypes, shapes)
            if any(type(o) is not int or o < 0 for o in offsets):
                raise self._fail("offsets: expected non-negative integers")
            ends = [off + _numel(s) * torch.empty((), dtype=dt).element_size()
                    for off, (_, dt, s) in zip(offsets, specs)]
            own = path in self._p2p_buffers
            buf = self._p2p_buffers.get(path)
            try:
                if buf is None:
                    buf = self._foreign.pop(path, None)
                    if buf is None or buf.numel() < max(ends):
                        buf = shm.attach(path, max(ends))
                    self._foreign[path] = buf
                    while len(self._foreign) > 2:
                        self._foreign.pop(next(iter(self._foreign)))
                elif buf.numel() < max(ends):
                    raise ValueError(f"the bucket needs {max(ends)} bytes but buffer {path} holds {buf.numel()}")
            except ValueError as exc:
                raise self._fail(f"shm_path: {exc}") from None
            received = {}
            for (name, dtype, shape), off, end in zip(specs, offsets, ends):
                # A p2p buffer this engine owns holds a whole version (each bucket at its own offset,
                # rewritten only by the next version, after commit has copied it out), so it IS the
                # staging; a buffer someone else owns is reused for their next bucket: copy out.
                chunk = buf[off:end] if own else self._buffer(end - off).copy_(buf[off:end])
                received[name] = chunk.view(dtype).reshape(shape)
            del buf
            err = self._validate(received)
            if err is not None:
                raise self._fail(err)
            self._stage(received, owned=not own)
            if own:
                self._from_p2p.update((n, path) for n in received)

    # ---- disk delta --------------------------------------------------------------------------

    def init_delta_base(self, base_path: str, local_dir: str, base_version: int = 0) -> str:
        """Copy the run's base checkpoint into this host's local dir (once) and load it as the local copy."""
        from miles.sync.transports.disk_delta import DeltaCopy

        copy = DeltaCopy.from_base(base_path, local_dir, base_version)
        with self._lock:
            self._delta, self._delta_pending = copy, None
        return f"local copy of {base_path} at version {base_version} in {local_dir}"

    def stage_delta(self, version_dir: str) -> int:
        """Patch the local copy with one delta, verify every tensor, stage it; returns the delta's version."""
        from miles.sync.transports.disk_delta import DeltaError

        with self._lock:
            if self._delta is None:
                raise self._fail("no local base copy: call /init_delta_base before sending disk deltas")
            try:
                version, tensors = self._delta.patch(version_dir)
            except DeltaError as exc:
                raise self._fail(str(exc)) from None
            err = self._validate(tensors)
            if err is not None:
                raise self._fail(err)
            self._stage(tensors, owned=False)  # the local copy keeps these: copied at commit
            self._delta_pending = (version, tensors)
            return version

    @property
    def delta_version(self) -> int | None:
        return None if self._delta is None else self._delta.version

    def stage_checkpoint(self, model_path: str) -> int:
        """Stage every tensor of a Hugging Face safetensors checkpoint directory (SGLang's full reload)."""
        import glob
        import os

        from safetensors.torch import load_file

        files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
        if not files:
            raise WeightUpdateError(f"model_path: no *.safetensors files in {model_path!r}")
        with self._lock:
            tensors = {}
            for f in files:
                tensors.update(load_file(f))
            err = self._validate(tensors)
            if err is not None:
                raise self._fail(err)
            self._stage(tensors, owned=True)
            return len(tensors)

    # ---- weights checker -----------------------------------------------------------------------

    def check(self, action: str, body: dict) -> dict:
        """/weights_checker: snapshot | reset_tensors | compare | checksum (see miles/sync/verify.py)."""
        from miles.sync import verify

        model = self.engine.model
        with self.engine.model_lock, torch.no_grad():
            if action == "snapshot":
                self._snapshot = {n: t.clone() for n, t in verify.unique_tensors(model).items()}
                return {"success": True, "tensors": len(self._snapshot)}
            if action == "reset_tensors":
                seed = body.get("seed", 0)
                if type(seed) is not int:
                    raise WeightUpdateError("seed: expected an integer")
                return {"success": True, "tensors": verify.noise_fill_(model, seed)}
            if action == "compare":
                expected = body.get("expected")
                if expected is None:  # SGLang's form: compare against the last snapshot
                    if self._snapshot is None:
                        raise WeightUpdateError("compare: no snapshot taken; send action 'snapshot' first or "
                                                "pass 'expected': {name: [dtype, xxh3_128]}")
                    now = verify.unique_tensors(model)
                    diff = [n for n, t in self._snapshot.items() if not torch.equal(t, now[n])]
                    return {"success": not diff, "mismatched": diff, "missing": [], "unexpected": [],
                            "checked": len(now)}
                if not isinstance(expected, dict) or not all(
                        isinstance(v, list) and len(v) == 2 and _parse_dtype(v[0]) is not None
                        for v in expected.values()):
                    raise WeightUpdateError("expected: send {name: [dtype, xxh3_128 hex digest]}")
                r = verify.engine_checksums(model, expected)
                return {"success": not (r["mismatched"] or r["missing"] or r["unexpected"]), **r}
            if action == "checksum":
                buckets = body.get("buckets")
                meta = self.engine.param_meta
                if not isinstance(buckets, list) or not all(
                        isinstance(b, list) and all(isinstance(e, list) and len(e) == 2 and e[0] in meta
                                                    and _parse_dtype(e[1]) is not None for e in b)
                        for b in buckets):
                    raise WeightUpdateError("buckets: send [[[name, dtype], ...], ...] with names of this model")
                return {"success": True, "checksums": verify.engine_bucket_checksums(model, buckets)}
        raise WeightUpdateError(f"action: {action!r} is unknown; use snapshot, reset_tensors, compare or checksum")

    @property
    def staged_names(self) -> list[str]:
        return list(self._staging)

    def _broadcast(self, group: _Group, specs, load_format: str | None
                   ) -> tuple[dict[str, torch.Tensor], set[str] | None]:
        """The received tensors, and the names among them holding NaN/Inf when the format screens
        them on arrival (flattened_small; None otherwise)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        out: dict[str, torch.Tensor] = {}
        nonfinite: set[str] | None = None  # screened names holding NaN/Inf; None: not screened yet
        if load_format == "flattened_bucket":
            nbytes = [_numel(s) * torch.empty((), dtype=dt).element_size() for _, dt, s in specs]
            flat = torch.empty(sum(nbytes), dtype=torch.uint8)
            if flat.numel():
                group.pg.broadcast([flat], opts).wait()
            offset = 0
            for (name, dtype, shape), n in zip(specs, nbytes):
                chunk = flat[offset:offset + n]
                # The bucket buffer is fresh and held only by staging, so aligned chunks are staged as
                # views (no copy); viewing bytes at a misaligned offset as a wider dtype is not allowed,
                # so those few are re-based by a copy.
                if offset % torch.empty((), dtype=dtype).element_size():
                    chunk = chunk.clone()
                out[name] = chunk.view(dtype).reshape(shape)
                offset += n
        elif load_format == "flattened_small":
            # Tensors under SPLIT_BYTES arrive in one flat broadcast, in order; every larger one then
            # arrives alone, straight into its own buffer, so the sender never copies it to flatten.
            from miles.sync.transports.broadcast import SPLIT_BYTES

            sizes = [_numel(s) * torch.empty((), dtype=dt).element_size() for _, dt, s in specs]
            small = [(spec, n) for spec, n in zip(specs, sizes) if n < SPLIT_BYTES]
            large = [(spec, n) for spec, n in zip(specs, sizes) if n >= SPLIT_BYTES]
            # Every receive is queued at once (gloo completes them in order), so each tensor is
            # screened for NaN/Inf while the ones after it are still arriving.
            flat = torch.empty(sum(n for _, n in small), dtype=torch.uint8) if small else None
            bufs = [self._buffer(n) for _, n in large]
            works = ([group.pg.broadcast([flat], opts)] if small else []) + \
                [group.pg.broadcast([b], opts) for b in bufs]
            nonfinite = set()
            if small:
                works.pop(0).wait()
                offset = 0
                for (name, dtype, shape), n in small:
                    out[name] = flat[offset:offset + n].clone().view(dtype).reshape(shape)
                    offset += n
                    if not _finite(out[name]):
                        nonfinite.add(name)
            for ((name, dtype, shape), _), buf, work in zip(large, bufs, works):
                work.wait()
                out[name] = buf.view(dtype).reshape(shape)
                if not _finite(out[name]):
                    nonfinite.add(name)
            out = {name: out[name] for name, _, _ in specs}
        elif load_format is None:
            for name, dtype, shape in specs:
                t = self._buffer(_numel(shape) * torch.empty((), dtype=dtype).element_size()).view(dtype).reshape(shape)
                group.pg.broadcast([t], opts).wait()
                out[name] = t
        else:
            raise self._fail(f"load_format: {load_format!r} is not supported; use 'flattened_bucket', "
                             "'flattened_small' or null")
        return out, nonfinite

    def _specs(self, names, dtypes, shapes) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        specs = []
        for name, dt, shape in zip(names, dtypes, shapes):
            dtype = _parse_dtype(dt)
            if dtype is None:
                raise self._fail(f"dtypes: {dt!r} (tensor {name!r}) is not a torch dtype")
            if not isinstance(shape, list) or any(not isinstance(d, int) or d < 0 for d in shape):
                raise self._fail(f"shapes: {shape!r} (tensor {name!r}) is not a list of non-negative ints")
            specs.append((name, dtype, tuple(shape)))
        return specs

    def _validate(self, received: dict[str, torch.Tensor], nonfinite: set[str] | None = None) -> str | None:
        """Why `received` cannot be staged, or None. `nonfinite`: the names found holding NaN/Inf when
        every tensor was already screened as it arrived; None screens them here."""
        meta = self.engine.param_meta
        for name, t in received.items():
            if name not in meta:
                return f"tensor {name!r} is not a parameter of the served model"
            shape, _ = meta[name]
            if tuple(t.shape) != shape:
                return f"tensor {name!r} has shape {list(t.shape)} but the model expects {list(shape)}"
            if (not _finite(t)) if nonfinite is None else name in nonfinite:
                return f"tensor {name!r} contains NaN or Inf"
        return None

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """A (nbytes,) uint8 receive buffer: memory the last commit displaced if it fits, else fresh."""
        spare = self._spares.get(nbytes)
        return spare.pop() if spare else torch.empty(nbytes, dtype=torch.uint8)

    def _stage(self, tensors: dict[str, torch.Tensor], owned: bool) -> None:
        self._staging.update(tensors)
        for n in tensors:
            self._from_p2p.pop(n, None)
        if owned:
            self._owned.update(tensors)
        else:
            self._owned.difference_update(tensors)

    def _clear_staging(self) -> None:
        self._staging, self._owned, self._from_p2p = {}, set(), {}

    def _fail(self, reason: str) -> WeightUpdateError:
        self._clear_staging()
        self._delta_pending = None
        self._poisoned = reason
        return WeightUpdateError(reason + "; staged weights were discarded")


def _finite(t: torch.Tensor) -> bool:
    # The sum is a fast screen (a NaN or Inf makes it non-finite); only then is the exact, several
    # times slower, element-wise check paid, to tell a real NaN from a sum overflow.
    return not t.is_floating_point() or bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _parse_dtype(name) -> torch.dtype | None:
    if not isinstance(name, str):
        return None
    dt = getattr(torch, name.removeprefix("torch."), None)
    return dt if isinstance(dt, torch.dtype) else None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
