"""Helpers shared by tests (importable as `tests.helpers.<module>`), never tests themselves."""
