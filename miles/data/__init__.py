"""Prompts from the user's own data: files and `datasets` loads, read in the layout of the framework
they came from (verl, slime, TRL), checked row by row before a run starts, drawn in seeded epochs
with a cursor that checkpoints resume from.

    config.py   DataConfig: where the rows are and which fields hold prompt, label and metadata
    layouts.py  LAYOUTS: the field mappings of verl, slime and TRL datasets
    rows.py     a row as a checked Record (prompt text or messages, label, metadata); DataError
    loading.py  reading rows through the Hugging Face `datasets` library (files, globs, directories, hub cache)
    cursor.py   DataCursor: epoch, position and the per-epoch shuffle, as checkpointable state
    source.py   DatasetSource: the `dataset` prompt source (rollout.task.name = "dataset")
    chat.py     chat templates: a prompt's messages rendered once by the tokenizer
    preflight.py  the run's check of every prompt against the engine's context, before engines start

Non-goals: scoring (rollout/reward.py), streaming datasets larger than memory, tokenizing ahead of time.
"""
