"""miles bench sync: weight-sync transports against bare torch.distributed, on one host.

A Qwen3-architecture model of ~270 MiB of bf16 weights is built in memory (fp32 master weights, as a
trainer holds them), saved once as the run's starting checkpoint, and served by two built-in engines
in their own processes (bf16). Then, in one run:
  * broadcast_s       miles' broadcast transport: buckets, HTTP metadata, one gloo broadcast per bucket,
                      engine staging and the atomic commit on both engines
  * raw_gloo_broadcast_s  the same bucket bytes broadcast with bare torch.distributed (gloo) to two
                      receiver processes that do nothing else (the baseline): long-lived, their process
                      group formed once, buffers pre-faulted, warmed like the transports
  * p2p_vs_copy_limit p2p_s / (engines x memcpy_s): the shared-memory transport against copying each
                      engine's bytes once (the trainer writes every engine's copy)
  * memcpy_s          one in-memory copy of the same bytes (what any transfer costs at least), in the
                      copying thread's CPU time, which a busy neighbour does not inflate
  * p2p_s / colocated_s   the shared-memory transports to the same two engines
  * after real AdamW steps at lr 1e-6 on the fp32 master weights: the disk-delta update of the bf16
    engine weights, its density (fraction of bytes changed), wire bytes and full bytes
The last line is one JSON object with the raw figures and the ratios. With --second-layers N a model
of N layers, served by two engines of its own, is timed in the same rounds (every round pushes both)
and its figures are the line's "second": the capacity model's projection of it from the first model's
constants is checked against a measurement taken under the same load (miles/capacity/calibration.py).

    miles bench sync [--layers 8] [--second-layers 4] [--bucket-mb 512] [--repeats 3] [--steps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_RECEIVER = r"""
import sys, datetime, torch, torch.distributed as dist
torch.set_num_threads(1)
host, port, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
sizes = [int(s) for s in sys.argv[5].split(",")]
rounds = int(sys.argv[6])
t = datetime.timedelta(seconds=600)
store = dist.TCPStore(host, port, world, is_master=False, timeout=t)
pg = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), rank, world, t)
# Receive buffers allocated once and written once, so no round pays first-touch page faults.
bufs = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
pg.allreduce([torch.zeros(1)]).wait()  # ready
for _ in range(rounds):
    for b in bufs:
        pg.broadcast([b]).wait()
    pg.allreduce([torch.zeros(1)]).wait()
"""


def build_model(layers: int, out_dir: str):
    """fp32 master weights rounded to bf16-representable values, saved as the bf16 base checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from miles.models.presets import train_tokenizer

    tokenizer = train_tokenizer(512, seed=0)
    config = Qwen3Config(vocab_size=32768, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id, dtype="float32")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    model.float()
    tokenizer.save_pretrained(out_dir)
    return model


def named_bf16(model):
    import torch

    seen, out = set(), []
    for n, t in model.state_dict().items():
        if t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        out.append((n, t.detach().to(torch.bfloat16).contiguous()))
    return out


# Untimed pushes of a transport before each timed one (see Fleet.measure).
SETTLE_PUSHES = 2


def time_push(transport, named, version: int, bucket_bytes: int, parts: list | None = None) -> float:
    """Seconds for one whole push; `parts` gets its split (bucket sends, then the commit)."""
    from miles.sync.prepare import push_weights

    t0 = time.perf_counter()
    m = push_weights(iter(named), transport, version, bucket_bytes)
    if parts is not None:
        parts.append((m["sync/transport_s"], m["sync/commit_s"]))
    return time.perf_counter() - t0


