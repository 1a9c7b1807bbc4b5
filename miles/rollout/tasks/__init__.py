"""Built-in prompt sources: seeded task generators with verifiable answers."""
