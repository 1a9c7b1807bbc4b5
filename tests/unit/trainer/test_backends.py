"""`trainer.backend` picks the backend from BACKENDS: a second one is one file plus one registry line,
and it trains the same step as FSDP (the step is the trainer's, not the backend's)."""

from __future__ import annotations

import pytest
import torch

from miles.config.loader import ConfigError, build, load_config
from miles.run_config import RunConfig
from miles.net import free_port
from miles.trainer.backends.base import BACKENDS
from miles.trainer.backends.fsdp import FSDPBackend
from miles.trainer.config import TrainerConfig
from miles.trainer.trainer import Trainer
from miles.trainer.types import BatchTotals, TrainSequence
from tests.helpers.plain_backend import PlainBackend


@pytest.fixture
def gloo():
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def plain_registered(monkeypatch):
    """The one registry line that ships a backend, undone after the test (BACKENDS is process-wide)."""
    monkeypatch.setitem(BACKENDS._entries, "plain", "tests.helpers.plain_backend:PlainBackend")


def _seqs():
    return [TrainSequence(tokens=[5, 9, 14, 20, 31, 7], prompt_len=2, loss_mask=[1, 1, 0, 1], old_logprobs=[-3.0] * 4,
                          advantage=a) for a in (1.0, -0.5, 0.25)]


def test_an_unknown_backend_is_refused_naming_the_choices(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"trainer.backend = 'deepspeed' is unknown: choose one of "
                                          r"\['fsdp', 'megatron'\] or give module:Class"):
        load_config(RunConfig, None, {"model.path": tiny_model_dir, "trainer.backend": "deepspeed"})


def test_a_user_class_that_is_no_backend_is_refused_naming_what_it_lacks():
    with pytest.raises(ConfigError, match=r"trainer.backend: .*lacks \['build_critic', 'forward_backward', 'critic_values', .*Backend protocol"):
        build(TrainerConfig, {"backend": "miles.trainer.config:TrainerConfig"}).validate()


def test_the_default_backend_is_fsdp_and_a_user_backend_is_given_as_module_class():
    assert TrainerConfig().backend == "fsdp" and BACKENDS.get("fsdp") is FSDPBackend
    cfg = build(TrainerConfig, {"backend": "tests.helpers.plain_backend:PlainBackend"})
    cfg.validate()
    assert BACKENDS.get(cfg.backend) is PlainBackend


def test_a_registered_backend_is_selected_by_name_and_trains_the_same_step_as_fsdp(tiny_model_dir, gloo,
                                                                                  plain_registered):
    cfg = build(TrainerConfig, {"backend": "plain", "lr": 1e-2})
    cfg.validate()  # a registered name passes the config check
    plain = Trainer(cfg, tiny_model_dir, 0, 1, "127.0.0.1", free_port())
    # Whole rows on both (the plain backend shares no prompts), so the forwards are the same arithmetic.
    fsdp = Trainer(build(TrainerConfig, {"lr": 1e-2, "share_prompts": False}), tiny_model_dir, 0, 1, "127.0.0.1",
                   free_port())
    assert type(plain.backend) is PlainBackend and type(fsdp.backend) is FSDPBackend

    before = dict(plain.full_named_tensors())
    before = {n: t.clone() for n, t in before.items()}
    seqs = _seqs()
    got, want = plain.train_step(seqs, BatchTotals.of(seqs)), fsdp.train_step(seqs, BatchTotals.of(seqs))
    assert plain.backend.steps == 1  # the plain backend stepped its own optimizer
    # Same weights before the step, same step: the loss and its metrics are the trainer's, bit for bit.
    for key in ("train/loss", "train/loss_tokens", "train/nll", "train/clipfrac", "train/lr"):
        assert got[key] == want[key], key
    # Each backend clips with its own arithmetic (last bits only).
    assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-5)
    after_plain, after_fsdp = dict(plain.full_named_tensors()), dict(fsdp.full_named_tensors())
    assert after_plain.keys() == after_fsdp.keys() == before.keys()
    assert all(torch.allclose(after_plain[n], after_fsdp[n], atol=1e-6) for n in after_plain)
    assert any(not torch.equal(after_plain[n], before[n]) for n in before)  # the step moved the weights
