"""The driver behind `miles train` and `miles sft`: builds the run, starts Ray, wires components,
runs the loop, writes the run directory.

Run directory: config.json (resolved), metrics.jsonl, checkpoints/, summary.json.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


def make_run_dir(output_dir: str, name: str) -> Path:
    base = Path(output_dir) / name
    path = base
    if path.exists() and any(path.iterdir()):
        # Never write over an earlier run's results.
        path = base.with_name(f"{base.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        i = 1
        while path.exists():
            path = base.with_name(f"{base.name}-{time.strftime('%Y%m%d-%H%M%S')}-{i}")
            i += 1
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class TrainContext:
    cfg: object
    run_dir: Path
    rollout: object
    trainer: object
    sink: object
    progress: object
    policy_version: int = 0     # optimizer steps the trainer has taken
    weight_version: int = 0     # the newest version pushed to the engines
    start_step: int = 0         # the step a resumed run continues after
    history: list = field(default_factory=list)
    fleet: object = None        # fleet.EngineFleet: replaces dead engines while the loop runs
    faults: object = None       # faults.FaultInjector, when the config asks for faults
    _memory_warned: bool = False

    def weights_lock(self):
        """Held while the trainer's weights move (train step, push), so an engine brought up meanwhile is
        pushed weights that match the version it is told."""
        import contextlib

        return self.fleet.weights_lock if self.fleet is not None else contextlib.nullcontext()

    def sync_weights(self, version: int) -> dict:
        """Push the trainer's weights to every serving engine as `version` (engines that die meanwhile
        are replaced and the push goes to the rest)."""
        if self.faults is not None:
            self.faults.before_push()
        if self.fleet is None:
            return self.trainer.sync_weights(version)
        with self.fleet.weights_lock:
            return self.fleet.push(lambda: self.trainer.sync_weights(version))

    def call(self, method, *args):
        import ray

        return ray.get(method.remote(*args))

    def eval_due(self, step: int) -> bool:
        every = self.cfg.eval.every_steps
        return step == self.cfg.loop.num_steps or (every > 0 and step % every == 0)

    def save(self, step: int) -> str:
        self.save_state(step)
        return self.trainer.save_hf(str(self.run_dir / "checkpoints" / f"step_{step}"))

    def save_state(self, step: int) -> str:
        """Resumable checkpoint (trainer state, buffer and prompt position, versions), made visible
        by one rename once every part is written."""
        from miles.trainer.checkpoint import commit, staging_path

        final = self.run_dir / "checkpoints" / f"state_{step}"
        staging = staging_path(final)
        self.trainer.save_checkpoint(str(staging))
        (staging / "rollout.json").write_text(json.dumps(self.call(self.rollout.buffer_state_dict)))
        meta = {"step": step, "policy_version": self.policy_version, "weight_version": self.weight_version}
        return str(commit(staging, final, meta))

    def restore(self) -> None:
        """Continue from the run directory's latest resumable checkpoint: trainer state, buffer and
        prompt position, then the engines get the saved weights before they generate again."""
        from miles.trainer.checkpoint import latest_checkpoint

        ckpt = latest_checkpoint(self.run_dir / "checkpoints")
        if ckpt is None:
            raise SystemExit(f"miles: {self.run_dir} has no resumable checkpoint (checkpoints/latest); "
                             "runs save one at every loop.save_every steps and at the end")
        meta = json.loads((ckpt / "meta.json").read_text())
        self.trainer.load_checkpoint(str(ckpt))
        self.call(self.rollout.load_buffer_state_dict, json.loads((ckpt / "rollout.json").read_text()))
        self.start_step, self.policy_version = meta["step"], meta["policy_version"]
        self.sync_weights(meta["policy_version"])
        self.weight_version = meta["policy_version"]
        self.call(self.rollout.set_versions, self.policy_version, self.weight_version)
        log(f"resumed from {ckpt} at step {self.start_step}")

    def record(self, step: int, metrics: dict) -> None:
        self.history.append((step, metrics))

    def engine_memory(self, action: str) -> None:
        """Colocated turn-taking on the engine side (release before training, resume after)."""
        if not self.call(self.rollout.engine_memory, action) and not self._memory_warned:
            self._memory_warned = True
            log("colocated: the engines do not offer /release_memory_occupation; they keep their memory "
                "while the trainer works")


LOOPS = {"sync": "miles.orchestration.sync_loop:run_sync_loop",
         "one_step_off": "miles.orchestration.one_step_off:run_one_step_off_loop",
         "fully_async": "miles.orchestration.async_loop:run_fully_async_loop"}


def run_loop(ctx) -> None:
    import importlib

    module, _, name = LOOPS[ctx.cfg.loop.schedule].partition(":")
    getattr(importlib.import_module(module), name)(ctx)


def _engine_starter(cfg, cores, admin_token: str):
    """start(slot) -> a running engine (a Ray actor around the built-in engine) in the engine pool's cores.

    Slot -1 is a standby engine, not yet given a slot."""
    import itertools

    from miles.orchestration.actors import EngineShell, remote

    cls = remote(EngineShell)
    standby_seeds = itertools.count(cfg.run.seed + 10_000)

    def launch(slot: int):
        seed = cfg.run.seed + slot if slot >= 0 else next(standby_seeds)
        return cls.remote(cfg.rollout.engine.for_run(cfg.model.path, seed, admin_token), cores)

    def handle(actor):
        import ray

        from miles.orchestration.fleet import EngineHandle

        url, pid = ray.get([actor.url.remote(), actor.pid.remote()])
        return EngineHandle(url, pid, lambda: ray.kill(actor))

    def start(slot: int):
        return handle(launch(slot))

    def start_many(n: int):
        actors = [launch(i) for i in range(n)]  # all start together; then wait for each
        return [handle(a) for a in actors]

    return start, start_many


def _start_fleet(cfg, pools, admin_token: str, holder: dict):
    """Engines, the router in front of them, and the fleet that keeps them serving."""
    import dataclasses

    import ray

    from miles.orchestration.fleet import EngineFleet
    from miles.rollout.router import start_router_thread

    start, start_many = _engine_starter(cfg, pools.engine if pools else None, admin_token)
    # Standby engines start with the others, so that even the first failure finds one ready.
    started = start_many(cfg.rollout.num_engines + (cfg.health.standby_engines if cfg.health.enabled else 0))
    holder["engines"] = started
    engines, standby = started[:cfg.rollout.num_engines], started[cfg.rollout.num_engines:]
    router = start_router_thread(dataclasses.replace(cfg.router, admin_token=admin_token), [e.url for e in engines],
                                 cfg.health)
    holder["router"] = router

    def bring_up(url: str) -> None:
        ctx = holder["ctx"]
        ctx.trainer.push_full([url], ctx.policy_version)

    def reconnect(urls: list[str]) -> None:
        holder["ctx"].trainer.reconnect_engines(urls)

    def on_change(urls: list[str]) -> None:
        ray.get(holder["rollout"].set_engine_urls.remote(urls))

    fleet = EngineFleet(cfg.health, start, router.url, admin_token, bring_up=bring_up, reconnect=reconnect,
                        on_change=on_change)
    fleet.adopt(engines, standby)
    holder["fleet"] = fleet
    return fleet, router


def _check_reachable(urls: list[str]) -> None:
    """External engines must answer /health before the run starts (a typo'd URL fails here, clearly)."""
    import httpx

    for url in urls:
        try:
            httpx.get(url + "/health", timeout=10).raise_for_status()
        except httpx.HTTPError as exc:
            raise SystemExit(f"miles: engine {url} (rollout.engine_urls) does not answer /health: {exc}") from None


def run_train(cfg, resume: str | None = None) -> dict:
    import ray

    from miles.config.loader import save_config, to_dict
    from miles.metrics.progress import Progress
    from miles.metrics.sink import open_sinks
    from miles.orchestration.placement import core_pools
    from miles.orchestration.ray_cluster import ensure_ray
    from miles.orchestration.trainer_group import TrainerGroup
    from miles.rollout.manager import RolloutManager

    if resume and cfg.loop.schedule != "sync":
        raise SystemExit(f"miles: --resume supports loop.schedule = 'sync' (this run uses {cfg.loop.schedule!r})")
    if resume and cfg.fault.kill_trainer_at_step:
        # The saved config still asks for the fault that ended the run; once was the point.
        cfg.fault.kill_trainer_at_step = 0
    run_dir = Path(resume) if resume else make_run_dir(cfg.run.output_dir, cfg.run.name)
    save_config(cfg, run_dir / "config.json")
    log(f"run directory: {run_dir}")
    started_ray = not ray.is_initialized()
    ensure_ray(cfg.ray)
    pools = core_pools(cfg.placement)
    external = list(cfg.rollout.engine_urls)
    admin_token = (os.environ.get("MILES_ENGINE_ADMIN_TOKEN") or None) if external else secrets.token_hex(16)
    trainer, sink, progress, dashboard, faults = None, None, None, None, None
    fleet, router = None, None
    holder: dict = {}  # what has been started, for the fleet's callbacks and for shutdown
    t_start = time.perf_counter()
    try:
        if external:
            # Started and stopped by someone else: generate and push to them directly; no router, and no
            # health monitor, since the run could not restart them.
            urls = [u.rstrip("/") for u in external]
            _check_reachable(urls)
            log(f"engines ready: {', '.join(urls)}")
        else:
            fleet, router = _start_fleet(cfg, pools, admin_token, holder)
            urls = fleet.serving_urls()
            log(f"engines ready: {', '.join(urls)}; router at {router.url}")
        trainer = TrainerGroup(cfg.trainer, cfg.sync, cfg.model.path, cfg.run.seed, cfg.rollout.temperature,
                               pools.trainer if pools else None, admin_token)
        trainer.connect_engines(urls)
        from miles.orchestration.actors import remote

        # Threaded: the trainer's blocking collect() must not hold up version updates or evaluation.
        # Not pinned: its HTTP and scoring work runs wherever a core is idle. Pinned to the engine
        # pool it took a quarter of the engines' core away from decoding under fully_async.
        rollout = remote(RolloutManager, max_concurrency=8).remote(
            cfg.rollout, cfg.eval, cfg.model.path, urls, cfg.run.seed, buffer_cfg=cfg.buffer, admin_token=admin_token,
            router_url=router.url if router else None)
        holder["rollout"] = rollout
        sink = open_sinks(cfg.metrics, run_dir, run_dir.name, to_dict(cfg))
        if cfg.metrics.dashboard:
            from miles.metrics.dashboard import Dashboard

            dashboard = Dashboard(run_dir, cfg.metrics.dashboard_host, cfg.metrics.dashboard_port).start()
            log(f"dashboard: {dashboard.url}")
        progress = Progress("train", cfg.loop.num_steps, mode=cfg.metrics.progress)
        ctx = TrainContext(cfg, run_dir, rollout, trainer, sink, progress, fleet=fleet)
        holder["ctx"] = ctx
        if resume:
            ctx.restore()
            before = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
        else:
            before = ctx.call(rollout.evaluate)
            sink.write(0, before)
        log(f"eval accuracy before RL: {before['eval/accuracy']:.3f}")
        log(f"schedule: {cfg.loop.schedule}, placement: {cfg.placement.mode}")
        if fleet is not None:
            fleet.start_monitor()
        if cfg.fault.active:
            from miles.orchestration.faults import FaultInjector

            faults = ctx.faults = FaultInjector(cfg.fault, fleet)
            if cfg.fault.drop_response_prob and router is not None:
                router.router.response_fault = faults.drop_response
            faults.start()
            log(f"fault injection on: {cfg.fault}")
        run_loop(ctx)
        if faults is not None:
            faults.stop()
        ledger = ctx.call(rollout.ledger)  # raises if any drawn prompt went unaccounted
        progress.close()
        after = ctx.history[-1][1] if ctx.history else before
        final_ckpt = ctx.save(cfg.loop.num_steps)
        sink.close()
        sink = None
        summary = {
            "run_dir": str(run_dir), "steps": cfg.loop.num_steps,
            "eval_accuracy_before": before["eval/accuracy"],
            "eval_accuracy_after": after.get("eval/accuracy", before["eval/accuracy"]),
            "final_checkpoint": final_ckpt, "wall_time_s": time.perf_counter() - t_start,
            "schedule": cfg.loop.schedule, "ledger": ledger,
            "fleet": fleet.report() if fleet is not None else None,
        }
        if faults is not None:
            summary["faults"] = faults.report(summary["fleet"]["events"] if fleet is not None else [])
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        log(f"done in {summary['wall_time_s']:.0f}s: eval accuracy {summary['eval_accuracy_before']:.3f} before RL "
            f"→ {summary['eval_accuracy_after']:.3f} after RL; checkpoint {final_ckpt}")
        return summary
    finally:
        if faults is not None:
            faults.stop()
        if progress is not None:
            progress.close()
        if sink is not None:
            sink.close()
        if dashboard is not None:
            dashboard.stop()
        if "fleet" in holder:
            holder["fleet"].close()
        else:
            for e in holder.get("engines", []):
                e.stop()
        if "router" in holder:
            holder["router"].stop()
        if trainer is not None:
            trainer.close()
        if started_ray:
            ray.shutdown()


def run_sft(cfg) -> dict:
    """Supervised warm start on the task's demonstrations; writes an HF checkpoint to cfg.sft.out."""
    import dataclasses
    import random

    import ray

    from miles.metrics.progress import Progress
    from miles.models.loading import load_tokenizer
    from miles.orchestration.placement import core_pools
    from miles.orchestration.ray_cluster import ensure_ray
    from miles.orchestration.trainer_group import TrainerGroup
    from miles.rollout.data_source import PromptSource
    from miles.trainer.sft import demonstration_sequences

    t0 = time.perf_counter()
    tok = load_tokenizer(cfg.model.path)
    prompts = PromptSource(cfg.rollout.task, "train", cfg.run.seed + 1).take(cfg.sft.num_examples)
    if cfg.rollout.task.apply_chat_template:
        def encode(text):
            return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True))
    else:
        def encode(text):
            return tok(text, add_special_tokens=False).input_ids
    data = demonstration_sequences(prompts, tok, encode)
    rng = random.Random(cfg.run.seed)
    started_ray = not ray.is_initialized()
    ensure_ray(cfg.ray)
    pools = core_pools(cfg.placement)
    tcfg = dataclasses.replace(cfg.trainer, lr=cfg.sft.lr)
    trainer = TrainerGroup(tcfg, cfg.sync, cfg.model.path, cfg.run.seed, 1.0, pools.trainer if pools else None)
    progress = Progress("sft", cfg.sft.steps, mode=cfg.metrics.progress)
    order: list[int] = []
    try:
        m = {}
        for step in range(1, cfg.sft.steps + 1):
            batch = []
            while len(batch) < cfg.sft.batch_size:
                if not order:
                    order = list(range(len(data)))
                    rng.shuffle(order)
                batch.append(data[order.pop()])
            m = trainer.train_step(batch, kind="sft")
            if progress.live or step % max(1, cfg.sft.steps // 20) == 0 or step == cfg.sft.steps:
                progress.update(step, nll=m["sft/nll"])
        progress.close()
        out = trainer.save_hf(cfg.sft.out)
        summary = {"out": out, "steps": cfg.sft.steps, "final_nll": m.get("sft/nll"),
                   "wall_time_s": time.perf_counter() - t0}
        log(f"SFT done in {summary['wall_time_s']:.0f}s; warm-started model written to {out}")
        return summary
    finally:
        trainer.close()
        if started_ray:
            ray.shutdown()


def log(msg: str) -> None:
    print(f"[miles] {msg}", file=sys.stderr, flush=True)
