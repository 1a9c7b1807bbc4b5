"""The fast decode step: the model runner's decode over the static KV cache, one step behind on the host.

`FastDecoder.setup` decides whether it serves an engine (EngineConfig.fast_decode, a supported model
family, a KV budget that gives every row its context) and swaps the runner's KV for a StaticKV
(static_kv.py). `step` is then the runner's decode():
  * the batch's sampling parameters as device tensors, rebuilt only when the rows list is replaced
    (admission, compaction); the step's uniforms drawn on the host (seeded rows from their own
    generators, as on the eager path) and sent in one copy;
  * the forward (decode_forward.py): a CUDA graph replay at the step's buckets (graphs.py), or, for a
    batch with LoRA adapters or recording routed experts, the same forward run eagerly with its hooks;
  * sampling on the device, the next inputs written on the device (StaticKV.advance);
  * one step behind on the host: the step's tokens and logprobs start their copy to the host, and
    only then is the previous step's copy waited for and recorded (stop checks, streaming, answers
    follow in the scheduler), so the host's bookkeeping runs while the device computes. A row's finish
    is seen one step late and its extra token ignored, as for any finished row still in the batch; a
    step every row of which finishes by its length is not launched. `flush` records the pending
    step; the runner flushes before a retract, the scheduler before a pause.

Non-goals: the forward itself (decode_forward.py), graph capture (graphs.py), the KV layout
(static_kv.py), prefill (model_runner.py, chunked_prefill.py).
"""

from __future__ import annotations

import logging
import time

import torch

from miles.models.moe import hook_routers
from miles.engine.decode_forward import DecodeForward, unsupported
from miles.engine.graphs import DecodeGraphs, length_bucket
from miles.engine.row import Row
from miles.engine.sampler import SamplingBatch
from miles.engine.static_kv import StaticKV

log = logging.getLogger(__name__)


class FastDecoder:
    def __init__(self, runner, graphs: DecodeGraphs):
        self.runner = runner  # the ModelRunner whose batch this decodes (its rows, KV, locks and bookkeeping)
        self.graphs = graphs
        self.sampling: tuple[list[Row], SamplingBatch] | None = None  # for the rows list it was built for
        # The launched step not yet recorded: (rows, host copy, its event, routed ids, weights epoch, version).
        self.pending: tuple | None = None

    @classmethod
    def setup(cls, runner) -> FastDecoder | None:
        """A decoder for `runner` when fast_decode serves it (its KV then becomes a StaticKV, and its context
        length the slot capacity when that is shorter), else None."""
        cfg, on_cuda = runner.config, runner.device.type == "cuda"
        if cfg.fast_decode == "off" or (cfg.fast_decode == "auto" and not on_cuda):
            return None
        reason = unsupported(runner.model)
        if reason is not None:
            log.warning("fast_decode: %s; decoding on the eager path", reason)
            return None
        slots = cfg.max_batch_size
        cap = min(runner.context_length, runner.kv_budget // slots)
        if cap < runner.context_length and cfg.fast_decode == "auto":
            log.warning("fast_decode off: a static KV cache of max_batch_size = %d rows x context_length = %d tokens "
                        "exceeds the KV budget (%d tokens); lower context_length or max_batch_size, raise "
                        "memory_fraction, or set fast_decode = 'on' to serve a context of %d tokens",
                        slots, runner.context_length, runner.kv_budget, cap)
            return None
        if cap < 2:
            log.warning("fast_decode off: the KV budget (%d tokens) leaves no room per row for %d rows",
                        runner.kv_budget, slots)
            return None
        if cap < runner.context_length:
            log.warning("fast_decode: serving a context of %d tokens (of %d) so that %d rows fit the KV budget",
                        cap, runner.context_length, slots)
            runner.context_length = cap
        fwd = DecodeForward(runner.model)
        runner.kv = StaticKV(runner.model.config.num_hidden_layers, fwd.kv_heads, fwd.head_dim, slots, cap,
                             next(runner.model.parameters()).dtype, runner.device)
        # Not captured: quantized linears (their served bytes change under them) and MoE blocks (their
        # expert dispatch reads the routing on the host).
        graphs = DecodeGraphs(fwd, runner.kv, use_graphs=on_cuda and cfg.cuda_graphs and cfg.quantization == "none"
                              and runner.moe_shape is None)
        return cls(runner, graphs)

    def step(self) -> None:
        """One token for every row of the runner's batch (see the module docstring)."""
        runner = self.runner
        rows, kv = runner.rows, runner.kv
        if self.pending is not None:
            ran = self.pending[0]
            ids = None if ran is rows else {id(r) for r in ran}  # the batch is usually the same list
            if all(self._finishes(r, ids is None or id(r) in ids) for r in rows):
                self.flush()
                return
        t0 = time.perf_counter()
        with runner.model_lock, torch.inference_mode():
            epoch, version = runner.weights_epoch, runner.weight_version
            capture = any(r.req.return_routed_experts and r.finish is None for r in rows)
            adapters = [runner.adapter_of(r) for r in rows]
            if self.sampling is None or self.sampling[0] is not rows:
                self.sampling = (rows, SamplingBatch([r.req.params for r in rows], runner.device))
            sampling = self.sampling[1]
            u = sampling.uniforms([r.draws for r in rows], runner._generator)
            routed = None
            if capture or any(a is not None for a in adapters) or not self.graphs.use_graphs:
                ids: list[torch.Tensor] = []
                with hook_routers(runner.routers if capture else [], lambda _layer, out: ids.append(out[2])), \
                        runner.adapters.applied(adapters):
                    logits = self.graphs.forward(kv, *kv.inputs(len(rows)), length_bucket(max(kv.lens) + 1, kv.cap))
                if capture:  # each (B, top_k): the routing of the token just fed
                    routed = torch.stack(ids, dim=1).to(torch.int32)[:, None]  # (B, 1, MoE layers, top_k)
            else:
                logits = self.graphs.run(len(rows))
            tokens, logprobs = sampling.sample(logits, u)
            kv.advance(tokens)
            # One copy to the host (exact: token ids and float32 logprobs both fit a float64), not waited for.
            out = torch.stack([tokens.double(), logprobs.double()])  # (2, B)
            host, done = out, None
            if out.is_cuda:
                host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
                host.copy_(out, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
        previous, self.pending = self.pending, (rows, host, done, routed, epoch, version)
        runner.stats["decode_device_s"] += time.perf_counter() - t0
        if previous is not None:
            self._record(*previous)

    def flush(self) -> None:
        """Record the step still pending on the host, if any."""
        previous, self.pending = self.pending, None
        if previous is not None:
            self._record(*previous)

    def _finishes(self, row: Row, in_pending: bool) -> bool:
        """Whether `row` is finished once the pending step (which it ran in, or not) is recorded, by what
        the host knows: its length (an EOS is seen only when recorded)."""
        if row.finish is not None:
            return True
        n = len(row.output_ids) + in_pending
        return n >= row.req.params.max_new_tokens or len(row.req.input_ids) + n >= self.runner.context_length

    def _record(self, rows: list[Row], host, done, routed, epoch: int, version: str) -> None:
        """Wait for a step's copy, then record it for `rows`, the batch it ran for. Launching and this wait
        count as decode_device_s, the recording as decode_host_s."""
        t0 = time.perf_counter()
        if done is not None:
            done.synchronize()
        t1 = time.perf_counter()
        self.runner.stats["decode_device_s"] += t1 - t0
        tokens, logprobs = host.tolist()
        self.runner._recorded(t1, rows, routed, epoch, version, [int(t) for t in tokens], logprobs)
