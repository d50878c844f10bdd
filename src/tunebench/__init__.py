"""tunebench: fine-tune and benchmark small causal language models on the hardware you have."""

__version__ = "0.1.0"
