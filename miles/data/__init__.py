"""Prompts: where every prompt of a run comes from, and how it becomes token ids. The built-in
seeded tasks, the user's own data (files and `datasets` loads, read in the layout of the framework
they came from: verl, slime, TRL), checked row by row before a run starts and drawn in seeded epochs
with a cursor that checkpoints resume from.

    prompts.py  TaskConfig (rollout.task), Prompt, PromptSource: numbered prompts in a seeded order
    tasks/      TASKS: the prompt-source registry and contract; the arithmetic task
    config.py   DataConfig: where the rows are and which fields hold prompt, label and metadata
    layouts.py  LAYOUTS: the field mappings of verl, slime and TRL datasets
    rows.py     a row as a checked Record (prompt text or messages, label, metadata); DataError
    loading.py  reading rows through the Hugging Face `datasets` library (files, globs, directories, hub cache)
    cursor.py   DataCursor: epoch, position and the per-epoch shuffle, as checkpointable state
    source.py   DatasetSource: the `dataset` prompt source (rollout.task.name = "dataset")
    chat.py     chat templates: a prompt rendered once, and ChatFormat for conversations that grow by ids
    preflight.py  the run's check of every prompt against the engine's context, before engines start

Tasks whose episodes need an environment live with it (rollout/environments/terminal.py) and register
their source in data/tasks. Non-goals: scoring (rewards/), streaming datasets larger than memory,
tokenizing ahead of time, loading models (the caller hands in the tokenizer).
"""
