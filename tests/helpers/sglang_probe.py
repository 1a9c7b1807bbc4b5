"""A run schedule for the live-SGLang tests: the synchronous schedule, then, with the run's engines
still serving the last pushed version, each engine's greedy ids for a few prompts and the trainer's
weights exported as a checkpoint, both written to the run directory (probe.json, final_hf/)."""

from __future__ import annotations

import json

import httpx

from miles.orchestration.sync_loop import run_sync_loop

PROMPTS = [[19, 20, 15, 21, 31, 27], [5, 6, 7, 8], [1, 2, 3]]
NEW_TOKENS = 8


def sync_then_probe(ctx) -> None:
    run_sync_loop(ctx)
    answers = {}
    for url in ctx.fleet.serving_urls():
        answers[url] = [httpx.post(url + "/generate", timeout=120, json={
            "input_ids": p, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS}}).json()
            for p in PROMPTS]
    export = ctx.trainer.save_hf(str(ctx.run_dir / "final_hf"))
    (ctx.run_dir / "probe.json").write_text(json.dumps({"export": export, "answers": answers}))
