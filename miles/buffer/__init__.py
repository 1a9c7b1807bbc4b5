"""Samples, groups and the data buffer between rollout and training."""
