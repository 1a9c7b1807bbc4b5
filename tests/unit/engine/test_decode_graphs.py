"""A decode step run at its buckets (the batch padded to a power of two of slots, attention over a
power-of-two number of columns) gives the logits of the same step run unpadded, for every batch and
length bucket; on cuda the replayed CUDA graphs do too, and a weight update or memory release makes
the graphs capture again rather than read stale memory."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from miles.engine_api.sampling import SamplingParams
from miles.engine_api.types import GenerateRequest
from miles.engine.config import EngineConfig
from miles.engine.graphs import batch_bucket, length_bucket
from miles.engine.model_runner import ModelRunner
from miles.engine.row import Row

SLOTS = 8


def test_buckets_are_powers_of_two_within_the_limits():
    assert [batch_bucket(n, 8) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert batch_bucket(6, 6) == 6  # the last bucket is the slot count itself
    assert [length_bucket(n, 300) for n in (1, 64, 65, 200, 299)] == [64, 64, 128, 256, 300]


def _runner(model_dir, device: str, **over) -> ModelRunner:
    return ModelRunner(EngineConfig(model_path=model_dir, device=device, fast_decode="on", max_batch_size=SLOTS,
                                    prefix_cache=False, **over))


def _admit(runner: ModelRunner, lengths: list[int]) -> None:
    rows = [Row.of(GenerateRequest(rid=str(i), input_ids=tuple(range(3, 3 + n)),
                                   params=SamplingParams(temperature=0, max_new_tokens=8)), Future())
            for i, n in enumerate(lengths)]
    runner.prefill(rows)


def _each_bucket(runner: ModelRunner, padded_step, atol: float = 2e-5):
    """For batches of 1..SLOTS rows, short (length bucket 64) and long (128): the step's logits at its
    buckets against the unpadded eager forward over exactly the columns in use."""
    seen = set()
    for lengths in ([5, 9, 3, 17, 30, 2, 11, 7], [70, 65, 90, 66, 100, 80, 75, 99]):
        runner.reset()
        _admit(runner, lengths)
        kv = runner.kv
        for n in range(1, SLOTS + 1):
            with torch.inference_mode():
                plain = runner.fast.forward(kv, *kv.inputs(n), max(kv.lens[:n]) + 1)
                at_buckets = padded_step(n)
            seen.add(runner.fast.buckets(n))
            torch.testing.assert_close(at_buckets, plain, atol=atol, rtol=1e-4)
            assert torch.equal(at_buckets.argmax(-1), plain.argmax(-1))
    assert seen == {(b, L) for b in (1, 2, 4, 8) for L in (64, 128)}


def test_padded_step_equals_unpadded_for_every_bucket(model_dir):
    runner = _runner(model_dir, "cpu")
    assert not runner.fast.use_graphs
    _each_bucket(runner, runner.fast.run)


@pytest.mark.cuda
def test_graph_replay_equals_eager_for_every_bucket(model_dir):
    runner = _runner(model_dir, "cuda")
    assert runner.fast.use_graphs
    # Other column counts may pick other SDPA kernels on the GPU: float32 rounding apart.
    _each_bucket(runner, lambda n: runner.fast.run(n).clone(), atol=1e-4)
    assert runner.fast.captures == 8  # one graph per bucket met


@pytest.mark.cuda
def test_graphs_capture_again_after_the_weights_move(model_dir):
    runner = _runner(model_dir, "cuda")
    _admit(runner, [5, 9])
    with torch.inference_mode():
        before = runner.fast.run(2).clone()
    # A weight update that adopts new storage: the graph must read the new weights.
    name, p = next((n, p) for n, p in runner.model.named_parameters() if n.endswith("norm.weight"))
    runner.load_weights({name: p.detach().clone() * 2}, "v2", adopt={name})
    with torch.inference_mode():
        after = runner.fast.run(2).clone()
        plain = runner.fast.forward(runner.kv, *runner.kv.inputs(2), 64)
    assert runner.fast.captures == 2
    torch.testing.assert_close(after, plain, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(before, after)


def test_a_step_that_cannot_be_captured_decodes_eagerly_from_then_on(model_dir, monkeypatch):
    runner = _runner(model_dir, "cpu")
    _admit(runner, [5, 9, 3])
    fast = runner.fast
    fast.use_graphs = True  # as on cuda; the capture then fails as a host-synchronising forward's would

    def fail(*_):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(fast, "_capture", fail)
    with torch.inference_mode():
        logits = fast.run(3)
        plain = fast.forward(runner.kv, *runner.kv.inputs(4), 64)[:3]
    assert not fast.use_graphs and not fast.graphs
    torch.testing.assert_close(logits, plain)
