"""`miles bench hostile`: honest greedy requests under a flood of hostile input keep their output and
their latency.

One built-in engine process with an admin token, behind the router in its own process. Honest
clients send greedy requests (temperature 0, EOS ignored, fixed lengths) through the router, first
with nothing else running (idle), then while an attacker process floods the engine and the router
with the hostile-input classes of docs/security.md, several workers at once:
  * garbage: malformed JSON, 100k nested brackets, a lone surrogate, non-UTF-8 bytes, non-objects,
    unknown fields, to every POST route the attacker knows;
  * out of bounds: top_k past int64, 100k stop strings, a stop string past its length bound,
    max_new_tokens past the context, token ids outside the vocabulary;
  * oversized: a 10 MB text prompt, and a head declaring a body over max_request_mb;
  * admin without the token: abort every request, pause generation, flush the cache, fill the
    weights with noise, add a worker;
  * slowloris: connections that send their head, or their body, a byte at a time and never finish.
`--classes` picks some of them; `--classes benign` is the control: as many valid requests that cost
the engine nothing but their HTTP round trip, to tell what hostility costs from what traffic costs.
Idle and attack phases alternate `--rounds` times, so a load change on a shared machine hits both.
The attacker runs in its own process (it would otherwise share the honest client's interpreter).

Last line, one JSON object:
  honest_p50_s_idle, honest_p95_s_idle, honest_p50_s_attack, honest_p95_s_attack   latency of one
                         honest request, end to end through the router
  ratio_p50, ratio_p95   under attack / idle; the target (issue 22) is at most 2
  identical_outputs      every honest output under attack equals the idle one for its prompt
  honest_5xx, attack_5xx responses >= 500 (the target is 0 for both); attack_hangs: attack
                         requests that got no answer within their timeout
  attack_requests        hostile requests answered, by class; attack_statuses: their status codes
  attack_requests_per_s  hostile requests answered per second of the attack phases
  slow_connections       slowloris connections opened; load_avg_1m_start/_end: the machine's load

    miles bench hostile [--clients 2 --requests 24 --rounds 2 --attackers 4 --new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx

TOKEN = "bench-hostile-token"
PROMPTS = [[11, 12, 13, 14], [21, 22, 23, 24, 25, 26], [31, 32, 33], [41, 42, 43, 44, 45, 46, 47],
           [51, 52], [61, 62, 63, 64, 65], [71, 72, 73, 74, 75, 76, 77, 78], [81, 82, 83, 84, 85, 86]]
JSON = {"content-type": "application/json"}


# ---- the honest side --------------------------------------------------------------------------

def honest_phase(url: str, clients: int, requests: int, new_tokens: int) -> tuple[list[float], dict, Counter]:
    """`clients` clients send `requests` greedy requests in all, cycling through PROMPTS.
    Returns (latencies, {prompt index: outputs seen}, status counts)."""
    latencies: list[float] = []
    outputs: dict[int, list] = {}
    statuses: Counter = Counter()
    lock = threading.Lock()

    def one(i: int) -> None:
        k = i % len(PROMPTS)
        body = {"input_ids": PROMPTS[k], "sampling_params": {"temperature": 0.0, "max_new_tokens": new_tokens,
                                                             "ignore_eos": True}}
        t0 = time.perf_counter()
        r = client.post(f"{url}/generate", json=body)
        dt = time.perf_counter() - t0
        with lock:
            statuses[r.status_code] += 1
            latencies.append(dt)
            outputs.setdefault(k, []).append(r.json()["output_ids"] if r.status_code == 200 else r.status_code)

    with httpx.Client(timeout=120) as client, ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(requests)))
    return latencies, outputs, statuses


def _quantile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q * 100) - 1] if len(xs) > 1 else xs[0]


# ---- the attacker (its own process) -----------------------------------------------------------

def _attacks(engine: str, router: str) -> list[tuple[str, str, str, bytes]]:
    """(class, server, path, body) of every hostile HTTP request the attacker cycles through."""
    deep, surrogate = b"[" * 100_000, b'{"text": "\\ud800 hi"}'
    garbage = [b"{not json", deep, surrogate, b"\xff\xfe", b"[1, 2]", b'{"zzz": 1}']

    def gen(**params) -> bytes:
        return json.dumps({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4, **params}}).encode()

    out = []
    for base in (engine, router):
        for path in ("/generate", "/abort_request", "/pause_generation", "/update_weights_from_disk",
                     "/weights_checker", "/flush_cache"):
            out += [("garbage", base, path, raw) for raw in garbage]
        out += [("out_of_bounds", base, "/generate", body) for body in (
            gen(top_k=2**63), gen(stop=["x"] * 100_000), gen(stop=["x" * 100_000]), gen(max_new_tokens=2**31),
            json.dumps({"input_ids": [2**40, 5]}).encode(), gen(temperature=-1), gen(top_p=7))]
        out += [("oversized", base, "/generate", json.dumps({"text": "word " * 2_000_000}).encode())]
        out += [("admin_without_token", base, path, body) for path, body in (
            ("/abort_request", b'{"abort_all": true}'), ("/pause_generation", b'{"mode": "abort"}'),
            ("/flush_cache", b""), ("/weights_checker", b'{"action": "reset_tensors"}'),
            ("/release_memory_occupation", b"{}"))]
    out.append(("admin_without_token", router, "/add_worker?url=http://127.0.0.1:9", b""))
    # The control, not an attack: valid requests that cost the engine nothing but their HTTP round
    # trip (aborting a request that does not exist), sent at the same rate.
    out += [("benign", base, "/abort_request", b'{"rid": "nobody"}') for base in (engine, router)]
    return out


def _declared_oversized(url: str) -> int:
    """A head declaring a body over the limit; returns the status the server answers before any body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {1 << 40}\r\n\r\n".encode())
        return int(s.recv(64).split(b" ", 2)[1])


