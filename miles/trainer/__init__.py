"""The trainer: policy losses, the FSDP2 backend, logprob forwards."""
