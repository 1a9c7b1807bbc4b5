"""`miles` command line.

Loading a run config is light (no torch, Ray or FastAPI), so it is imported here; each command's
own machinery (the driver, the engine server, model presets) imports torch or Ray and is imported
inside the command that runs it, so `--help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path

from miles.config import ConfigError, load_config, parse_overrides
from miles.run_config import RunConfig


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
    from miles.models.presets import PRESETS, build_tiny_model

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
    root = Path(__file__).resolve().parent.parent / "benchmarks"
    names = sorted(p.stem for p in root.glob("*.py") if not p.stem.startswith("_")) if root.is_dir() else []
    path = root / f"{args.name}.py"
    if not path.is_file():
        sys.exit(f"miles bench: unknown benchmark {args.name!r}; available: {', '.join(names) or 'none'}")
    # Benchmarks share pieces as `benchmarks.<name>` (the example's warm start, one RL run of it).
    if str(root.parent) not in sys.path:
        sys.path.insert(0, str(root.parent))
    spec = importlib.util.spec_from_file_location(f"miles_bench_{args.name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(extra) or 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="miles", description="RL post-training for language models.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("init-model", help="build a tiny HF model + locally trained tokenizer")
    s.add_argument("--preset", default="tiny-qwen3", help="model preset (tiny-qwen3, small-qwen3, tiny-qwen3-moe, tiny-deepseek-v3, "
                   "tiny-glm4-moe, tiny-minimax-m2, ...; docs/models.md)")
    s.add_argument("--out", required=True, help="output checkpoint directory")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--init-std", type=float, default=0.0,
                   help="redraw weight matrices from N(0, STD) for varied outputs (default: the model's own init)")
    s.set_defaults(fn=cmd_init_model)

    for name, fn, text in (("train", cmd_train, "run RL training from a TOML config"),
                           ("sft", cmd_sft, "supervised warm start from a TOML config")):
        s = sub.add_parser(name, help=text, description=f"{text}. Any setting can be overridden with "
                           "dotted keys, e.g. --rollout.n_samples_per_prompt 8 --loop.num_steps 10.")
        s.add_argument("config", nargs="?", help="TOML config file")
        if name == "train":
            s.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest checkpoint")
        s.set_defaults(fn=fn)

    s = sub.add_parser("eval", help="evaluate a checkpoint alone: eval/accuracy and every [[eval.sets]]",
                       description="Evaluate a Hugging Face checkpoint with a run config's [eval] section "
                       "(eval/accuracy and every [[eval.sets]]: pass@k, avg@k, maj@k, accuracy) on one built-in "
                       "engine; prints one JSON object. Overrides as for train, e.g. --model.path DIR.")
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
    s.add_argument("name", help="benchmark name, e.g. rollout, sync, train, async, r3, faults")
    s.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    return args.fn(args, extra)


if __name__ == "__main__":
    sys.exit(main())
