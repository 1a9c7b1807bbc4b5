"""Checks across config sections: combinations of individually valid settings that cannot run.

Each section validates its own fields (`validate()` next to its dataclass); what joins two or more
sections lives here, in one place, and runs after them (RunConfig.validate). So do the load-time
checks of what the rollout section names but does not import (the generate function, the
environment): they load component code, which the sections' own configs stay free of. A check only
reads the config: it never fills in or changes a setting, so the saved config.json is exactly what
was asked for. Every refusal names the keys to change.
"""

from __future__ import annotations

from miles.config.loader import ConfigError
from miles.data.preflight import LabelBudget
from miles.models.loading import context_limit, read_model_config
from miles.models.vision import is_vision_language
from miles.registry import RegistryError
from miles.rollout.environments import check_environment
from miles.rollout.generate import get_generate_fn
from miles.sync.transports import TRANSPORTS
from miles.trainer.algorithms.base import get_algorithm
from miles.trainer.backends.megatron import FAMILIES as MEGATRON_FAMILIES
from miles.trainer.teacher import tokenizer_mismatch


def check_run(run) -> None:
    """Every cross-section check of a RunConfig (run.py imports this module, so it takes the config untyped)."""
    for check in (check_generate, check_schedule, check_group_size, check_context, check_sync, check_routing_replay,
                  check_fleet, check_teacher, check_vision, check_megatron_layout, check_packing):
        check(run)


def check_generate(run) -> None:
    """The generate function and the environment the rollout names: loaded and checked against their
    contracts now, not at the first episode (an environment is built once, with env_args and sandbox)."""
    rollout, agent = run.rollout, run.rollout.agent
    try:
        get_generate_fn(rollout.generate_fn)
    except ValueError as e:
        raise ConfigError(f"rollout.generate_fn: {e}") from None
    try:
        check_environment(agent.environment, agent.env_args, agent.sandbox)
    except ValueError as e:
        raise ConfigError(f"rollout.agent.environment: {e}") from None


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


def check_group_size(run) -> None:
    """A group-relative algorithm against groups of one sample, whose advantage is always 0."""
    name, n = run.trainer.algorithm.name, run.rollout.n_samples_per_prompt
    try:
        group_relative = get_algorithm(run.trainer.algorithm).group_relative
    except RegistryError:  # already refused by the algorithm's own validate, which runs first
        return
    if group_relative and n < 2:
        raise ConfigError(f"trainer.algorithm.name = {name!r} compares each sample with the others of its group, so "
                          f"rollout.n_samples_per_prompt = {n} gives every sample advantage 0 and nothing is "
                          "learned: set rollout.n_samples_per_prompt >= 2 (8 is usual), or use an algorithm "
                          "without a group baseline such as 'reinforce_pp' or 'ppo'")


def check_context(run) -> None:
    """Every response budget against the engine's context (rollout.engine.context_length, else the
    model's max_position_embeddings): a budget no prompt can fit would fail every request, after start."""
    model = read_model_config(run.model.path) if run.model.path else None
    model_limit = context_limit(model) if model else None
    own_engines = not run.rollout.engine_urls
    configured = run.rollout.engine.context_length if own_engines else None
    if configured and model_limit and configured > model_limit:
        raise ConfigError(f"rollout.engine.context_length = {configured} is beyond the model's "
                          f"max_position_embeddings ({model_limit}): positions past it were never trained; "
                          f"set rollout.engine.context_length <= {model_limit} or leave it unset")
    limit = configured or model_limit
    if not limit:
        return
    where = "rollout.engine.context_length" if configured else "the model's max_position_embeddings"
    # (The engines' default_max_new_tokens is left out: every request of a run sets its own budget.)
    budgets = [("rollout.max_new_tokens", run.rollout.max_new_tokens), ("eval.max_new_tokens", run.eval.max_new_tokens)]
    budgets += [(f"eval.sets[{i}].max_new_tokens", s.max_new_tokens) for i, s in enumerate(run.eval.sets)]
    for key, n in budgets:
        # A prompt takes at least one token of the context.
        if n >= limit:
            raise ConfigError(f"{key} = {n} leaves no room for a prompt in {where} ({limit} tokens): set "
                              f"{key} <= {limit - 1}, minus your longest prompt")


