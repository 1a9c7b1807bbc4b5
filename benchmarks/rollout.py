"""`miles bench rollout`: GRPO-shaped and multi-turn generation, miles engine vs transformers generate().

GRPO workload: P prompts x n samples, sampled at temperature 1 with per-sample completion limits drawn
from a long-tailed distribution (most short, a few reaching max_new_tokens; EOS is ignored so both
sides produce exactly those lengths). The same prompts and limits go
  * to miles: one built-in engine process behind the built-in router, every group sent at once as one
    batched /generate of its samples, as `miles train` sends them (miles.rollout.generate.generate_many);
  * to transformers: model.generate() in this process on static batches of `--hf-batch-size`
    samples, each batch running to its longest limit (the static-batching cost), outputs cut to each
    sample's own limit.
Throughput counts only the tokens each sample asked for. Both sides use one torch thread.
Raw decode (the ceiling for a batch on this CPU): the same model in a hand-written static-batch KV
decode loop (each distinct prompt prefilled once, then one forward per token for the whole batch
into a preallocated KV cache, multinomial sampling, no scheduler, no HTTP), against the engine on
the same prompts with uniform lengths (every sample `--uniform-tokens`, EOS ignored):
`raw_decode_fraction` = engine tokens/s / raw loop tokens/s.
With `--sglang`, a live SGLang server (launched as miles launches a run's engines, from SGLang's own
venv; on the CPU with its kernel stand-in) behind a router of its own gets the same GRPO prompts and
limits as the built-in engine each round, through the same client (`sglang_*` figures).
Multi-turn workload: episodes share a system prompt and grow their history turn by turn (TITO: the
next prompt is the previous prompt + its output ids + the new user turn), routed by episode key.
Prefix-cache hit rates are read from the engine's counters around each workload.

    miles bench rollout [--prompts 16 --samples 8 --max-new-tokens 128 --hf-batch-size 32] [--sglang]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import random
import tempfile
import time


def _lengths(rng: random.Random, count: int, max_new: int) -> list[int]:
    out = []
    for _ in range(count):
        u = rng.random()
        if u < 0.08:
            out.append(max_new)  # the tail that holds a static batch hostage
        elif u < 0.25:
            out.append(rng.randint(max_new // 4, max_new // 2))
        else:
            out.append(rng.randint(4, max(5, max_new // 8)))
    return out


def _prompts(tok, rng: random.Random, count: int) -> list[list[int]]:
    system = "You are a careful assistant. Solve the arithmetic problem and give the answer. "
    return [tok.encode(f"{system}Question {i}: {rng.randint(10, 999)}+{rng.randint(10, 999)}=") for i in range(count)]


def run_hf(model, prompts, n, limits, batch_size: int, pad_id: int) -> tuple[float, int]:
    import torch

    items = [(p, limits[i * n + j]) for i, p in enumerate(prompts) for j in range(n)]
    t0 = time.perf_counter()
    tokens = 0
    for s in range(0, len(items), batch_size):
        batch = items[s:s + batch_size]
        L = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), L), dtype=torch.long)
        for i, (p, _) in enumerate(batch):
            ids[i, L - len(p):] = torch.tensor(p)
            mask[i, L - len(p):] = 1
        longest = max(m for _, m in batch)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=longest, min_new_tokens=longest, pad_token_id=pad_id)
        tokens += sum(min(m, out.shape[1] - L) for _, m in batch)
    return time.perf_counter() - t0, tokens


def run_raw_decode(model, prompts, n, new_tokens: int, pad_id: int) -> tuple[float, int]:
    """Every sample in one static batch: each distinct prompt prefilled once and its KV copied to its n
    samples, then `new_tokens - 1` single-token forwards whose keys and values are written in place
    into preallocated room (no per-step copy of the cache), each handed its mask ready-made. Nothing
    is spent on anything but the model and the sampling."""
    import torch

    from miles.engine.kv_cache import new_cache

    # The cache's keyword in this transformers release, as the engine picks it.
    kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():  # as the engine's forwards run
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: real tokens count from 0
        cache = new_cache(model.config)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                    **{kwarg: cache})
        rows = torch.arange(len(prompts)).repeat_interleave(n)  # each prompt's KV, once per sample
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]
            layer.reserve(L + new_tokens)
        mask, last = mask[rows], pos[rows, -1:]
        nxt = torch.multinomial(torch.softmax(out.logits[rows, -1].float(), -1), 1)
        for _ in range(new_tokens - 1):
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            last = last + 1
            # The padding mask in the 4-D boolean form transformers would build from it each step, or
            # the 2-D one it skips when nothing is padded (the engine does the same: model_runner._decode_mask).
            ready = mask if bool(mask.all()) else mask.bool()[:, None, None, :]
            out = model(input_ids=nxt, attention_mask=ready, position_ids=last, use_cache=True, **{kwarg: cache})
            nxt = torch.multinomial(torch.softmax(out.logits[:, -1].float(), -1), 1)
    return time.perf_counter() - t0, len(rows) * new_tokens


async def run_miles_grpo(url: str, prompts, n, limits, seed: int) -> tuple[float, int]:
    """Every group at once, each as one batched /generate of its n samples: what `miles train`'s rollout
    sends (rollout.batch_requests, on by default)."""
    from miles.rollout.generate import SamplingParams, generate_many
    from miles.engine_api.aio import async_client

    async with async_client(600) as client:  # the client `miles train`'s rollout uses
        t0 = time.perf_counter()
        tasks = [generate_many(client, url, [p] * n,
                               [SamplingParams(temperature=1.0, max_new_tokens=limits[i * n + j], seed=seed + i * n + j,
                                               ignore_eos=True) for j in range(n)])
                 for i, p in enumerate(prompts)]
        groups = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    tokens = sum(len(s.response_ids) for g in groups for s in g)
    return wall, tokens


async def run_multi_turn(url: str, tok, episodes: int, turns: int, max_new: int, seed: int) -> float:
    import httpx

    from miles.rollout.generate import SamplingParams, generate

    # Agent-shaped: a system prompt with tool descriptions, then short observations and replies.
    system = tok.encode(
        "System: you are a terminal agent. Run the command, read the output, and answer with the result. "
        "Keep answers short. Tools: ls lists a directory; cat prints a file; echo prints its arguments; "
        "grep finds lines matching a pattern in a file; python runs a script and prints its output. "
        "Call one tool per turn, read the observation, then decide the next step or give the answer. ")

    async def episode(e: int) -> None:
        async with httpx.AsyncClient(timeout=600, headers={"X-Routing-Key": f"episode-{e}"}) as client:
            await turns_of(e, client)

    async def turns_of(e: int, client) -> None:
        history = list(system)
        for t in range(turns):
            history += tok.encode(f"\nobservation {e}.{t}: file {t * 7 + e}\nassistant:")
            s = await generate(client, url, history, SamplingParams(temperature=1.0, max_new_tokens=max_new,
                                                                   seed=seed + 100 * e + t, ignore_eos=True))
            history += s.response_ids

    t0 = time.perf_counter()
    await asyncio.gather(*(episode(e) for e in range(episodes)))
    return time.perf_counter() - t0


def _counters(url: str) -> dict:
    import httpx

    st = httpx.get(url + "/get_server_info", timeout=30).json()["engine_stats"]
    return {"prompt": st["prompt_tokens"], "cached": st["cached_tokens"], "busy_s": st["busy_s"],
            "decode_forwards": st["decode_forwards"], "prefill_forwards": st["prefill_forwards"]}


def _flush(url: str) -> None:
    import httpx

    httpx.post(url + "/flush_cache", timeout=30).raise_for_status()


def _hit_rate(before: dict, after: dict) -> float:
    prompt = after["prompt"] - before["prompt"]
    return (after["cached"] - before["cached"]) / prompt if prompt else 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="miles bench rollout")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--turn-max-new-tokens", type=int, default=16)
    p.add_argument("--uniform-tokens", type=int, default=0,
                   help="tokens per sample of the raw-decode comparison (default: --max-new-tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2,
                   help="alternate the two sides this many times, so a load change on a shared machine "
                        "hits both sides alike")
    p.add_argument("--model", default=None, help="checkpoint directory; default builds tiny-qwen3")
    p.add_argument("--sglang", action="store_true",
                   help="also run the GRPO rounds on a live SGLang server (scripts/install-sglang.sh makes its venv)")
    a = p.parse_args(argv)

    import torch

    from miles.models.loading import load_model, load_tokenizer
    from miles.models.presets import build_tiny_model
    from miles.engine.config import EngineConfig
    from miles.engine.process import EngineProcess
    from miles.rollout.router import RouterProcess
    from miles.sglang.config import SGLangConfig
    from miles.sglang.server import SGLangServer

    torch.set_num_threads(1)
    model_dir = a.model or str(build_tiny_model("tiny-qwen3", tempfile.mkdtemp(prefix="miles-bench-rollout-")))
    tok = load_tokenizer(model_dir)
    rng = random.Random(a.seed)
    prompts = _prompts(tok, rng, a.prompts)
    limits = _lengths(rng, a.prompts * a.samples, a.max_new_tokens)

    uniform = a.uniform_tokens or a.max_new_tokens
    model = load_model(model_dir).eval()
    hf_wall = miles_wall = raw_wall = uni_wall = 0.0
    hf_tokens = miles_tokens = raw_tokens = uni_tokens = 0
    # Room for every sample of a round at once, as the raw loop's one batch holds them.
    max_batch = str(max(256, a.prompts * a.samples))
    sglang_wall, sglang_tokens, sglang_start_s = 0.0, 0, 0.0
    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(EngineProcess(model_dir, extra_args=["--num-threads", "1",
                                                                          "--max-batch-size", max_batch]))
        # Its own process, as `miles router` runs: sharing the client's interpreter would make the two
        # take turns on one GIL.
        router = stack.enter_context(RouterProcess([engine.url]))
        sglang = sglang_router = None
        if a.sglang:
            # As a run launches it on the CPU (one thread, KV pool at 5% of memory), behind a router as well.
            t0 = time.perf_counter()
            sglang = SGLangServer(EngineConfig(model_path=model_dir, device="cpu", num_threads=1,
                                               memory_fraction=0.05, max_batch_size=int(max_batch)), SGLangConfig())
            stack.callback(sglang.stop)
            sglang_start_s = time.perf_counter() - t0
            sglang_router = stack.enter_context(RouterProcess([sglang.url]))
            asyncio.run(run_miles_grpo(sglang_router.url, prompts[:2], 2, [4] * 4, a.seed))  # warm-up
        asyncio.run(run_miles_grpo(router.url, prompts[:2], 2, [4] * 4, a.seed))  # warm-up
        busy, grpo = 0.0, {"prompt": 0, "cached": 0}
        uni = {"busy_s": 0.0, "decode_forwards": 0, "prefill_forwards": 0}
        for r in range(a.rounds):
            torch.manual_seed(a.seed + r)
            w, t = run_hf(model, prompts, a.samples, limits, a.hf_batch_size, tok.pad_token_id)
            hf_wall, hf_tokens = hf_wall + w, hf_tokens + t
            print(f"round {r}: transformers generate() {t} tokens in {w:.2f}s", flush=True)
            _flush(engine.url)  # no round may find the warm-up's or an earlier round's prompts cached
            c0 = _counters(engine.url)
            w, t = asyncio.run(run_miles_grpo(router.url, prompts, a.samples, limits, a.seed + 1000 * r))
            c1 = _counters(engine.url)
            miles_wall, miles_tokens = miles_wall + w, miles_tokens + t
            busy += c1["busy_s"] - c0["busy_s"]
            for k in grpo:
                grpo[k] += c1[k] - c0[k]
            print(f"round {r}: miles engine via router {t} tokens in {w:.2f}s", flush=True)
            if sglang is not None:
                _flush(sglang.url)
                w, t = asyncio.run(run_miles_grpo(sglang_router.url, prompts, a.samples, limits,
                                                  a.seed + 1000 * r))
                sglang_wall, sglang_tokens = sglang_wall + w, sglang_tokens + t
                print(f"round {r}: live SGLang via router {t} tokens in {w:.2f}s", flush=True)
            w, t = run_raw_decode(model, prompts, a.samples, uniform, tok.pad_token_id)
            raw_wall, raw_tokens = raw_wall + w, raw_tokens + t
            print(f"round {r}: raw static-batch decode {t} tokens in {w:.2f}s", flush=True)
            _flush(engine.url)
            c0 = _counters(engine.url)
            w, t = asyncio.run(run_miles_grpo(router.url, prompts, a.samples, [uniform] * len(limits),
                                              a.seed + 1000 * r + 500))
            c1 = _counters(engine.url)
            uni_wall, uni_tokens = uni_wall + w, uni_tokens + t
            for k in ("busy_s", "decode_forwards", "prefill_forwards"):
                uni[k] += c1[k] - c0[k]
            print(f"round {r}: miles engine, uniform lengths, {t} tokens in {w:.2f}s", flush=True)
        _flush(engine.url)
        c_mt = _counters(engine.url)
        mt_wall = asyncio.run(run_multi_turn(router.url, tok, a.episodes, a.turns, a.turn_max_new_tokens, a.seed))
        c2 = _counters(engine.url)

    miles_tps, hf_tps = miles_tokens / miles_wall, hf_tokens / hf_wall
    result = {
        "miles_tokens_per_s": round(miles_tps, 1), "hf_generate_tokens_per_s": round(hf_tps, 1),
        "ratio": round(miles_tps / hf_tps, 2),
        "raw_decode_tokens_per_s": round(raw_tokens / raw_wall, 1),
        "miles_uniform_tokens_per_s": round(uni_tokens / uni_wall, 1),
        "raw_decode_fraction": round((uni_tokens / uni_wall) / (raw_tokens / raw_wall), 3),
        "uniform_tokens": uniform,
        # Where the engine's uniform rounds went: a batch admitted at once decodes uniform - 1 steps
        # after one prefill; requests that arrive while it runs add prefills (merges) and steps.
        "uniform_breakdown": {"wall_s": round(uni_wall, 2), "engine_busy_s": round(uni["busy_s"], 2),
                              "decode_forwards": uni["decode_forwards"],
                              "prefill_forwards": uni["prefill_forwards"],
                              "decode_forwards_if_admitted_at_once": (uniform - 1) * a.rounds,
                              "raw_decode_wall_s": round(raw_wall, 2)},
        "grpo_prefix_cache_hit_rate": round(grpo["cached"] / grpo["prompt"], 3),
        "multi_turn_prefix_cache_hit_rate": round(_hit_rate(c_mt, c2), 3),
        "miles_wall_s": round(miles_wall, 2),
        "engine_busy_s": round(busy, 2), "rounds": a.rounds, "hf_wall_s": round(hf_wall, 2),
        "miles_tokens": miles_tokens, "hf_tokens": hf_tokens, "multi_turn_wall_s": round(mt_wall, 2),
        "prompts": a.prompts, "samples": a.samples, "max_new_tokens": a.max_new_tokens,
        "hf_batch_size": a.hf_batch_size, "episodes": a.episodes, "turns": a.turns,
    }
    if a.sglang:
        result.update({"sglang_tokens_per_s": round(sglang_tokens / sglang_wall, 1),
                       "sglang_ratio": round(sglang_tokens / sglang_wall / hf_tps, 2),
                       "sglang_wall_s": round(sglang_wall, 2), "sglang_tokens": sglang_tokens,
                       "sglang_startup_s": round(sglang_start_s, 1)})
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
