"""Trainer-state scenarios on one real gloo rank, in a process of its own (torch.distributed is
initialised once per process). Driven by test_state.py: python state_worker.py MODEL_DIR OUT_DIR"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def batch(seed: int):
    sys.path.insert(0, str(Path(__file__).parent))
    from dist_worker import make_batch

    return make_batch(seed, 6)


def step(trainer, seed: int):
    from miles.trainer.batching import prepare_global_batch

    seqs, totals = prepare_global_batch(batch(seed), trainer.algorithm)
    return trainer.train_step(seqs, totals)


def params(trainer):
    return {n: t.clone() for n, t in trainer.full_named_tensors(merged=True)}


def main() -> None:
    import torch

    torch.set_num_threads(1)
    from miles.config.loader import build
    from miles.net import free_port
    from miles.trainer.trainer import Trainer
    from miles.trainer.config import TrainerConfig

    model, out = sys.argv[1], Path(sys.argv[2])
    port = free_port()
    res: dict = {}

    def make(**kw):
        return Trainer(build(TrainerConfig, {"lr": 1e-3, **kw}), model, 0, 1, "127.0.0.1", port)

    # Offload: the same updates with state streamed through files; less state resident at the peak.
    plain, off = make(), make(offload_optimizer="disk", offload_bucket_mb=1, offload_dir=str(out / "offload"))
    for s in range(3):
        step(plain, s), step(off, s)
    a, b = params(plain), params(off)
    res["offload_max_abs_diff"] = max((a[n] - b[n]).abs().max().item() for n in a)
    res["offload_peak"] = off.backend.optim.peak_resident_bytes
    res["plain_peak"] = plain.backend.optim.peak_resident_bytes
    res["offload_buckets"] = len(off.backend.optim.optimizers)
    res["offload_files_between_steps"] = len(list((out / "offload").rglob("*.pt")))
    del plain, off

    # Checkpoint: 2 steps, save, 2 steps == load into a fresh trainer, 2 steps. KL with a refreshed
    # reference, a decaying LR and PPO's critic all have to come back.
    for name, kw in {"kl": {"lr_schedule": "linear", "lr_decay_steps": 4, "lr_warmup_steps": 1,
                            "ref_update_every": 2, "algorithm": {"kl_coef": 0.1, "entropy_coef": 0.01}},
                     "ppo": {"algorithm": {"name": "ppo"}},
                     "offload": {"offload_optimizer": "disk", "offload_bucket_mb": 1,
                                 "offload_dir": str(out / "offload2")}}.items():
        t = make(**kw)
        step(t, 0), step(t, 1)
        t.save_checkpoint(str(out / f"ckpt_{name}"))
        straight = [step(t, 2), step(t, 3)]
        del t
        t = make(**kw)
        t.load_checkpoint(str(out / f"ckpt_{name}"))
        res[f"resume_{name}"] = {"straight": straight, "resumed": [step(t, 2), step(t, 3)],
                                 "ref_version": t.reference.version if t.reference else None}
        del t

    # A checkpoint before the first step (fault.restart_trainer writes one): taking it changes
    # nothing, and a trainer loaded from it steps as a fresh one does.
    never_saved = make()
    fresh = [step(never_saved, 0), step(never_saved, 1)]
    del never_saved
    t = make()
    t.save_checkpoint(str(out / "ckpt_unstarted"))
    saved = [step(t, 0), step(t, 1)]
    del t
    t = make()
    t.load_checkpoint(str(out / "ckpt_unstarted"))
    res["resume_unstarted"] = {"straight": fresh, "saved": saved, "resumed": [step(t, 0), step(t, 1)],
                               "ref_version": None}
    del t

    # LoRA: only adapters train; merged and adapter-only sync; the HF export loads and matches.
    t = make(lora={"rank": 4, "alpha": 8.0, "target_modules": "q_proj,v_proj"})
    trainable = [n for n, p in t.backend.model.named_parameters() if p.requires_grad]
    base_before = {n: v.clone() for n, v in t.full_named_tensors(merged=False)}
    merged_before = params(t)
    for s in range(3):
        step(t, s)
    merged_after = params(t)
    adapters = dict(t.full_named_tensors(merged=False))
    res["lora"] = {
        "trainable": trainable,
        "adapter_names_before": sorted(base_before),
        "adapter_names": sorted(adapters),
        "adapters_changed": any(not torch.equal(base_before[n], adapters[n]) for n in adapters),
        "merged_names": sorted(merged_after),
        "merged_changed": [n for n in merged_after if not torch.equal(merged_before[n], merged_after[n])],
    }
    export = t.save_hf(str(out / "lora_export"))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(export).eval()
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        want = t.backend.model(input_ids=ids, use_cache=False).logits
        got = hf(input_ids=ids, use_cache=False).logits
    res["lora"]["export_max_abs_diff"] = (want - got).abs().max().item()
    (out / "result.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