# A generated task's train prompts measured against rollout.max_new_tokens (its eval prompts: as many
# as eval draws): enough to meet its longest labels, cheap to tokenize.
_TRAIN_DRAWS = 1024


def label_budgets(run) -> list[LabelBudget]:
    """Each split's labels with the response budget they are generated under, for the preflight's
    label check (data/preflight.long_labels): train prompts under rollout.max_new_tokens, eval's under
    eval.max_new_tokens, each eval set's under its own. Only single-turn generation answers a prompt
    with one response that must hold the label; an agent's label is no response (a task name, a test),
    so other generate functions have none to check."""
    if run.rollout.generate_fn != "single_turn":
        return []
    task = run.rollout.task
    budgets = [LabelBudget(task, "train", "rollout.max_new_tokens", run.rollout.max_new_tokens,
                           "rollout.task.allow_long_labels", _TRAIN_DRAWS),
               LabelBudget(task, "eval", "eval.max_new_tokens", run.eval.max_new_tokens,
                           "rollout.task.allow_long_labels", run.eval.num_prompts)]
    for i, s in enumerate(run.eval.sets):
        allow = f"eval.sets[{i}].task.allow_long_labels" if s.task else "rollout.task.allow_long_labels"
        budgets.append(LabelBudget(s.task or task, s.split, f"eval.sets[{i}].max_new_tokens", s.max_new_tokens,
                                   allow, s.num_prompts))
    return budgets


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
    if getattr(run.sync, "backend", None) == "nccl":
        # Where a device is left to `auto`, the connect decides (broadcast_group.choose) and says why.
        on_cpu = [key for key, device in (("trainer.device", run.trainer.device),
                                          ("rollout.engine.device", run.rollout.engine.device)) if device == "cpu"]
        if run.rollout.engine_urls:
            on_cpu = [k for k in on_cpu if k != "rollout.engine.device"]  # external engines say at connect
        if on_cpu:
            raise ConfigError(f"sync.backend = 'nccl' moves GPU memory only, but {' and '.join(on_cpu)} = 'cpu': "
                              "set them to 'cuda' (or 'auto'), or sync.backend = 'gloo' (or 'auto')")


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

    from miles.models.moe import moe_shape, replay_refusal

    config = AutoConfig.from_pretrained(run.model.path)
    if moe_shape(config) is None:
        raise ConfigError(f"rollout.return_routed_experts / trainer.routing_replay need a mixture-of-experts model, "
                          f"but model.path {run.model.path!r} is a dense {config.model_type!r} model: set both to "
                          "false, or train an MoE checkpoint (e.g. `miles init-model --preset tiny-qwen3-moe`)")
    refusal = replay_refusal(config)
    if refusal is not None:
        raise ConfigError(refusal)
    run.router.check_features(return_routed_experts=True)


def check_fleet(run) -> None:
    """The engine fleet against the router and the injected faults."""
    if run.router.kind != "miles":
        raise ConfigError(f"router.kind = {run.router.kind!r}: `miles train` runs the built-in router, which the "
                          "health monitor drives to replace engines; set router.kind = 'miles' (the sglang "
                          "router is for `miles router`-style serving)")
    if run.fault.kill_router_at_steps and not run.router.own_process:
        raise ConfigError("fault.kill_router_at_steps needs router.own_process = true: otherwise the router is a "
                          "thread of the driver, and killing it is killing the driver")
    if run.fault.drop_response_prob and run.router.own_process:
        raise ConfigError("fault.drop_response_prob acts on a router in the driver's process: set "
                          "router.own_process = false, or drop_response_prob = 0")
    at, every = run.fault.kill_driver_at_step, run.loop.save_every
    if at and not (every and at % every == 0 and at < run.loop.num_steps):
        raise ConfigError(f"fault.kill_driver_at_step = {at} fires once that step's checkpoint is written, and with "
                          f"loop.save_every = {every} and loop.num_steps = {run.loop.num_steps} none is: pick a "
                          f"step below num_steps that save_every divides")
    if run.fault.corrupt_delta_at_steps and run.sync.transport != "disk_delta":
        raise ConfigError(f"fault.corrupt_delta_at_steps damages the disk delta of a push, and sync.transport = "
                          f"{run.sync.transport!r} writes none: set sync.transport = 'disk_delta', or drop the fault")
    engine_faults = (run.fault.kill_engine_every_s or run.fault.stall_engine_every_s
                     or run.fault.kill_engine_at_steps or run.fault.stall_engine_at_steps
                     or run.fault.stall_engine_at_commit)
    if engine_faults and run.rollout.engine_urls:
        raise ConfigError("fault.kill_engine_every_s / stall_engine_every_s / kill_engine_at_steps / "
                          "stall_engine_at_steps / stall_engine_at_commit act on engines "
                          "the run starts; with "
                          "rollout.engine_urls the engines are someone else's: unset one of the two")
    if run.health.standby_engines and run.rollout.engine_urls:
        raise ConfigError(f"health.standby_engines = {run.health.standby_engines}: standby engines are engines the run "
                          "starts, and with rollout.engine_urls it starts none (a dead one is routed around and "
                          "re-admitted when its operator restarts it): set health.standby_engines = 0")
    if engine_faults and not (run.health.enabled and run.health.restart):
        raise ConfigError("fault.kill_engine_every_s / stall_engine_every_s / kill_engine_at_steps / "
                          "stall_engine_at_steps / stall_engine_at_commit need "
                          "health.enabled = true and "
                          "health.restart = true, or nothing would replace the engines they break")