class RawGloo:
    """The baseline: the same bucket bytes (pre-flattened) broadcast with bare torch.distributed gloo
    to receiver processes that do nothing else. The receivers live for the whole benchmark, their
    process group is formed once and their buffers are pre-faulted, so a round costs the broadcast
    alone: the tightest bar a broadcast transport can be held to on this host."""

    def __init__(self, named, bucket_bytes: int, receivers: int, rounds: int):
        import datetime

        import torch
        import torch.distributed as dist

        from miles.sync.prepare import buckets

        self.flats = [torch.cat([t.reshape(-1).view(torch.uint8) for _, t in b])
                      for b in buckets(iter(named), bucket_bytes)]
        sizes = ",".join(str(f.numel()) for f in self.flats)
        world = receivers + 1
        timeout = datetime.timedelta(seconds=600)
        self.store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timeout)
        self.procs = [subprocess.Popen([sys.executable, "-c", _RECEIVER, "127.0.0.1", str(self.store.port), str(r),
                                        str(world), sizes, str(rounds)]) for r in range(1, world)]
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("raw", self.store), 0, world, timeout)
        self.pg.allreduce([torch.zeros(1)]).wait()  # every receiver is up with its buffers touched

    def round(self) -> float:
        import torch

        t0 = time.perf_counter()
        for f in self.flats:
            self.pg.broadcast([f]).wait()
        self.pg.allreduce([torch.zeros(1)]).wait()  # every receiver has every byte
        return time.perf_counter() - t0

    def close(self) -> None:
        for p in self.procs:
            p.wait(60)

    def stop(self) -> None:
        """Receivers left waiting by a failed run are ended, not left blocked for the gloo timeout."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()


def memcpy(named, clock=time.perf_counter) -> float:
    """Seconds of one copy of every tensor into touched buffers. `clock=time.thread_time` counts only
    the copying thread's CPU time, which a busy neighbour's preemption does not inflate."""
    import torch

    src = [t for _, t in named]
    dst = [torch.empty_like(t) for t in src]
    for d, s in zip(dst, src):  # touch the pages first, as a transfer's receive buffers would be
        d.copy_(s)
    t0 = clock()
    for d, s in zip(dst, src):
        d.copy_(s)
    return clock() - t0


def optimizer_steps(model, steps: int, lr: float) -> None:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 512, (2, 64), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


class Fleet:
    """One model served by two engines, with the transports, the raw gloo baseline, and every timing."""

    def __init__(self, layers: int, root: str, token: str, bucket_bytes: int, load_format: str):
        from miles.engine.process import EngineProcess
        from miles.sync.transports import get_transport

        self.base = os.path.join(root, f"base-{layers}")
        self.model = build_model(layers, self.base)
        self.named = named_bf16(self.model)
        self.nbytes = sum(t.numel() * t.element_size() for _, t in self.named)
        print(f"model: {self.nbytes / 2**20:.0f} MiB of bf16 weights in {len(self.named)} tensors", file=sys.stderr)
        self.bucket_bytes, self.raw, self.engines = bucket_bytes, None, []
        try:
            for _ in range(2):
                self.engines.append(EngineProcess(self.base, admin_token=token, startup_timeout_s=300,
                                                  extra_args=["--dtype", "bfloat16", "--num-threads", "1"]))
        except BaseException:
            self.stop()
            raise
        self.urls = [e.url for e in self.engines]
        self.results: dict[str, list[float]] = {"broadcast": [], "raw": [], "p2p": [], "colocated": [], "memcpy": []}
        self.parts: dict[str, list[tuple[float, float]]] = {"broadcast": [], "p2p": [], "colocated": []}
        self.transports = {"broadcast": get_transport("broadcast", admin_token=token, timeout_s=300,
                                                      load_format=load_format),
                           "p2p": get_transport("p2p", admin_token=token, timeout_s=300, buffer_bytes=bucket_bytes),
                           "colocated": get_transport("colocated", admin_token=token, timeout_s=300,
                                                      buffer_bytes=bucket_bytes)}
        for t in self.transports.values():
            t.connect(self.urls)

    def start_raw(self, rounds: int) -> None:
        """The raw broadcast's receivers, started once every model's engines are up: they wait for each
        round under gloo's timeout, which a slow engine start on a busy host would otherwise eat."""
        self.raw = RawGloo(self.named, self.bucket_bytes, len(self.engines), rounds=rounds)

    METHODS = ("broadcast", "p2p", "colocated", "raw", "memcpy")

    def measure(self, method: str, version: int, timed: bool) -> int:
        """One push of `method` (a transport, the raw broadcast or the copy); returns the last version used."""
        if method in self.transports:
            # Two untimed pushes first: a run pushes every version with one transport, so its engines
            # receive into what that transport's earlier versions left them (a broadcast's two receive
            # buffers alternate, p2p's lent buffers swap), not into what another transport left.
            for _ in range(SETTLE_PUSHES):
                version += 1
                time_push(self.transports[method], self.named, version, self.bucket_bytes)
            version += 1
            s = time_push(self.transports[method], self.named, version, self.bucket_bytes,
                          self.parts[method] if timed else None)
        elif method == "raw":
            s = self.raw.round()
        else:
            # The copy in the copying thread's CPU time: a copy is short, and on a busy host the wall
            # clock mostly measures who else got the core (on an idle one the two agree).
            s = memcpy(self.named, clock=time.thread_time)
        if timed:
            self.results[method].append(s)
        return version

    def close(self) -> None:
        for t in self.transports.values():
            t.close()
        self.raw.close()

    def stop(self) -> None:
        if self.raw is not None:
            self.raw.stop()
        for e in self.engines:
            e.stop()

    def figures(self, repeats: int, bucket_mb: int) -> dict:
        """The medians of the timed rounds and their ratios: the benchmark's line for this model."""
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        r = self.results
        bc, raw_s, p2p, memcpy_s = med(r["broadcast"]), med(r["raw"]), med(r["p2p"]), med(r["memcpy"])
        n_engines = len(self.urls)
        return {
            "bytes": self.nbytes, "bucket_mb": bucket_mb, "engines": n_engines, "repeats": repeats,
            "broadcast_s": round(bc, 4), "raw_gloo_broadcast_s": round(raw_s, 4),
            "memcpy_s": round(memcpy_s, 4),
            "broadcast_efficiency": round(raw_s / bc, 3),
            "p2p_s": round(p2p, 4), "p2p_speedup_vs_broadcast": round(bc / p2p, 3),
            # The copy limit: each engine's bytes copied once, one engine after another.
            "p2p_vs_copy_limit": round(p2p / (n_engines * memcpy_s), 3),
            "colocated_s": round(med(r["colocated"]), 4),
            # Where each push's time goes (medians): sending the buckets, and the commit on every engine.
            "breakdown": {k: {"send_s": round(med([x[0] for x in v]), 4),
                              "commit_s": round(med([x[1] for x in v]), 4)} for k, v in self.parts.items()},
            "raw_runs": {k: [round(x, 4) for x in v] for k, v in r.items()},
        }


