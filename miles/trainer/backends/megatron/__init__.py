"""The Megatron-LM backend (backend.py) and what it is built from: the CPU adapter over megatron-core
(cpu_adapter.py), HF ↔ Megatron weight layouts (hf_layout.py) and vocabulary-parallel logprobs
(logprobs.py). Importing this package imports no torch: config checks read `FAMILIES` from here."""

FAMILIES = ("qwen3", "qwen3_moe", "llama", "qwen2")
"""Hugging Face model types whose weights hf_layout.py converts."""

REPLAY_ROUTERS = {"qwen3_moe": "Qwen3MoeTopKRouter"}
"""MoE model types whose routing Megatron's routers replay (R3), with the HF router class whose family
(models/routers.py) weighs the replayed experts."""
