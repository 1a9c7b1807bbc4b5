"""The rollout side: engines, generate functions, rewards, and the manager that drives them.

    manager.py, group.py, producer.py, stats.py   the RolloutManager and the parts it composes
    config.py       RolloutConfig and the tables nested in it (engine, agent, harness, sandbox)
    generate.py     generate functions: contract, registry, single-turn generation
    agent/          multi-turn generate functions: environment episodes, black-box harnesses
    sessions/       the OpenAI-compatible session server harnesses talk to
    environments/   the environment contract, registry, built-ins and sandbox
    reward.py, teacher.py   the eval view of a reward; teacher engines for distillation
    engine/, router/        the built-in engine and router

Prompts and their sources are in miles/data. Non-goals: training, weight sync, orchestration.
"""