def check_teacher(run) -> None:
    """OPD has one teacher, in the trainer (opd.teacher_path) or on engines ([teacher]); it scores the
    policy's token ids, so its tokenizer must be the policy's."""
    opd = getattr(run.trainer.algorithm, "opd", None)
    served = run.teacher.enabled
    if opd is None:
        if served:
            raise ConfigError(f"teacher: teacher engines score for on-policy distillation only; set "
                              f"trainer.algorithm.name = 'opd' (it is {run.trainer.algorithm.name!r}) or remove "
                              "the [teacher] section")
        return
    if not opd.teacher_path and not served:
        raise ConfigError("trainer.algorithm.opd.teacher_path is required for name = 'opd' unless teacher engines "
                          "score: set trainer.algorithm.opd.teacher_path (a teacher inside the trainer), or "
                          "teacher.model.path (engines the run starts) or teacher.engine_urls (engines already "
                          "serving)")
    if opd.teacher_path and served:
        raise ConfigError("trainer.algorithm.opd.teacher_path and the [teacher] section both name a teacher: keep "
                          "one (teacher_path: inside the trainer; [teacher]: on engines of its own)")
    if served and run.rollout.temperature != 1.0:
        raise ConfigError(f"teacher engines score at temperature 1 (SGLang's input logprobs are untempered), but "
                          f"rollout.temperature = {run.rollout.temperature}: set rollout.temperature = 1.0, or "
                          "score inside the trainer with trainer.algorithm.opd.teacher_path")
    if run.teacher.model.path and run.model.path:
        why = tokenizer_mismatch(run.model.path, run.teacher.model.path)
        if why:
            raise ConfigError(f"teacher.model.path {run.teacher.model.path!r} has another tokenizer than model.path "
                              f"({why}); the teacher scores the student's token ids, so pick a teacher trained "
                              "with the student's tokenizer")
    if not opd.teacher_path or not run.model.path:
        return
    why = tokenizer_mismatch(run.model.path, opd.teacher_path)
    if why:
        raise ConfigError(f"trainer.algorithm.opd.teacher_path {opd.teacher_path!r} has another tokenizer than "
                          f"model.path ({why}); the teacher scores the student's token ids, so pick a teacher "
                          "trained with the student's tokenizer")


def check_vision(run) -> None:
    """What a vision-language policy is not served with, refused before anything starts: images reach
    the engine only through single-turn generation and agent episodes (harness episodes and other
    generate functions would drop them), and the critic is loaded as a text token classifier, which a
    vision-language checkpoint is not."""
    model = read_model_config(run.model.path) if run.model.path else None
    if not model or not is_vision_language(model):
        return
    if run.rollout.generate_fn not in ("single_turn", "agent"):
        raise ConfigError(f"rollout.generate_fn = {run.rollout.generate_fn!r} with the vision-language model at "
                          f"{run.model.path}: only single-turn generation and agent episodes carry images; set "
                          "rollout.generate_fn = \"single_turn\" or \"agent\", or train a text-only model")
    if get_algorithm(run.trainer.algorithm).needs_critic:
        raise ConfigError(f"trainer.algorithm.name = {run.trainer.algorithm.name!r} needs a critic, which a "
                          "vision-language policy does not have here: choose an algorithm without one "
                          "(grpo, dr_grpo, rloo, ...)")


