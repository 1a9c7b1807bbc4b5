"""Environments for multi-turn rollouts: the Protocol and registry live in base.py."""
