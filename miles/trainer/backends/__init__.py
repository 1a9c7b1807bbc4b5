"""Trainer backends. fsdp: FSDP2 over a Hugging Face model (gloo on CPU, NCCL on GPU)."""
