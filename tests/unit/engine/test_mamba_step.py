"""The engine's Mamba-2 decode step (engine/mamba_step.py) computes what Nemotron-H's full forward, the
trainer's form, computes: transformers' own single-token step leaves the time step unclamped where its
chunked form clamps it at `time_step_min`, so on tokens under that floor transformers' cached decode
drifts from its full forward by more than 1e-5; decoding with the engine's step stays within 1e-5 of the
full forward. For a token above the floor the engine's step is transformers' step, bit for bit."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.unit.engine.test_engine_families import full_forward_greedy
from tests.unit.engine.test_engine_recurrent import PROMPTS, cached_logprobs


def _time_steps(model, seq: list[int]) -> torch.Tensor:
    """softplus(dt + dt_bias) of every Mamba-2 mixer at every position of `seq`, before any clamp. (mixers, T, H)"""
    mixers = [m for m in model.modules() if type(m).__name__ == "NemotronHMamba2Mixer"]
    steps = []
    hooks = [m.in_proj.register_forward_hook(
        lambda _mod, _args, out, m=m: steps.append(F.softplus(out[0, :, -m.num_heads:] + m.dt_bias))) for m in mixers]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([seq]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(steps)


def test_decode_steps_agree_with_the_full_forward_where_transformers_own_step_does_not(preset_dir):
    from miles.engine import mamba_step
    from miles.models.loading import load_model

    path = preset_dir("tiny-nemotron-h")
    hf = load_model(path).eval()
    engine_model = load_model(path).eval()
    assert mamba_step.install(engine_model) == 2  # the preset's two Mamba-2 blocks
    prompt = PROMPTS[1]
    ids, full = full_forward_greedy(hf, prompt, 12)
    # A token fed to a decode step before the last logprob has its time step under the floor: the case
    # the step exists for.
    floor = next(m for m in hf.modules() if type(m).__name__ == "NemotronHMamba2Mixer").time_step_limit[0]
    assert (_time_steps(hf, prompt + ids)[:, len(prompt):-1] < floor).any()
    ours = cached_logprobs(engine_model, prompt, ids)
    theirs = cached_logprobs(hf, prompt, ids)
    assert max(abs(x - y) for x, y in zip(ours, full)) <= 1e-5
    assert max(abs(x - y) for x, y in zip(theirs, full)) > 1e-5


def test_without_a_floor_the_step_is_transformers_step(preset_dir):
    from miles.engine import mamba_step
    from miles.models.loading import load_model

    path = preset_dir("tiny-nemotron-h")
    hf, engine_model = load_model(path).eval(), load_model(path).eval()
    mamba_step.install(engine_model)
    for model in (hf, engine_model):
        for m in model.modules():
            if type(m).__name__ == "NemotronHMamba2Mixer":
                m.time_step_limit = (0.0, float("inf"))  # softplus is positive: no clamp moves any step
    ids, _ = full_forward_greedy(hf, PROMPTS[0], 6)
    assert cached_logprobs(engine_model, PROMPTS[0], ids) == cached_logprobs(hf, PROMPTS[0], ids)


def test_models_without_mamba_mixers_are_left_as_they_are(preset_dir):
    from miles.engine import mamba_step
    from miles.models.loading import load_model

    model = load_model(preset_dir("tiny-qwen3-next")).eval()
    assert mamba_step.install(model) == 0
    assert all("forward" not in vars(m) for m in model.modules())
