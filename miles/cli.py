"""`miles` command line.

Loading a run config is light (no torch, Ray or FastAPI), so it is imported here, and so are the
registries of every variant a run names (loading a config already loads them) and the model
presets' table: every list of choices in help is printed from the registry it names, so a variant
registered anywhere appears in help without this file changing. Each command's own machinery (the
driver, the engine server, building a preset) imports torch or Ray and is imported inside the
command that runs it, so `--help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import textwrap
from pathlib import Path

from miles.buffer.filters import FILTERS
from miles.config import ConfigError, load_config, parse_overrides
from miles.data.tasks import TASKS
from miles.eval.metrics import ANSWER_EXTRACTORS
from miles.models.presets import PRESETS
from miles.run_sections import SCHEDULES
from miles.registry import Registry
from miles.rewards.contract import REWARDS
from miles.rollout.environments import ENVIRONMENTS
from miles.rollout.generate import GENERATE_FNS
from miles.engine_api.tool_calls import TOOL_PARSERS
from miles.run_config import RunConfig
from miles.sync.convert import CONVERTERS
from miles.sync.transports import TRANSPORTS
from miles.trainer.algorithms import ALGORITHMS
from miles.trainer.backends.base import BACKENDS

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

# The run config's settings that choose a variant by name, each with the registry of its names.
NAMED_SETTINGS: dict[str, Registry] = {
    "trainer.algorithm.name": ALGORITHMS,
    "trainer.backend": BACKENDS,
    "sync.transport": TRANSPORTS,
    "sync.converter": CONVERTERS,
    "loop.schedule": SCHEDULES,
    "rollout.reward": REWARDS,
    "rollout.generate_fn": GENERATE_FNS,
    "rollout.task.name": TASKS,
    "rollout.agent.environment": ENVIRONMENTS,
    "rollout.agent.harness.tool_parser": TOOL_PARSERS,
    "buffer.filter": FILTERS,
    "eval.sets[].answer": ANSWER_EXTRACTORS,
}


def named_settings_help() -> str:
    """The epilog of train, sft and eval: each setting chosen by name and its registry's names."""
    lines = [f"  {key}: {', '.join(registry.names())}" for key, registry in NAMED_SETTINGS.items()]
    return "settings chosen by name (or given as module:attr):\n" + "\n".join(lines)


def benchmarks() -> list[str]:
    """The benchmarks `miles bench` runs: benchmarks/<name>.py at the repository root."""
    return sorted(p.stem for p in BENCHMARKS.glob("*.py") if not p.stem.startswith("_")) if BENCHMARKS.is_dir() else []


def _load(path: str | None, extra: list[str]):
    try:
        return load_config(RunConfig, path, parse_overrides(extra))
    except ConfigError as e:
        sys.exit(f"miles: config error: {e}")


def _without_config(config: str | None, extra: list[str]) -> tuple[str | None, list[str]]:
    """Without a TOML file argparse takes the first override's value as `config`: then (None, the
    overrides with that value put back after its key); otherwise (config, extra) unchanged."""
    gap = next((i for i, tok in enumerate(extra) if tok.startswith("--") and "=" not in tok
                and (i + 1 == len(extra) or extra[i + 1].startswith("--"))), None)
    if config is None or gap is None:
        return config, extra
    return None, extra[:gap + 1] + [config] + extra[gap + 1:]


def cmd_init_model(args, extra) -> int:
    from miles.models.presets import build_tiny_model  # torch and transformers: only when a model is built

    if extra:
        sys.exit(f"miles init-model: unexpected arguments {' '.join(extra)}")
    if args.preset not in PRESETS:
        sys.exit(f"miles init-model: unknown preset {args.preset!r}; choose one of {', '.join(sorted(PRESETS))}")
    out = build_tiny_model(args.preset, args.out, seed=args.seed, init_std=args.init_std)
    print(f"wrote {args.preset} to {out}")
    return 0


def cmd_train(args, extra) -> int:
    from miles.orchestration.driver import run_train

    if args.resume:
        saved = Path(args.resume) / "config.json"
        if not saved.is_file():
            sys.exit(f"miles train: --resume {args.resume}: no config.json there; pass a run directory "
                     "written by `miles train`")
        config, extra = _without_config(args.config, extra)
        if config:
            sys.exit("miles train: --resume reads the run's own config.json; pass overrides as --KEY VALUE, "
                     "not a TOML file")
        summary = run_train(_load(str(saved), extra), resume=args.resume)
    else:
        summary = run_train(_load(*_without_config(args.config, extra)))
    print(json.dumps(summary))
    return 0


