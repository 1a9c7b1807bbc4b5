"""The engine's end of weight updates that every transport shares: staging, the atomic commit,
verification.

  * Transports put received tensors into staging (`stage`), after `validate` has checked them against
    the served model (names, shapes, NaN/Inf). Any refusal (`fail`) discards the whole staging and
    poisons the pending version: its commit is refused, because applying the remainder would publish
    a version that never existed.
  * `commit` applies all staged tensors in one go under the engine's model lock (between two decode
    steps), sets the weight version, and clears staging. Staged memory nobody else holds (broadcast
    receives, copies out of a sender's buffer, checkpoint loads) becomes the parameters' memory
    outright; the memory it displaces is kept (config `reuse_weight_memory`) as the receive buffers
    (`buffer`) of the next version, so a steady-state update neither copies the model again nor
    faults in fresh pages. Memory still owned elsewhere (the disk-delta local copy) is copied. A
    version that arrived whole in one buffer this engine lent a sender (p2p) is adopted in place when
    the sender opts in (`swap_buffers`).
  * `reset_staging` (a miles extension, sent with the first bucket of each version) drops whatever an
    abandoned earlier version left staged or poisoned, so one failed push does not block the next.
    Until then (or until a commit, refused, clears it) every bucket is refused, naming reset_staging:
    the engine cannot tell a new version's first bucket from the dead version's next one, and a
    bucket answered "staged" would belong to a version whose commit can never succeed.
  * a weight the engine serves in a format may arrive as that format's bytes (precision/wire.py):
    it is staged as its dequantized values, and at commit its layer takes the received bytes as its
    stored copy instead of quantizing the values again.
  * the weights checker fills the model with noise and compares it with the trainer's checksums.
  * SGLang's full reload from a safetensors checkpoint stages through the same path.

What is specific to one transport (joining a broadcast group, lending shared-memory buffers, the
disk-delta local copy) lives in that transport's Receiver (miles/sync/transports/<name>.py); this
receiver builds one per registered transport and lets them hook the commit.
Non-goals: NCCL/CUDA (the built-in engine is CPU-only), tensor-parallel resharding on receive.
"""

from __future__ import annotations

import datetime
import glob
import os
import threading

import torch

from miles import versions
from miles.engine_api import bodies
from miles.precision import wire
from miles.sync import files, verify
from miles.sync.transports import TRANSPORTS, TransportReceiver, WeightUpdateError

__all__ = ["WeightReceiver", "WeightUpdateError"]


