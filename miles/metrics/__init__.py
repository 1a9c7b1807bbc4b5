"""Metrics: step records with namespaced keys, sinks, and progress lines."""
