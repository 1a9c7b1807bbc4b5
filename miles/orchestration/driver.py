"""The driver behind `miles train` and `miles sft`: builds the run, starts Ray, wires components,
runs the loop, writes the run directory.

Everything the driver starts is entered on one ExitStack as it starts, so whatever point a run
fails at, exactly what was started is stopped, in reverse order. Run directory: config.json
(resolved), metrics.jsonl, checkpoints/, summary.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import random
import time
from pathlib import Path
from typing import Callable

from miles.config.loader import save_config, to_dict
from miles.run_checks import label_budgets
from miles.run_config import RunConfig
from miles.data.chat import encode_prompt
from miles.data.preflight import check_dataset, check_labels
from miles.data.rows import DataError
from miles.eval.evaluator import Evaluator
from miles.metrics.dashboard import Dashboard
from miles.metrics.progress import Progress
from miles.metrics.sink import open_sinks
from miles.models.loading import load_tokenizer, load_vision
from miles.orchestration.context import TrainContext, log
from miles.orchestration.actors import remote
from miles.orchestration.faults import FaultInjector
from miles.orchestration.launch import (on_driver_node, place_run_devices, ray_for_run, run_admin_token, start_fleet,
                                        start_teachers, trainer_pool)
from miles.run_sections import SCHEDULES
from miles.orchestration.placement import core_pools, resolve_threads
from miles.orchestration.ray_cluster import node_address
from miles.orchestration.router_supervisor import SupervisedRouter
from miles.orchestration.trainer_group import TrainerFailure, TrainerGroup
from miles.data.prompts import PromptSource
from miles.rollout.manager import RolloutManager
from miles.rollout.router import RunningRouter
from miles.trainer.checkpoint import latest_checkpoint
from miles.trainer.sft import demonstration_sequences


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


def _start(cfg: RunConfig, run_dir: Path, stack: contextlib.ExitStack, resume: bool = False
           ) -> tuple[TrainContext, RunningRouter | SupervisedRouter | None, Callable[[], TrainerGroup]]:
    """Start every component of a run, each entered on `stack`; the TrainContext that holds them, and
    how to start its trainer group again (fault.restart_trainer). Resuming, the router an earlier
    driver of the run left serving is adopted (router_supervisor.py); engines and trainer are new."""
    stack.enter_context(ray_for_run(cfg))
    cfg, gpus = place_run_devices(cfg)
    pools = core_pools(cfg.placement)
    cfg = resolve_threads(cfg, pools)
    external = list(cfg.rollout.engine_urls)
    admin_token = run_admin_token(external=bool(external), run_dir=run_dir if resume else None)
    wiring: dict = {}
    fleet, router = start_fleet(cfg, pools, admin_token, stack, wiring, gpus.engine, run_dir=run_dir, resume=resume)
    urls = fleet.serving_urls()
    adopted = getattr(router, "adopted", False)
    log(f"engines ready{' (started outside the run)' if external else ''}: {', '.join(urls)}; router at {router.url}"
        f"{f' (adopted: pid {router.pid}, left serving by the previous driver)' if adopted else ''}")
    teacher_urls = start_teachers(cfg, pools, stack, gpus.engine)
    if teacher_urls:
        log(f"teacher engines ready: {', '.join(teacher_urls)}")
    sync = dataclasses.replace(cfg.sync, dtype=cfg.wire_dtype())
    ranks_pool = trainer_pool(cfg, stack, gpus.trainer)

    def start_trainer() -> TrainerGroup:
        group = TrainerGroup(cfg.trainer, sync, cfg.model.path, cfg.run.seed, cfg.rollout.temperature,
                             pools.trainer if pools else None, admin_token, pool=ranks_pool)
        stack.callback(group.close)
        log(f"trainer ranks on {', '.join(group.nodes)}; group master {group.master}")
        group.connect_engines(fleet.serving_urls())
        return group

    trainer = start_trainer()
    # Threaded: the trainer's blocking collect() must not hold up version updates or evaluation.
    # Not pinned: its HTTP and scoring work runs wherever a core is idle. Pinned to the engine
    # pool it took a quarter of the engines' core away from decoding under fully_async.
    rollout = remote(RolloutManager, max_concurrency=8).options(**on_driver_node()).remote(
        cfg.rollout, cfg.model.path, urls, cfg.run.seed, buffer_cfg=cfg.buffer, admin_token=admin_token,
        router_url=router.url, teacher_urls=teacher_urls, evaluator=functools.partial(Evaluator, cfg.eval))
    sink = open_sinks(cfg.metrics, run_dir, run_dir.name, to_dict(cfg))
    stack.callback(sink.close)
    if cfg.metrics.dashboard:
        dashboard = Dashboard(run_dir, cfg.metrics.dashboard_host or node_address(), cfg.metrics.dashboard_port).start()
        stack.callback(dashboard.stop)
        log(f"dashboard: {dashboard.url}")
    progress = Progress("train", cfg.loop.num_steps, mode=cfg.metrics.progress)
    stack.callback(progress.close)
    ctx = wiring["ctx"] = TrainContext(cfg, run_dir, rollout, trainer, sink, progress, fleet=fleet,
                                       router_url=router.url)
    return ctx, router, start_trainer


def _start_faults(ctx: TrainContext, router: RunningRouter | SupervisedRouter | None,
                  stack: contextlib.ExitStack) -> None:
    faults = ctx.faults = FaultInjector(ctx.cfg.fault, ctx.fleet, ctx.run_dir / "faults.jsonl", router)
    if ctx.cfg.fault.drop_response_prob and router is not None:
        router.router.response_fault = faults.drop_response
    faults.start()
    stack.callback(faults.stop)
    log(f"fault injection on: {ctx.cfg.fault}")


def check_data(cfg: RunConfig) -> None:
    """A dataset task's rows, and every label against the max_new_tokens it is generated under, all
    checked before the run directory, Ray or any engine exists (`miles train` and `miles sft`)."""
    tokenizer = load_tokenizer(cfg.model.path)
    try:
        if cfg.rollout.task.name == "dataset":
            counts = check_dataset(cfg.rollout.task, tokenizer, cfg.model.path, cfg.rollout.engine.context_length,
                                   load_vision(cfg.model.path))
            log(f"data: {counts['train']} train rows, {counts['eval']} eval rows checked")
        allowed = check_labels(label_budgets(cfg), tokenizer, cfg.run.seed)
    except DataError as exc:
        raise SystemExit(f"miles: bad data, nothing started: {exc}") from None
    for found in allowed:
        log(f"warning: {found.numbers()}; their answers will be cut short ({found.budget.allow_key} = true)")


def rewind_run_dir(run_dir: Path) -> int:
    """Before going back to the run directory's latest resumable checkpoint: its step, with
    metrics.jsonl cut back to the records up to it. Steps after it are trained again, and a run
    killed mid-write may have left a torn last line; neither may appear twice or break the file.

    Records are in step order, so what stays is a prefix of the file: one truncate, which a sink
    that has the file open for appending simply writes after."""
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        raise SystemExit(f"miles: {run_dir} has no resumable checkpoint (checkpoints/latest); "
                         "runs save one at every loop.save_every steps and at the end")
    step = json.loads((ckpt / "meta.json").read_text())["step"]
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return step
    end = 0
    with path.open("rb") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                break  # a torn last line
            if not line.endswith(b"\n") or record.get("step", step + 1) > step:
                break
            end += len(line)
    os.truncate(path, end)
    return step


def _run_schedule(ctx: TrainContext, start_trainer: Callable[[], TrainerGroup]) -> None:
    """The configured schedule; with fault.restart_trainer, a failed trainer group is replaced by a new
    one and the whole run goes back to its last resumable checkpoint (trainer state, buffer with its
    in-flight prompts, ledger, data position, metrics), then goes on. The engines keep their
    processes; the restored weights are pushed to them before they generate again."""
    schedule, fault = SCHEDULES.get(ctx.cfg.loop.schedule), ctx.cfg.fault
    while True:
        try:
            return schedule(ctx)
        except TrainerFailure as exc:
            if not fault.restart_trainer or ctx.trainer_restarts >= fault.max_trainer_restarts:
                raise
            ctx.trainer_restarts += 1
            ctx.trainer_restoring = True
            log(f"{exc}\n[miles] fault.restart_trainer: starting a new trainer group "
                f"(restart {ctx.trainer_restarts} of at most {fault.max_trainer_restarts})")
            ctx.trainer.close()
            # The write the failed group was making ends with it (its ranks are gone) or had finished;
            # either way `latest` is settled before the run goes back to it.
            lost = ctx.checkpoints.abandon()
            if lost:
                log(f"the checkpoint being written when the trainer failed was not committed ({lost})")
            ctx.trainer = start_trainer()
            step = rewind_run_dir(ctx.run_dir)
            ctx.history = [(s, m) for s, m in ctx.history if s <= step]
            ctx.restore()
            ctx.trainer_restoring = False


def run_train(cfg: RunConfig, resume: str | None = None) -> dict:
    if resume and cfg.fault.kill_trainer_at_step:
        # The saved config still asks for the fault that ended the run; once was the point.
        cfg = dataclasses.replace(cfg, fault=dataclasses.replace(cfg.fault, kill_trainer_at_step=0))
    check_data(cfg)
    run_dir = Path(resume) if resume else make_run_dir(cfg.run.output_dir, cfg.run.name)
    if resume:
        rewind_run_dir(run_dir)
    save_config(cfg, run_dir / "config.json")
    log(f"run directory: {run_dir}")
    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        ctx, router, start_trainer = _start(cfg, run_dir, stack, resume=bool(resume))
        if resume:
            ctx.restore()
            before = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
        else:
            before = ctx.call(ctx.rollout.evaluate)
            ctx.sink.write(0, before)
            if cfg.fault.restart_trainer:
                ctx.save_state(0)  # a trainer that fails before the first save has this to go back to
        log(f"eval accuracy before RL: {before['eval/accuracy']:.3f}")
        log(f"schedule: {cfg.loop.schedule}, placement: {cfg.placement.mode}")
        if ctx.fleet is not None:
            ctx.fleet.start_monitor()
        if cfg.fault.active:
            _start_faults(ctx, router, stack)
        _run_schedule(ctx, start_trainer)
        if ctx.faults is not None:
            ctx.faults.stop()
        return _finish(ctx, before, t_start, router)


def _eval_figures(record: dict) -> dict[str, float]:
    return {k: v for k, v in record.items() if k.startswith("eval/") and not k.endswith("time_s")}


def _finish(ctx: TrainContext, before: dict, t_start: float, router=None) -> dict:
    """Account for every prompt, save the final checkpoint, write summary.json."""
    cfg, fleet = ctx.cfg, ctx.fleet
    ledger = ctx.call(ctx.rollout.ledger)  # raises if any drawn prompt went unaccounted
    ctx.progress.close()
    after = ctx.history[-1][1] if ctx.history else before
    final_ckpt = ctx.save(cfg.loop.num_steps)
    ctx.wait_for_saves()  # the summary names a checkpoint that is on disk, and `latest` is this one
    summary = {
        "run_dir": str(ctx.run_dir), "steps": cfg.loop.num_steps,
        "eval_accuracy_before": before["eval/accuracy"],
        "eval_accuracy_after": after.get("eval/accuracy", before["eval/accuracy"]),
        # Every eval figure (each eval set's pass@k, avg@k, maj@k, accuracy) before RL and at the last evaluation.
        "eval_before": _eval_figures(before), "eval_after": _eval_figures(after),
        "final_checkpoint": final_ckpt, "wall_time_s": time.perf_counter() - t_start,
        "schedule": cfg.loop.schedule, "ledger": ledger, "trainer_restarts": ctx.trainer_restarts,
        "fleet": fleet.report() if fleet is not None else None,
        "router": router.report() if isinstance(router, SupervisedRouter) else None,
        "checkpoints": ctx.checkpoint_cost(),
        "cluster": _cluster_report(ctx),
    }
    if ctx.faults is not None:
        summary["faults"] = ctx.faults.report(summary["fleet"]["events"] if fleet is not None else [])
    (ctx.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"done in {summary['wall_time_s']:.0f}s: eval accuracy {summary['eval_accuracy_before']:.3f} before RL "
        f"→ {summary['eval_accuracy_after']:.3f} after RL; checkpoint {final_ckpt}")
    return summary


def _cluster_report(ctx: TrainContext) -> dict:
    """Where the run ran: every node, the driver's, the trainer ranks' and their group master, the router,
    and for each engine its node and how its weights travelled."""
    import ray

    channels = ctx.trainer.channels()
    engines = ([{"url": e.url, "node": e.node} for _, e in ctx.fleet.serving()] if ctx.fleet is not None
               else [{"url": url, "node": None} for url in channels])
    for e in engines:
        e["sync"] = channels.get(e["url"])
    return {"nodes": sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]),
            "driver": node_address(), "router": ctx.router_url,
            "trainer": {"master": ctx.trainer.master, "ranks": ctx.trainer.nodes},
            "engines": engines}


def run_sft(cfg: RunConfig) -> dict:
    """Supervised warm start on the task's demonstrations; writes an HF checkpoint to cfg.sft.out.
    With sft.target_accuracy set it stops as soon as held-out greedy accuracy reaches the target."""
    t0 = time.perf_counter()
    check_data(cfg)  # SFT's demonstrations are the labels RL and eval must then generate in full
    sft = cfg.sft
    tok, vision = load_tokenizer(cfg.model.path), load_vision(cfg.model.path)
    prompts = PromptSource(cfg.rollout.task, "train", cfg.run.seed + 1).take(sft.num_examples)

    def encode(prompt):  # as rollouts encode it: chat messages, templates and image tokens included
        return encode_prompt(tok, cfg.rollout.task, prompt.text, prompt.messages, prompt.images, vision)

    data = demonstration_sequences(prompts, tok, encode)
    held_out = []
    if sft.target_accuracy:
        # The same held-out split RL evaluates on, so the warm start's accuracy is the run's step 0.
        held_out = demonstration_sequences(PromptSource(cfg.rollout.task, "eval", cfg.run.seed)
                                           .take(sft.eval_examples), tok, encode)
    rng = random.Random(cfg.run.seed)
    with contextlib.ExitStack() as stack:
        stack.enter_context(ray_for_run(cfg))
        cfg, gpus = place_run_devices(cfg, engines=False)
        pools = core_pools(cfg.placement)
        cfg = resolve_threads(cfg, pools)
        tcfg = dataclasses.replace(cfg.trainer, lr=sft.lr)
        trainer = TrainerGroup(tcfg, cfg.sync, cfg.model.path, cfg.run.seed, 1.0, pools.trainer if pools else None,
                               pool=trainer_pool(cfg, stack, gpus.trainer))
        stack.callback(trainer.close)
        progress = Progress("sft", sft.steps, mode=cfg.metrics.progress)
        order: list[int] = []
        m: dict[str, float] = {}
        acc = None
        step = 0
        for step in range(1, sft.steps + 1):
            batch = []
            while len(batch) < sft.batch_size:
                if not order:
                    order = list(range(len(data)))
                    rng.shuffle(order)
                batch.append(data[order.pop()])
            m = trainer.train_step(batch, algorithm="sft")
            if held_out and (step % sft.eval_every == 0 or step == sft.steps):
                acc = trainer.greedy_accuracy(held_out)
                progress.update(step, nll=m["sft/nll"], accuracy=acc)
                if acc >= sft.target_accuracy:
                    break
            elif progress.live or step % max(1, sft.steps // 20) == 0 or step == sft.steps:
                progress.update(step, nll=m["sft/nll"])
        progress.close()
        out = trainer.save_hf(sft.out)
        summary = {"out": out, "steps": step, "final_nll": m.get("sft/nll"),
                   "wall_time_s": time.perf_counter() - t0}
        if held_out:
            summary["held_out_accuracy"] = acc
            summary["reached_target"] = acc is not None and acc >= sft.target_accuracy
            if not summary["reached_target"]:
                log(f"SFT ran all {sft.steps} steps without reaching sft.target_accuracy "
                    f"{sft.target_accuracy} (held-out accuracy {acc:.3f}); raise sft.steps or sft.lr")
        log(f"SFT done in {summary['wall_time_s']:.0f}s after {step} steps; warm-started model written to {out}")
        return summary
