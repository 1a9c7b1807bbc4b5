"""Starting a run's processes: Ray for the run, its placement pools and their devices, the engines
with their router and fleet, and teacher engines. Each is entered on the run's ExitStack as it starts,
so whatever fails, exactly what was started is stopped.

Non-goals: what the run does with them (driver.py, the schedules), placement policy (placement.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import secrets
from pathlib import Path

from miles.engine_api import routes
from miles.engine_api.client import EngineClient
from miles.engine_api.errors import EngineError
from miles.orchestration.actors import EngineShell, SGLangShell, remote
from miles.orchestration.context import log
from miles.orchestration.detached import DetachedEngines
from miles.orchestration.fleet import EngineFleet, EngineHandle
from miles.orchestration.placement import CorePools, GpuShares, NodePool, PlacementError, place_devices
from miles.orchestration.ray_cluster import ensure_ray, node_address
from miles.orchestration.router_supervisor import RECORD, RouterRecord, SupervisedRouter
from miles.orchestration.trainer_group import TrainerFailure
from miles.rollout.router import RunningRouter, start_router_thread
from miles.rollout.teacher import check_served_teacher
from miles.run_config import RunConfig


# The engines a run can start (rollout.engine.kind): the Ray actor that owns one.
ENGINE_SHELLS = {"builtin": EngineShell, "sglang": SGLangShell}


def engine_starter(cfg: RunConfig, cores, admin_token: str, pool: NodePool, detached: DetachedEngines | None = None):
    """start(slot) -> a running engine (a Ray actor around a built-in engine or an SGLang server,
    rollout.engine.kind) in the engine pool: on
    the slot's bundle's node, in the pool's cores; start_many(n, first) starts slots first..n-1
    together; adopt(size) -> up to size engines an earlier driver of the run left (detached engines only).

    Slot -1 is a standby engine, not yet given a slot (it takes the bundles after the slots')."""
    import ray

    kind = cfg.rollout.engine.kind
    cls = remote(ENGINE_SHELLS[kind])
    standby_seeds = itertools.count(cfg.run.seed + 10_000)
    standby_bundles = itertools.count(cfg.rollout.num_engines)
    here = node_address()

    def launch(slot: int):
        seed = cfg.run.seed + slot if slot >= 0 else next(standby_seeds)
        bundle = slot if slot >= 0 else next(standby_bundles)
        options = {**pool.options(bundle), **(detached.options() if detached else {})}
        engine = cfg.rollout.engine.for_run(cfg.model.path, seed, admin_token)
        # An SGLang server also gets its own table and whether to record routed experts (its flag).
        args = (engine, cfg.rollout.engine.sglang, cfg.rollout.return_routed_experts) if kind == "sglang" else (engine,)
        actor = cls.options(**options).remote(*args, cores, detached.lease_s if detached else None)
        if detached:
            detached.track(actor)
        return actor

    def handle(actor) -> EngineHandle:
        url, pid, node = ray.get([actor.url.remote(), actor.pid.remote(), actor.node.remote()])

        def stop() -> None:
            if detached:
                detached.forget(actor)
            ray.kill(actor)

        return EngineHandle(url, pid, stop, node=node, on_this_node=node == here,
                            signal_self=lambda sig: actor.signal.remote(sig))

    def start(slot: int) -> EngineHandle:
        return handle(launch(slot))

    def start_many(n: int, first: int = 0) -> list[EngineHandle]:
        actors = [launch(i) for i in range(first, n)]  # all start together; then wait for each
        return [handle(a) for a in actors]

    def adopt(size: int) -> list[EngineHandle]:
        found = []
        for actor in detached.left_behind() if detached else []:
            if len(found) == size:  # more than this run needs now: ended
                ray.kill(actor)
                continue
            try:
                ray.get(actor.url.remote(), timeout=60)  # a dead or hung actor fails here, not in handle's wait
                engine = handle(actor)
            except Exception as exc:  # noqa: BLE001 - dead or unanswering: ended, and a new one takes its place
                log(f"a detached engine of this run left by the previous driver does not answer "
                    f"({str(exc).splitlines()[0][:200]}): ending it")
                ray.kill(actor)
                continue
            detached.track(actor)
            found.append(engine)
        return found

    return start, start_many, adopt


def cannot_start(slot: int) -> EngineHandle:
    raise RuntimeError("the engines of this run are rollout.engine_urls, started outside it: miles starts no "
                       "engine of its own to replace or add to them")


def start_fleet(cfg: RunConfig, pools: CorePools | None, admin_token: str | None, stack: contextlib.ExitStack,
                run: dict, gpus: float = 0.0, run_dir: Path | None = None, resume: bool = False
                ) -> tuple[EngineFleet, RunningRouter | SupervisedRouter]:
    """Engines, the router in front of them, and the fleet that keeps them serving.

    The engines are the run's own, or the ones at rollout.engine_urls: those are probed, routed
    around and re-admitted like the run's own, but never started, stopped or restarted by it.
    With router.own_process the router's record is kept in `run_dir`, and a `resume` adopts the
    router an earlier driver of the run left serving (with these engines in place of that driver's).
    `run` gets the TrainContext under "ctx" once it exists; the fleet's callbacks only fire after
    the monitor starts, by which time it does."""
    unadopted = stack.enter_context(contextlib.ExitStack())  # stops the engines until the fleet owns them
    if cfg.rollout.engine_urls:
        engines, standby, start = [EngineHandle.outside(u) for u in cfg.rollout.engine_urls], [], cannot_start
        check_reachable([e.url for e in engines])
        if resume:
            continue_engines([e.url for e in engines], admin_token)
        # The router's token guards its membership routes; the engines' own (their operator's) goes
        # with every call it forwards to them, so without one the router still gets a fresh token.
        previous = RouterRecord.load(run_dir / RECORD) if resume and run_dir is not None else None
        router_token = admin_token or (previous.admin_token if previous else None) or secrets.token_hex(16)
    else:
        size = cfg.rollout.num_engines + (cfg.health.standby_engines if cfg.health.enabled else 0)
        detached = None
        if cfg.ray.detached_engines and run_dir is not None:
            detached = DetachedEngines(run_dir, cfg.ray.engine_lease_s)
            stack.callback(detached.stop)
        pool = node_pool("engines", size, cfg.placement.engine_nodes, "placement.engine_nodes", cfg, stack, gpus,
                         detached_as=detached.group_name if detached else None)
        start, start_many, adopt = engine_starter(cfg, pools.engine if pools else None, admin_token, pool, detached)
        adopted = adopt(size) if resume else []
        if adopted:
            log(f"adopted {len(adopted)} detached engines left serving by the previous driver: "
                f"{', '.join(e.url for e in adopted)}")
            continue_engines([e.url for e in adopted], admin_token)
        # Standby engines start with the others, so that even the first failure finds one ready.
        started = adopted + start_many(size, first=len(adopted))
        engines, standby = started[:cfg.rollout.num_engines], started[cfg.rollout.num_engines:]
        for e in started:
            unadopted.callback(e.stop)
        router_token = admin_token
    router_cfg = dataclasses.replace(cfg.router, admin_token=router_token,
                                 host=cfg.router.host or node_address())
    if cfg.router.own_process:
        # Restarted with the engines serving at that moment; `run` holds the fleet by then.
        urls = [e.url for e in engines]

        def serving() -> list[str]:
            return run["fleet"].serving_urls() if "fleet" in run else urls

        router = None
        if resume and run_dir is not None:
            router = SupervisedRouter.adopt(run_dir, router_cfg, urls, cfg.health, workers=serving)
        if router is None:
            router = SupervisedRouter(router_cfg, urls, cfg.health, workers=serving, state_dir=run_dir)
    else:
        router = start_router_thread(router_cfg, [e.url for e in engines], cfg.health)
    stack.callback(router.stop)

    def bring_up(url: str) -> None:
        ctx = run["ctx"]
        if ctx.trainer_restoring:
            raise TrainerFailure("the trainer group is being restarted; the engine is brought up after it")
        ctx.trainer.push_full([url], ctx.policy_version)

    def reconnect(urls: list[str]) -> None:
        run["ctx"].trainer.reconnect_engines(urls)

    def on_change(urls: list[str]) -> None:
        run["ctx"].call(run["ctx"].rollout.set_engine_urls, urls)

    fleet = EngineFleet(cfg.health, start, router.url, router_token, bring_up=bring_up, reconnect=reconnect,
                        on_change=on_change)
    fleet.adopt(engines, standby)
    run["fleet"] = fleet
    unadopted.pop_all()
    stack.callback(fleet.close)
    return fleet, router


def node_pool(name: str, size: int, resource: str, key: str, cfg: RunConfig, stack: contextlib.ExitStack,
              gpus: float = 0.0, detached_as: str | None = None) -> NodePool:
    """The placement group of one pool on the nodes `resource` (config key `key`) names, `gpus` GPUs per
    process; removed when the run ends (`detached_as`: named so, it outlives a killed driver)."""
    try:
        pool = NodePool(name, size, resource, key, cfg.placement.timeout_s, gpus, detached_as=detached_as)
    except PlacementError as exc:
        raise SystemExit(f"miles: {exc}") from None
    stack.callback(pool.remove)
    return pool


def trainer_pool(cfg: RunConfig, stack: contextlib.ExitStack, gpus: float = 0.0) -> NodePool:
    return node_pool("trainer", cfg.trainer.num_ranks, cfg.placement.trainer_nodes, "placement.trainer_nodes",
                      cfg, stack, gpus)


def place_run_devices(cfg: RunConfig, engines: bool = True) -> tuple[RunConfig, GpuShares]:
    """`cfg` with trainer.device and rollout.engine.device made concrete for the cluster's GPUs (auto:
    cuda where it has any), and each process's GPU share; `engines`: whether the run starts engines."""
    import ray

    gpus = ray.cluster_resources().get("GPU", 0.0)
    n = 0
    if engines and not cfg.rollout.engine_urls:
        n = cfg.rollout.num_engines + (cfg.health.standby_engines if cfg.health.enabled else 0)
        n += cfg.teacher.num_engines if cfg.teacher.model.path and not cfg.teacher.engine_urls else 0
    trainer, engine, shares = place_devices(cfg.trainer.device, cfg.rollout.engine.device, gpus,
                                            cfg.trainer.num_ranks, n)
    trainer_cfg = dataclasses.replace(cfg.trainer, device=trainer)
    trainer_cfg.validate()
    rollout = dataclasses.replace(cfg.rollout, engine=dataclasses.replace(cfg.rollout.engine, device=engine))
    return dataclasses.replace(cfg, trainer=trainer_cfg, rollout=rollout), shares


def start_teachers(cfg: RunConfig, pools: CorePools | None, stack: contextlib.ExitStack,
                    gpus: float = 0.0) -> list[str]:
    """The teacher engines' URLs (none without a [teacher] section): started here from
    teacher.model.path, or teacher.engine_urls checked for the student's tokenizer. They join no
    fleet, router or weight transport, so no weight update ever reaches them."""
    import ray

    t = cfg.teacher
    if t.engine_urls:
        check_reachable(t.engine_urls, "teacher.engine_urls")
        with EngineClient() as client:  # no admin token: nothing may administer a teacher
            for url in t.engine_urls:
                check_served_teacher(client, url, cfg.model.path)
        return list(t.engine_urls)
    if not t.model.path:
        return []
    cls = remote(EngineShell)
    if cfg.rollout.engine.device == "cuda":
        cls = cls.options(num_gpus=gpus)
    # Their own admin token, never handed to anything: nothing may administer a teacher.
    actors = [cls.remote(cfg.rollout.engine.for_run(t.model.path, cfg.run.seed + 20_000 + i, secrets.token_hex(16)),
                         pools.engine if pools else None) for i in range(t.num_engines)]
    for a in actors:
        stack.callback(ray.kill, a)
    return ray.get([a.url.remote() for a in actors])


def continue_engines(urls: list[str], admin_token: str | None) -> None:
    """Engines that outlived a killed driver may have been paused by it (a weight push's pause, a commit
    round's hold) with nobody left to continue them: a resumed run continues each before it generates.
    Their weights are the dead driver's; the restored checkpoint's are pushed before any generation."""
    with EngineClient(admin_token=admin_token, timeout_s=30.0) as client:
        for url, answer in zip(urls, client.try_all(urls, routes.CONTINUE_GENERATION, {})):
            if isinstance(answer, BaseException):
                raise SystemExit(f"miles: engine {url} (rollout.engine_urls) could not be continued after the "
                                 f"previous driver: {answer}") from None


def check_reachable(urls: list[str], key: str = "rollout.engine_urls") -> None:
    """External engines must answer /health before the run starts (a typo'd URL fails here, clearly)."""
    with EngineClient(timeout_s=10.0) as client:
        for url in urls:
            try:
                client.get(url, routes.HEALTH)
            except EngineError as exc:
                raise SystemExit(f"miles: engine {url} ({key}) does not answer /health: {exc}") from None


@contextlib.contextmanager
def ray_for_run(cfg: RunConfig):
    """Ray for the run: joined or started here; a cluster started here is shut down on exit."""
    import ray

    started = not ray.is_initialized()
    ensure_ray(cfg.ray)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def run_admin_token(external: bool, run_dir: Path | None = None) -> str | None:
    """The admin token of a run: a fresh random one for the engines and the router the run starts, so
    their admin routes are never open, or, resuming, the one of the router an earlier driver of the run
    left serving (so that router can be adopted and speaks for the new engines); for engines started
    outside the run, their operator's (MILES_ENGINE_ADMIN_TOKEN), if any."""
    if external:
        return os.environ.get("MILES_ENGINE_ADMIN_TOKEN") or None
    previous = RouterRecord.load(run_dir / RECORD) if run_dir is not None else None
    return previous.admin_token if previous is not None and previous.admin_token else secrets.token_hex(16)


def on_driver_node() -> dict:
    """Ray options that keep an actor on the driver's node (where the router it talks to serves)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)}
