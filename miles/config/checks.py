"""Checks across config sections: combinations of individually valid settings that cannot run.

Each section validates its own fields (`validate()` next to its dataclass); what joins two or more
sections lives here, in one place, and runs after them (RunConfig.validate). A check only reads the
config: it never fills in or changes a setting, so the saved config.json is exactly what was asked
for. Every refusal names the keys to change.
"""

from __future__ import annotations

from miles.config.loader import ConfigError
from miles.sync.transports import TRANSPORTS


def check_run(run) -> None:
    """Every cross-section check of a RunConfig (run.py imports this module, so it takes the config untyped)."""
    for check in (check_schedule, check_sync, check_routing_replay, check_fleet):
        check(run)


def check_schedule(run) -> None:
    """The schedule against the placement, the staleness bound and the buffer's capacity."""
    schedule, mode = run.loop.schedule, run.placement.mode
    if schedule != "sync" and mode == "colocated":
        raise ConfigError(f"loop.schedule = {schedule!r} needs a disaggregated placement (colocated engines and "
                          "trainer take turns, so nothing could overlap): set placement.mode = 'disaggregated' "
                          "or loop.schedule = 'sync'")
    # How many policy versions a group can lag by construction: the weights it was generated under
    # are pushed every `update_weights_interval` steps, and one_step_off generates a step ahead.
    built_in = run.loop.update_weights_interval - 1 + (schedule == "one_step_off")
    if run.buffer.max_staleness < built_in:
        raise ConfigError(f"buffer.max_staleness = {run.buffer.max_staleness} would drop every group: with "
                          f"loop.schedule = {schedule!r} and loop.update_weights_interval = "
                          f"{run.loop.update_weights_interval} groups are {built_in} versions old by design; "
                          f"set buffer.max_staleness >= {built_in}")
    if schedule != "fully_async" and run.buffer.capacity < run.rollout.prompts_per_step:
        raise ConfigError(f"buffer.capacity = {run.buffer.capacity} cannot hold one step's "
                          f"{run.rollout.prompts_per_step} groups: set buffer.capacity >= rollout.prompts_per_step")
    if schedule == "fully_async" and run.buffer.capacity < 1:
        raise ConfigError("buffer.capacity must be >= 1")


def check_sync(run) -> None:
    """The weight transport against the placement, LoRA and prefill/decode disaggregation."""
    name = run.sync.transport
    transport = TRANSPORTS.get(name)
    if run.placement.mode == "colocated" and not transport.supports_colocation:
        raise ConfigError(f"sync.transport = {name!r} cannot run colocated (engines and trainer share the "
                          "machine, there is nothing to save on the wire): set sync.transport = 'colocated' or "
                          "placement.mode = 'disaggregated'")
    if run.trainer.lora.rank and not transport.supports_lora:
        raise ConfigError(f"sync.transport = {name!r} cannot ship LoRA runs (the delta is against full base "
                          "weights): set sync.transport = 'broadcast' or 'p2p', or trainer.lora.rank = 0")
    if run.rollout.pd_disaggregation and not transport.supports_pd_disaggregation:
        raise ConfigError(f"sync.transport = {name!r} cannot update prefill/decode-disaggregated engines: "
                          "set sync.transport = 'broadcast' or 'p2p', or turn off prefill/decode disaggregation")


def check_routing_replay(run) -> None:
    """R3: replay without recorded experts, recorded experts on a dense model, a router that strips them."""
    capture, replay = run.rollout.return_routed_experts, run.trainer.routing_replay
    if replay and not capture:
        raise ConfigError("trainer.routing_replay replays the experts the engines recorded: set "
                          "rollout.return_routed_experts = true as well")
    if not capture:
        return
    # Only when the run asks for experts: reading the model's config is the one way to know, and both
    # transformers and the MoE helpers (torch) would slow every other config load.
    from transformers import AutoConfig

    from miles.models.moe import moe_shape

    config = AutoConfig.from_pretrained(run.model.path)
    if moe_shape(config) is None:
        raise ConfigError(f"rollout.return_routed_experts / trainer.routing_replay need a mixture-of-experts model, "
                          f"but model.path {run.model.path!r} is a dense {config.model_type!r} model: set both to "
                          "false, or train an MoE checkpoint (e.g. `miles init-model --preset tiny-qwen3-moe`)")
    run.router.check_features(return_routed_experts=True)


def check_fleet(run) -> None:
    """The engine fleet against the router and the injected faults."""
    if run.router.kind != "miles":
        raise ConfigError(f"router.kind = {run.router.kind!r}: `miles train` runs the built-in router, which the "
                          "health monitor drives to replace engines; set router.kind = 'miles' (the sglang "
                          "router is for `miles router`-style serving)")
    engine_faults = run.fault.kill_engine_every_s or run.fault.stall_engine_every_s
    if engine_faults and run.rollout.engine_urls:
        raise ConfigError("fault.kill_engine_every_s / stall_engine_every_s act on engines the run starts; with "
                          "rollout.engine_urls the engines are someone else's: unset one of the two")
    if engine_faults and not (run.health.enabled and run.health.restart):
        raise ConfigError("fault.kill_engine_every_s / stall_engine_every_s need health.enabled = true and "
                          "health.restart = true, or nothing would replace the engines they break")