def check_packing(run) -> None:
    """Packed sequences share one row of the batch; a layer that carries recurrent state along the row
    (linear attention, Mamba: Qwen3-Next, Qwen3.5, Nemotron-H) would carry one sequence's state into
    the next, so packing is refused for such models."""
    model = read_model_config(run.model.path) if run.model.path and run.trainer.pack_sequences is True else None
    if not model:
        return
    text = model.get("text_config") or model
    kinds = set(text.get("layer_types") or ()) | set(text.get("layers_block_type") or ())
    stateful = sorted(kinds & {"linear_attention", "mamba"})
    if stateful:
        raise ConfigError(f"trainer.pack_sequences = true with {text.get('model_type')!r} at {run.model.path}, whose "
                          f"{', '.join(stateful)} layers carry recurrent state along a packed row from one sequence "
                          "into the next: set trainer.pack_sequences = false")


def check_megatron_layout(run) -> None:
    """The Megatron backend's parallel sizes against the model they split: heads and query groups and
    the MLP over the TP ranks, the vocabulary over them too, layers over the pipeline's chunks,
    experts over the EP ranks; and the families it converts."""
    t = run.trainer
    model = read_model_config(run.model.path) if run.model.path else None
    if t.backend != "megatron" or not model:
        return
    if is_vision_language(model) or model.get("model_type") not in MEGATRON_FAMILIES:
        raise ConfigError(f"trainer.backend = 'megatron' trains {', '.join(MEGATRON_FAMILIES)} models; the model at "
                          f"{run.model.path} is {model.get('model_type')!r}: set trainer.backend = 'fsdp'")
    tp, pp, vpp = t.tensor_parallel_size, t.pipeline_parallel_size, t.virtual_pipeline_parallel_size
    splits = [("num_attention_heads", tp, "tensor_parallel_size"),
              ("num_key_value_heads", tp, "tensor_parallel_size"),
              ("vocab_size", tp, "tensor_parallel_size"),
              ("intermediate_size", tp, "tensor_parallel_size"),
              ("num_hidden_layers", pp * vpp, "pipeline_parallel_size × virtual_pipeline_parallel_size")]
    experts = model.get("num_experts") or model.get("num_local_experts") or 0
    if experts:
        splits += [("num_experts", t.expert_parallel_size, "expert_parallel_size"),
                   ("moe_intermediate_size", t.expert_tensor_parallel_size, "expert_tensor_parallel_size")]
        model = {**model, "num_experts": experts}
        if tp > 1 and not t.sequence_parallel:
            # megatron-core's MoELayer.forward refuses to train this (moe_layer.py, "performance may degrade").
            raise ConfigError(f"trainer.backend = 'megatron' trains a MoE model with trainer.tensor_parallel_size = "
                              f"{tp} only under sequence parallelism: set trainer.sequence_parallel = true")
        if tp > 1 and t.expert_parallel_size == 1 and t.expert_tensor_parallel_size != tp:
            # Whole experts on every TP rank without EP: the token dispatcher's output differs from the
            # model's (the same weights give another loss than at TP 1), so the layout is refused.
            raise ConfigError(f"trainer.backend = 'megatron' with a MoE model at trainer.tensor_parallel_size = {tp}, "
                              f"expert_parallel_size = 1 and expert_tensor_parallel_size = "
                              f"{t.expert_tensor_parallel_size} computes the wrong experts' outputs: set "
                              f"trainer.expert_parallel_size > 1, or expert_tensor_parallel_size = {tp}")
    elif t.expert_parallel_size > 1:
        raise ConfigError(f"trainer.expert_parallel_size = {t.expert_parallel_size} needs a MoE model; the model at "
                          f"{run.model.path} is dense: set it to 1")
    for key, size, knob in splits:
        if model.get(key) and model[key] % size:
            raise ConfigError(f"the model's {key} ({model[key]}) does not divide over trainer.{knob} ({size}): "
                              f"choose a size that divides {model[key]}")