class WeightReceiver:
    """One per engine: staging, the atomic commit, the weights checker; and, in `parts`, the Receiver
    of every transport registered in TRANSPORTS (by name), built around this receiver."""

    def __init__(self, engine, timeout_s: float = 120.0):
        self.engine = engine
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.lock = threading.Lock()  # one update at a time: collectives must not interleave
        self._staging: dict[str, torch.Tensor] = {}
        self._owned: set[str] = set()  # staged names whose memory only staging holds (adoptable at commit)
        self._spares: dict[int, list[torch.Tensor]] = {}  # nbytes -> uint8 buffers displaced by the last commit
        self._lent_from: dict[str, str] = {}  # staged name -> the lent buffer its bytes are in
        self._quantized: dict[str, list] = {}  # staged name -> the stored matrices it arrived as (wire.py)
        self._decoded: dict[str, tuple] = {}  # wire name -> (payload, values, matrices) validated, not yet staged
        self._poisoned: str | None = None  # why the pending version can no longer be committed
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._session = False  # a verification session is open: reset_tensors is allowed until compare
        self._snapshot_is_clean = False  # the snapshot predates any noise fill (its compare may end the hold)
        self.parts: dict[str, TransportReceiver] = {}
        self.sglang_only = engine.config.sglang_only
        for name in TRANSPORTS:
            receiver = TRANSPORTS.get(name).Receiver
            # In SGLang-only mode a transport that needs a miles extension has no end on this engine.
            if receiver is not None and not (self.sglang_only and receiver.extension is not None):
                self.parts[name] = receiver(self)

    def reset_staging(self) -> None:
        with self.lock:
            self.clear()

    def refused(self, reason: str, stage_only: bool) -> None:
        """A weight-update request was refused: nothing it brought may stay staged. A refused bucket of
        a multi-request version (stage_only) also poisons that version, so its commit is refused too."""
        with self.lock:
            if stage_only and self._poisoned is not None:
                self._clear_staging()  # already dead: the first refusal stays the reason
            elif stage_only:
                self.fail(reason)
            else:
                self.clear()

    def drop_spares(self) -> None:
        """Free the kept receive buffers (the engine is releasing its memory)."""
        with self.lock:
            self._spares.clear()

    def commit(self, weight_version: str | None, flush_cache: bool = True, swap_buffers: bool = False) -> str:
        """Apply everything staged. swap_buffers: the sender will write its next version wherever
        `write_next` says, so a whole version staged in one lent buffer may be adopted in place."""
        with self.lock:
            if self._poisoned is not None:
                why = self._poisoned
                self.clear()
                raise WeightUpdateError(f"commit refused: an earlier bucket of this version failed ({why}); "
                                        "the old weights stay in force, resend the whole version")
            if not self._staging:
                self.clear()
                raise WeightUpdateError("commit refused: nothing is staged (send the version's tensors first); "
                                        f"the engine keeps version {self.engine.weight_version}")
            current = self.engine.weight_version
            if weight_version is not None and not versions.never_backwards(current, weight_version):
                self.clear()
                raise WeightUpdateError(f"weight_version: {weight_version!r} is older than the version in "
                                        f"force ({current!r}); staged weights were discarded and the "
                                        "engine keeps its weights (send a higher version)")
            staged, owned, lent_from, quantized = self._staging, self._owned, self._lent_from, self._quantized
            self._clear_staging()
            sources = set(lent_from.get(n) for n in staged)
            source = sources.pop() if len(sources) == 1 else None
            swap = swap_buffers and source is not None and self.engine.covers_parameters(staged)
            version, displaced = self.engine.apply_weights(staged, weight_version,
                                                           adopt=set(staged) if swap else owned,
                                                           quantized=quantized)
            # Spares the last version did not use are not kept twice.
            self._spares = spare_buffers(displaced, self.engine.model) \
                if not swap and self.engine.config.reuse_weight_memory else {}
            for part in self.parts.values():
                part.committed(source if swap else None)
            if not self._session and self.engine.covers_parameters(staged):
                # Every tensor was overwritten, noise included; inside a session its compare decides.
                self.engine.scheduler.set_unservable(None)
            if flush_cache:
                self.engine.flush_cache()
            return version

    def lent(self, path: str) -> torch.Tensor | None:
        """The buffer at `path` if a transport of this engine lent it to a sender, else None."""
        for part in self.parts.values():
            buf = part.lent(path)
            if buf is not None:
                return buf
        return None

    def write_next(self, path: str) -> str:
        """The lent buffer a sender that committed from `path` must write its next version into."""
        for part in self.parts.values():
            nxt = part.write_next(path)
            if nxt is not None:
                return nxt
        return path

    def close(self) -> None:
        with self.lock:
            for part in self.parts.values():
                part.close()

    # ---- SGLang's full reload ------------------------------------------------------------------

    def stage_checkpoint(self, model_path: str) -> int:
        """Stage every tensor of a Hugging Face safetensors checkpoint directory (SGLang's full reload)."""
        from safetensors.torch import load_file

        shards = sorted(glob.glob(os.path.join(glob.escape(model_path), "*.safetensors")))
        if not shards:
            raise WeightUpdateError(f"model_path: no *.safetensors files in {model_path!r}")
        with self.lock:
            tensors = {}
            for f in shards:
                try:
                    files.check_regular(f)
                    tensors.update(load_file(f))
                except files.UnsafePath as exc:
                    raise self.fail(f"model_path: {exc}") from None
                except Exception as exc:  # noqa: BLE001 - safetensors' own errors: not a checkpoint
                    raise self.fail(f"model_path: {f} is not a safetensors file ({exc})") from None
            err = self.validate(tensors)
            if err is not None:
                raise self.fail(err)
            self.stage(tensors, owned=True)
            return len(tensors)

    # ---- weights checker -----------------------------------------------------------------------

    def check(self, req) -> dict:
        """/weights_checker (SGLang's actions; a MilesCheckWeights body adds the extension's forms):
        snapshot | reset_tensors (noise, see miles/sync/verify.py) | compare (with the snapshot, or with
        an `expected` checksum table) | checksum (per tensor, or per bucket of `buckets`).
        A compare that finds a difference is refused (HTTP 400), as SGLang refuses it."""
        model = self.engine.model
        action = req.action
        expected, buckets = getattr(req, "expected", None), getattr(req, "buckets", None)
        digest = getattr(req, "digest", "xxh3")
        miles = isinstance(req, bodies.MilesCheckWeights)
        if action == "reset_tensors":
            if not self._session:
                raise WeightUpdateError("reset_tensors: allowed only inside a verification session; send action "
                                        "'snapshot' (or, with the checked_weights extension, 'begin_session') "
                                        "first, then push the weights and 'compare'")
            # Held before the fill: no step may run on noise; served again once a compare passes.
            self.engine.scheduler.set_unservable("the weights hold a verification's noise fill until a compare "
                                                 "passes")
        with self.engine.model_lock, torch.no_grad():
            if action == "begin_session" and miles:
                self._session = True
                return {"success": True, "message": "verification session open: reset_tensors, push, compare"}
            if action == "snapshot":
                self._snapshot = {n: t.clone() for n, t in verify.unique_tensors(model).items()}
                self._snapshot_is_clean = self.engine.scheduler.unservable is None
                self._session = True
                return {"success": True, "message": f"snapshot of {len(self._snapshot)} tensors",
                        "tensors": len(self._snapshot)}
            if action == "reset_tensors":
                # Only a snapshot of the weights from before the noise can vouch for them afterwards.
                self._snapshot_is_clean = self._snapshot is not None
                n = verify.noise_fill_(model, getattr(req, "seed", 0))
                return {"success": True, "message": f"reset {n} tensors", "tensors": n}
            if action == "compare" and expected is None:
                if self._snapshot is None:
                    raise WeightUpdateError("compare: no snapshot taken; send action 'snapshot' first")
                snapshot, self._snapshot = self._snapshot, None  # SGLang's checker drops it after use
                self._session = False
                now = verify.unique_tensors(model)
                diff = [n for n, t in snapshot.items() if not torch.equal(t, now[n])]
                if diff:
                    raise WeightUpdateError(f"check tensor equality failed: {len(diff)} tensor(s) differ from "
                                            f"the snapshot: {', '.join(diff[:8])}")
                if self._snapshot_is_clean:
                    self.engine.scheduler.set_unservable(None)
                return {"success": True, "message": f"{len(now)} tensors equal the snapshot", "checked": len(now)}
            if action == "compare":
                if not all(len(v) == 2 and _parse_dtype(v[0]) is not None for v in expected.values()):
                    raise WeightUpdateError("expected: send {name: [dtype, xxh3_128 hex digest]}")
                r = verify.engine_checksums(model, expected, digest)
                ok = not (r["mismatched"] or r["missing"] or r["unexpected"])
                self._session = False
                if ok:
                    self.engine.scheduler.set_unservable(None)
                return {"success": ok, **r}
            if action == "checksum" and buckets is None:
                sums = {n: verify.tensor_checksum(t) for n, t in verify.unique_tensors(model).items()}
                overall = verify.checksum_of_table(sums)
                info = {"checksums": sums, "per_gpu_checksum": overall, "parallelism_info": {
                    "role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
                    "pp_size": 1, "rank": 0, "size": 1}}
                return {"success": True, "message": f"checksums of {len(sums)} tensors", "ranks": [info],
                        "per_engine_checksum": verify.checksum_of_table({"0": overall})}
            if action == "checksum":
                meta = self.engine.param_meta
                if not all(all(len(e) == 2 and e[0] in meta and _parse_dtype(e[1]) is not None for e in b)
                           for b in buckets):
                    raise WeightUpdateError("buckets: send [[[name, dtype], ...], ...] with names of this model")
                return {"success": True, "checksums": verify.engine_bucket_checksums(model, buckets, digest)}
        more = ", begin_session" if miles else ""
        raise WeightUpdateError(f"action: {action!r} is unknown; use snapshot{more}, reset_tensors, compare or checksum")

    # ---- for transports' receivers (call with self.lock held) --------------------------------

    def specs(self, names, dtypes, shapes) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, shape) of each announced tensor; refuses (fail) malformed ones."""
        specs = []
        for name, dt, shape in zip(names, dtypes, shapes):
            dtype = _parse_dtype(dt)
            if dtype is None:
                raise self.fail(f"dtypes: {dt!r} (tensor {name!r}) is not a torch dtype")
            if not isinstance(shape, list) or any(not isinstance(d, int) or d < 0 for d in shape):
                raise self.fail(f"shapes: {shape!r} (tensor {name!r}) is not a list of non-negative ints")
            specs.append((name, dtype, tuple(shape)))
        return specs

    def validate(self, received: dict[str, torch.Tensor], nonfinite: set[str] | None = None) -> str | None:
        """Why `received` cannot be staged, or None. `nonfinite`: the names found holding NaN/Inf when
        every tensor was already screened as it arrived; None screens them here."""
        meta = self.engine.param_meta
        for name, t in received.items():
            if wire.split_name(name) is not None:
                err = self._decode(name, t)
                if err is not None:
                    return err
                continue
            if name not in meta:
                return f"tensor {name!r} is not a parameter of the served model"
            shape, _ = meta[name]
            if tuple(t.shape) != shape:
                return f"tensor {name!r} has shape {list(t.shape)} but the model expects {list(shape)}"
            if (not verify.finite(t)) if nonfinite is None else name in nonfinite:
                return f"tensor {name!r} contains NaN or Inf"
        return None

    def _decode(self, name: str, payload: torch.Tensor) -> str | None:
        """Check and decode a weight that arrived quantized (kept for stage); why it cannot be staged, or None."""
        base, fmt = wire.split_name(name)
        served = getattr(self.engine, "quantized", {}).get(base)
        if served is None:
            return (f"tensor {name!r} arrived in format {fmt!r}, but this engine does not serve {base!r} in a "
                    "format: send it in full precision")
        if served[0].name != fmt:
            return (f"tensor {name!r} arrived in format {fmt!r}, but this engine serves it in {served[0].name!r}: "
                    "send it in full precision or in the engine's format")
        shape, dtype = self.engine.param_meta[base]
        try:
            matrices = wire.decode(payload, shape, fmt, served[1])
        except ValueError as exc:
            return f"tensor {name!r}: {exc}"
        values = wire.values(matrices, dtype, served[1])
        if not verify.finite(values):
            return f"tensor {name!r} contains NaN or Inf"
        self._decoded[name] = (payload, values, matrices)
        return None

    def buffer(self, nbytes: int, device=None) -> torch.Tensor:
        """A (nbytes,) uint8 receive buffer on `device` (default: the host): memory the last commit
        displaced if it fits and lives there, else fresh."""
        device = torch.device(device or "cpu")
        spare = self._spares.get(nbytes, [])
        for i in range(len(spare) - 1, -1, -1):
            if spare[i].device == device:
                return spare.pop(i)
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def stage(self, tensors: dict[str, torch.Tensor], owned: bool, lent: str | None = None) -> None:
        """Put tensors into staging. owned: only staging holds their memory (adoptable at commit);
        lent: the lent buffer they are views of (adoptable as a whole version, see commit). Weights that
        arrived quantized (validated before) are staged as their dequantized values, in memory of their own."""
        if self._poisoned is not None:
            raise WeightUpdateError(
                f"bucket not staged: an earlier bucket of the pending version was refused ({self._poisoned}), so "
                "that version can never be committed; start the version again with reset_staging = true on its "
                "first bucket (or send /update_weights_from_disk {\"reset_staging\": true} first)")
        arrived = {n: t for n, t in tensors.items() if wire.split_name(n) is not None}
        if arrived:
            tensors = {n: t for n, t in tensors.items() if n not in arrived}
            decoded, matrices = {}, {}
            for n, payload in arrived.items():
                kept = self._decoded.pop(n, None)
                if kept is None or kept[0] is not payload:
                    err = self._decode(n, payload)
                    if err is not None:
                        raise self.fail(err)
                    kept = self._decoded.pop(n)
                base = wire.split_name(n)[0]
                decoded[base], matrices[base] = kept[1], kept[2]
            self.stage(decoded, owned=True)
            self._quantized.update(matrices)
        self._staging.update(tensors)
        for n in tensors:
            self._quantized.pop(n, None)  # a later full-precision copy replaces what arrived quantized
            self._lent_from.pop(n, None)
        if lent is not None:
            self._lent_from.update((n, lent) for n in tensors)
        if owned:
            self._owned.update(tensors)
        else:
            self._owned.difference_update(tensors)

    def clear(self) -> None:
        """Discard staging and any poison: the next bucket starts a version afresh."""
        self._clear_staging()
        self._poisoned = None
        for part in self.parts.values():
            part.discarded()

    def fail(self, reason: str) -> WeightUpdateError:
        """Discard staging and refuse the pending version's commit; returns the error to raise."""
        self.clear()
        self._poisoned = reason
        return WeightUpdateError(reason + "; staged weights were discarded")

    def _clear_staging(self) -> None:
        self._staging, self._owned, self._lent_from = {}, set(), {}
        self._quantized, self._decoded = {}, {}


def spare_buffers(displaced: list[torch.Tensor], model) -> dict[int, list[torch.Tensor]]:
    """The memory a commit displaced, as receive buffers by size: each whole storage that no tensor of
    the model still uses. A version staged as views of one buffer (a flattened broadcast) so leaves
    that buffer whole, ready to receive the next one. Shared-memory files stay with the transport
    that mapped them."""
    live = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    spares: dict[int, list[torch.Tensor]] = {}
    for t in displaced:
        storage = t.untyped_storage()
        if storage.data_ptr() in live or storage.filename is not None:
            continue
        live.add(storage.data_ptr())  # once per storage
        whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)  # (storage bytes,)
        spares.setdefault(whole.numel(), []).append(whole)
    return spares


def _parse_dtype(name) -> torch.dtype | None:
    if not isinstance(name, str):
        return None
    dt = getattr(torch, name.removeprefix("torch."), None)
    return dt if isinstance(dt, torch.dtype) else None