def main(argv=None) -> int:
    import torch

    from miles.sync.prepare import push_weights
    from miles.sync.transports import get_transport

    ap = argparse.ArgumentParser(prog="miles bench sync")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (8 → ~270 MiB of bf16 weights)")
    ap.add_argument("--second-layers", type=int,
                    help="also time a model of this many layers (its own two engines) in the same rounds, reported "
                         "under 'second': `miles simulate --calibrate-from` projects it from the first and compares")
    ap.add_argument("--bucket-mb", type=int, default=512, help="bucket size (default: sync.bucket_size_mb's)")
    ap.add_argument("--repeats", type=int, default=3, help="timed pushes per transport (the median is reported)")
    ap.add_argument("--steps", type=int, default=2, help="AdamW steps before the disk-delta update")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--load-format", default="flattened_small", choices=["flattened_small", "flattened_bucket"],
                    help="broadcast wire format (see miles/sync/transports/broadcast.py)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    bucket_bytes = a.bucket_mb << 20
    token = "bench-sync"
    warmups = 2

    with tempfile.TemporaryDirectory(prefix="miles-bench-sync-") as tmp:
        fleets: list[Fleet] = []
        try:
            for layers in [a.layers] + ([a.second_layers] if a.second_layers else []):
                fleets.append(Fleet(layers, tmp, token, bucket_bytes, a.load_format))
            for fleet in fleets:
                fleet.start_raw(rounds=warmups + a.repeats)
            main_fleet = fleets[0]
            version = 0
            # Warm-up (two rounds): receive buffers grow to a whole version and their pages get mapped;
            # first-touch page faults are set-up, not the steady-state cost of a transfer.
            # Then interleaved rounds, so a neighbour's load spreads over every method alike; each method
            # runs on both models back to back, in alternating order, so the pair shares its moment's load.
            for r in range(warmups + a.repeats):
                for method in Fleet.METHODS:
                    for fleet in (fleets if r % 2 == 0 else fleets[::-1]):
                        version = fleet.measure(method, version, timed=r >= warmups)
            for fleet in fleets:
                fleet.close()

            model, base, urls = main_fleet.model, main_fleet.base, main_fleet.urls
            optimizer_steps(model, a.steps, a.lr)
            updated = named_bf16(model)
            delta = get_transport("disk_delta", admin_token=token, timeout_s=300, delta_dir=os.path.join(tmp, "deltas"),
                                  base_path=base, local_dir=os.path.join(tmp, "local"))
            delta.connect(urls)
            t0 = time.perf_counter()
            push_weights(iter(updated), delta, version + 1, bucket_bytes)
            delta_s = time.perf_counter() - t0
            stats = delta.last_stats
            delta.close()
            # The engines really hold the updated weights.
            ok = all(r["success"] for r in _compare(urls, token, updated))
        finally:
            for fleet in fleets:
                fleet.stop()

    out = main_fleet.figures(a.repeats, a.bucket_mb)
    out.update({
        "delta_steps": a.steps, "delta_lr": a.lr,
        "delta_density": round(stats["delta/changed_bytes"] / stats["delta/full_bytes"], 6),
        "delta_wire_bytes": stats["delta/wire_bytes"], "full_bytes": stats["delta/full_bytes"],
        "delta_s": round(delta_s, 4), "delta_engines_verified": ok})
    if len(fleets) > 1:
        out["second"] = fleets[1].figures(a.repeats, a.bucket_mb)
    print(json.dumps(out))
    return 0


def _compare(urls, token, named):
    import httpx

    from miles.sync.verify import tensor_checksum

    expected = {n: ["bfloat16", tensor_checksum(t)] for n, t in named}
    return [httpx.post(f"{u}/weights_checker", json={"action": "compare", "expected": expected}, timeout=300,
                       headers={"Authorization": f"Bearer {token}"}).json() for u in urls]


if __name__ == "__main__":
    sys.exit(main())