def cmd_sft(args, extra) -> int:
    from miles.orchestration.driver import run_sft

    summary = run_sft(_load(*_without_config(args.config, extra)))
    print(json.dumps(summary))
    return 0


def cmd_eval(args, extra) -> int:
    from miles.run_eval import run_eval

    config, extra = _without_config(args.config, extra)
    metrics = run_eval(_load(config, extra), out=args.out, metrics_dir=args.metrics_dir, step=args.step)
    print(json.dumps(metrics))
    return 0


def cmd_serve(args, extra) -> int:
    from miles.engine.server import main as serve_main

    return serve_main(extra) or 0


def _delegate(module: str, attr: str = "main"):
    """A subcommand whose options are parsed by its own module (imported only when it runs)."""
    def run(args, extra) -> int:
        return getattr(importlib.import_module(module), attr)(extra) or 0
    return run


def cmd_bench(args, extra) -> int:
    """Benchmarks live in benchmarks/<name>.py at the repository root, each with main(argv)."""
    path = BENCHMARKS / f"{args.name}.py"
    if not path.is_file():
        sys.exit(f"miles bench: unknown benchmark {args.name!r}; available: {', '.join(benchmarks()) or 'none'}")
    # Benchmarks share pieces as `benchmarks.<name>` (the example's warm start, one RL run of it).
    if str(BENCHMARKS.parent) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS.parent))
    spec = importlib.util.spec_from_file_location(f"miles_bench_{args.name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(extra) or 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="miles", description="RL post-training for language models.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("init-model", help="build a tiny HF model + locally trained tokenizer")
    s.add_argument("--preset", default="tiny-qwen3", help=f"model preset: {', '.join(sorted(PRESETS))}")
    s.add_argument("--out", required=True, help="output checkpoint directory")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--init-std", type=float, default=0.0,
                   help="redraw weight matrices from N(0, STD) for varied outputs (default: the model's own init)")
    s.set_defaults(fn=cmd_init_model)

    for name, fn, text in (("train", cmd_train, "run RL training from a TOML config"),
                           ("sft", cmd_sft, "supervised warm start from a TOML config")):
        s = sub.add_parser(name, help=text, description=textwrap.fill(
                           f"{text}. Any setting can be overridden with dotted keys, e.g. "
                           "--rollout.n_samples_per_prompt 8 --loop.num_steps 10.", 100),
                           epilog=named_settings_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
        s.add_argument("config", nargs="?", help="TOML config file")
        if name == "train":
            s.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest checkpoint")
        s.set_defaults(fn=fn)

    s = sub.add_parser("eval", help="evaluate a checkpoint alone: eval/accuracy and every [[eval.sets]]",
                       description=textwrap.fill(
                           "Evaluate a Hugging Face checkpoint with a run config's [eval] section (eval/accuracy "
                           "and every [[eval.sets]]: pass@k, avg@k, maj@k, accuracy) on one built-in engine; "
                           "prints one JSON object. Overrides as for train, e.g. --model.path DIR.", 100),
                       epilog=named_settings_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("config", nargs="?", help="TOML config file")
    s.add_argument("--out", metavar="FILE", help="also write the metrics to FILE as one JSON object")
    s.add_argument("--metrics-dir", metavar="DIR", help="also append them to DIR/metrics.jsonl as step --step")
    s.add_argument("--step", type=int, default=0, help="the step recorded in metrics.jsonl (default 0)")
    s.set_defaults(fn=cmd_eval)

    s = sub.add_parser("serve", help="serve one built-in engine over the engine HTTP API",
                       add_help=False, description="Options: --model DIR --port P [--host H] [--dtype D] "
                       "[--admin-token T] [--max-batch-size N]")
    s.set_defaults(fn=cmd_serve)

    s = sub.add_parser("router", help="run the router in front of engines", add_help=False)
    s.set_defaults(fn=_delegate("miles.rollout.router"))
    s = sub.add_parser("sessions", help="OpenAI-compatible chat sessions that record exact tokens, in front "
                       "of a serving engine", add_help=False)
    s.set_defaults(fn=_delegate("miles.rollout.sessions.server"))
    s = sub.add_parser("simulate", help="project a run onto a fleet: step time, memory, weight sync per transport",
                       add_help=False)
    s.set_defaults(fn=_delegate("miles.capacity.simulate"))
    s = sub.add_parser("report", help="plots and a summary of one or two run directories", add_help=False)
    s.set_defaults(fn=_delegate("miles.metrics.report"))
    s = sub.add_parser("bench", help="run a benchmark (miles vs its baseline, one JSON line)")
    s.add_argument("name", help=f"benchmark: {', '.join(benchmarks())}")
    s.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    return args.fn(args, extra)


if __name__ == "__main__":
    sys.exit(main())