def _slowloris(urls: list[str], stop: threading.Event, opened: list) -> None:
    """Keep 8 connections that send a byte every half second and never complete their request: half
    trickle the body after a full head, half a header's value."""
    heads = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{",
             b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    conns: list[tuple[socket.socket, bytes]] = []
    while not stop.is_set():
        while len(conns) < 8:
            n = len(opened)
            host, port = urls[n % len(urls)].removeprefix("http://").split(":")
            try:
                s = socket.create_connection((host, int(port)), timeout=5)
                s.sendall(heads[n % 2])
            except OSError:
                break
            conns.append((s, b" " if n % 2 == 0 else b"a"))
            opened.append(1)
        for conn in list(conns):
            try:
                conn[0].sendall(conn[1])
            except OSError:  # the server closed it: open another
                conns.remove(conn)
                conn[0].close()
        stop.wait(0.5)
    for s, _ in conns:
        s.close()


CLASSES = ("garbage", "out_of_bounds", "oversized", "admin_without_token", "slowloris")
CONTROL = "benign"  # `--classes benign`: as many valid no-op requests, to tell hostility from traffic


def attack(engine: str, router: str, workers: int, classes: tuple[str, ...] = CLASSES) -> dict:
    """Flood with `classes` until stdin closes; returns what the attack saw."""
    attacks = [a for a in _attacks(engine, router) if a[0] in classes]
    workers = workers if attacks else 0
    statuses: dict[str, Counter] = {}
    samples_5xx: list[str] = []
    hangs, lock, stop = [0], threading.Lock(), threading.Event()
    opened: list = []

    def worker(w: int) -> None:
        i = w
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                kind, base, path, body = attacks[i % len(attacks)]
                i += workers
                try:
                    if i % 50 < workers and "oversized" in classes:  # now and then, a head declaring too much
                        kind, status = "oversized", _declared_oversized(base)
                    else:
                        status = client.post(base + path, content=body, headers=JSON).status_code
                except httpx.TimeoutException:
                    with lock:
                        hangs[0] += 1
                    continue
                except (httpx.TransportError, OSError):
                    status = 0  # closed without an answer (a refusal sent before the body was read)
                with lock:
                    statuses.setdefault(kind, Counter())[status] += 1
                    if status >= 500 and len(samples_5xx) < 5:
                        samples_5xx.append(f"{status} {kind} {base}{path}")

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
    if "slowloris" in classes:
        threads.append(threading.Thread(target=_slowloris, args=([engine, router], stop, opened)))
    for t in threads:
        t.start()
    print("ready", flush=True)
    sys.stdin.read()  # the parent closes it when the honest phase is over
    stop.set()
    for t in threads:
        t.join()
    return {"statuses": {k: dict(v) for k, v in statuses.items()}, "hangs": hangs[0],
            "slow_connections": len(opened), "samples_5xx": samples_5xx}


class Attacker:
    """The attacker process: floods from `start` until `stop`, which returns its report."""

    def __init__(self, engine: str, router: str, workers: int, classes: tuple[str, ...] = CLASSES):
        self.proc = subprocess.Popen([sys.executable, __file__, "--attack", engine, router, "--attackers",
                                      str(workers), "--classes", ",".join(classes)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"the attacker process did not start: {line!r}")

    def stop(self) -> dict:
        out, _ = self.proc.communicate(timeout=180)
        return json.loads(out.strip().splitlines()[-1])


# ---- the measurement --------------------------------------------------------------------------

def measure(engine: str, router: str, *, clients: int = 2, requests: int = 24, rounds: int = 2,
            attackers: int = 4, new_tokens: int = 32, classes: tuple[str, ...] = CLASSES) -> dict:
    """Honest latency and outputs idle and under attack, alternating `rounds` times."""
    honest_phase(router, clients, clients, new_tokens)  # warm-up: connections, first forwards
    idle: list[float] = []
    under: list[float] = []
    reference: dict[int, list] = {}
    identical, honest_5xx = True, 0
    seen: dict[str, Counter] = {}
    hangs, slow, samples, attack_s = 0, 0, [], 0.0
    for _ in range(rounds):
        lat, outs, st = honest_phase(router, clients, requests, new_tokens)
        idle += lat
        honest_5xx += sum(n for s, n in st.items() if s >= 500)
        for k, o in outs.items():
            reference.setdefault(k, o[0])
            identical &= all(x == reference[k] for x in o)
        attacker = Attacker(engine, router, attackers, classes)
        t0 = time.perf_counter()
        try:
            lat, outs, st = honest_phase(router, clients, requests, new_tokens)
        finally:
            attack_s += time.perf_counter() - t0
            report = attacker.stop()
        under += lat
        honest_5xx += sum(n for s, n in st.items() if s >= 500)
        identical &= all(x == reference.get(k) for k, o in outs.items() for x in o)
        for kind, counts in report["statuses"].items():
            seen.setdefault(kind, Counter()).update({int(s): n for s, n in counts.items()})
        hangs, slow, samples = hangs + report["hangs"], slow + report["slow_connections"], samples + report["samples_5xx"]
    p50_idle, p95_idle = statistics.median(idle), _quantile(idle, 0.95)
    p50_att, p95_att = statistics.median(under), _quantile(under, 0.95)
    return {
        "honest_p50_s_idle": round(p50_idle, 4), "honest_p95_s_idle": round(p95_idle, 4),
        "honest_p50_s_attack": round(p50_att, 4), "honest_p95_s_attack": round(p95_att, 4),
        "ratio_p50": round(p50_att / p50_idle, 3), "ratio_p95": round(p95_att / p95_idle, 3),
        "identical_outputs": bool(identical), "honest_5xx": honest_5xx,
        "attack_5xx": sum(n for c in seen.values() for s, n in c.items() if s >= 500),
        "attack_hangs": hangs, "attack_requests": {k: sum(c.values()) for k, c in seen.items()},
        "attack_requests_per_s": round(sum(n for c in seen.values() for n in c.values()) / attack_s, 1),
        "attack_statuses": {k: dict(sorted(c.items())) for k, c in seen.items()},
        "slow_connections": slow, "samples_5xx": samples[:5], "honest_requests": len(idle) + len(under),
        "clients": clients, "rounds": rounds, "attackers": attackers, "new_tokens": new_tokens,
        "classes": list(classes),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="miles bench hostile", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=2, help="honest clients sending at once")
    p.add_argument("--requests", type=int, default=24, help="honest requests per phase")
    p.add_argument("--rounds", type=int, default=2, help="idle/attack phase pairs")
    p.add_argument("--attackers", type=int, default=4, help="attacker workers (threads of one process)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens per honest request")
    p.add_argument("--classes", default=",".join(CLASSES), help="attack classes, comma-separated: "
                   + ", ".join(CLASSES) + f"; or {CONTROL} (valid no-op requests at the same rate, the control)")
    p.add_argument("--model", default=None, help="checkpoint directory; default builds tiny-qwen3")
    p.add_argument("--attack", nargs=2, metavar=("ENGINE", "ROUTER"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    classes = tuple(c for c in a.classes.split(",") if c)
    unknown = sorted(set(classes) - set(CLASSES) - {CONTROL})
    if unknown:
        p.error(f"--classes: unknown {unknown}; choose from {', '.join(CLASSES + (CONTROL,))}")
    if a.attack:  # the attacker process
        print(json.dumps(attack(*a.attack, a.attackers, classes)), flush=True)
        return 0

    from miles.models.presets import build_tiny_model
    from miles.engine.process import EngineProcess
    from miles.rollout.router import RouterProcess

    load_before = os.getloadavg()[0]
    model = a.model or str(build_tiny_model("tiny-qwen3", tempfile.mkdtemp(prefix="miles-bench-hostile-")))
    with EngineProcess(model, admin_token=TOKEN, extra_args=["--num-threads", "1"]) as engine, \
            RouterProcess([engine.url], extra_args=["--admin-token", TOKEN]) as router:
        result = measure(engine.url, router.url, clients=a.clients, requests=a.requests, rounds=a.rounds,
                         attackers=a.attackers, new_tokens=a.new_tokens, classes=classes)
    result["load_avg_1m_start"] = round(load_before, 2)
    result["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    result["cpus"] = os.cpu_count()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
