"""Decode steps at bucket sizes, replayed as CUDA graphs on cuda.

A decode step launches a few hundred small kernels; at the batch sizes RL decodes with, launching
them from Python takes longer than the GPU takes to run them. A CUDA graph records the step's
kernels once and replays them with one launch. A graph has fixed shapes and addresses, so steps are
run at buckets: the batch padded up to a power of two of slots (padding slots decode a dummy token
at position 0 and their outputs are dropped) and attention read over a power-of-two number of
columns (at least 64, at most the slot capacity). One graph per (batch bucket, length bucket) met,
captured the first time it is met; all graphs draw their memory from one pool, which is safe because
they never run concurrently and each graph's logits are consumed before the next replay.

A graph reads the KV buffers and the weights at the addresses it was captured with: any change of
those (the buffers reallocated after a memory release, a weight update that adopted new storage,
weights parked and resumed) drops every graph, and the next steps capture again.

Where graphs are off (cpu, `cuda_graphs = false`, quantized serving, MoE models whose expert dispatch
reads the routing on the host) the same padded forward runs eagerly, which is what the CPU tests check
bucket by bucket. A capture that fails turns graphs off for the engine's life (logged), never the step.
Non-goals: graphs for prefill, for LoRA or routed-expert batches (their hooks are Python; the
model runner decodes those eagerly), torch.compile.
"""

from __future__ import annotations

import itertools
import logging

import torch

from miles.engine.decode_forward import DecodeForward
from miles.engine.static_kv import StaticKV

log = logging.getLogger(__name__)

MIN_LENGTH_BUCKET = 64


def batch_bucket(n: int, slots: int) -> int:
    """Smallest power of two >= n, at most `slots`."""
    return min(1 << max(n - 1, 0).bit_length(), slots)


def length_bucket(length: int, cap: int) -> int:
    """Columns a step attends over: the smallest power of two >= length (at least 64), at most cap."""
    return min(max(1 << max(length - 1, 0).bit_length(), MIN_LENGTH_BUCKET), cap)


class DecodeGraphs:
    def __init__(self, forward: DecodeForward, kv: StaticKV, use_graphs: bool):
        if use_graphs and kv.device.type != "cuda":
            raise ValueError("CUDA graphs need a cuda device")
        self.forward, self.kv, self.use_graphs = forward, kv, use_graphs
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._captured_for = None  # (KV generation, weight addresses) the graphs read
        self.captures = 0  # graphs captured so far (a metric; also what the tests check)

    def buckets(self, n: int) -> tuple[int, int]:
        """(batch bucket, length bucket) of a step over the first n slots."""
        longest = max(self.kv.lens[:n]) + 1  # the column this step writes included
        return batch_bucket(n, self.kv.slots), length_bucket(longest, self.kv.cap)

    def run(self, n: int) -> torch.Tensor:
        """Logits (n, V) of one decode step over slots [0, n), computed at the step's buckets."""
        Bk, Lb = self.buckets(n)
        if not self.use_graphs:
            return self.forward(self.kv, *self.kv.inputs(Bk), Lb)[:n]
        key = (self.kv.generation, self._addresses())
        if key != self._captured_for:
            self.clear()
            self._captured_for = key
        entry = self.graphs.get((Bk, Lb))
        if entry is None:
            try:
                entry = self.graphs[(Bk, Lb)] = self._capture(Bk, Lb)
            except Exception:  # noqa: BLE001 - a forward that cannot be captured still decodes, eagerly
                log.warning("decode graphs off: capturing a (%d, %d) step failed; decoding eagerly", Bk, Lb,
                            exc_info=True)
                self.use_graphs = False
                self.clear()
                return self.forward(self.kv, *self.kv.inputs(Bk), Lb)[:n]
        graph, logits = entry
        graph.replay()
        return logits[:n]

    def clear(self) -> None:
        """Drop every graph and their memory pool (before the KV buffers or weights go away)."""
        self.graphs.clear()
        self._pool = None
        self._captured_for = None

    def _addresses(self) -> tuple[int, ...]:
        model = self.forward.model
        return tuple(t.data_ptr() for t in itertools.chain(model.parameters(), model.buffers()))

    def _capture(self, Bk: int, Lb: int):
        tokens, pos = self.kv.inputs(Bk)
        # Warm up on a side stream first: lazy initialisations (cuBLAS workspaces, kernel choices) must
        # not happen inside the capture. It writes this step's keys and values, which the replay
        # writes again, identically.
        side = torch.cuda.Stream(self.kv.device)
        side.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(side):
            self.forward(self.kv, tokens, pos, Lb)
        torch.cuda.current_stream(self.kv.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread of the engine (a weight receiver's copy) may use the device meanwhile.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self.forward(self.kv, tokens, pos, Lb)
        if self._pool is None:
            self._pool = graph.pool()
        self.captures += 1
        return graph, logits
