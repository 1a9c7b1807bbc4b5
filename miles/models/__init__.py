"""Loading Hugging Face models and tokenizers, and building tiny ones locally."""
