"""Live SGLang servers as the engines of a run: how miles launches one (server.py, with SGLang's own
python and its flags, config.py), the child that runs it (launcher/), and the stand-in for SGLang's
kernel package on the CPU (cpu_standin/). A run names it with `rollout.engine.kind = "sglang"`; the
orchestrator wraps each server in a Ray actor (orchestration/actors.py) behind the run's router and
fleet, like a built-in engine. Weights reach it over SGLang's own routes (sync/updater.py's plain path).

Non-goals: installing SGLang (scripts/install-sglang.sh), speaking its protocol (engine_api/).
"""
