"""Rewards: the reward contract (contract.py), the built-in rewards (builtins.py), their settings
(config.py) and the runner that scores every generated sample in one place (runner.py)."""
