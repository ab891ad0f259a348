"""finetune: fully sharded (FSDP) fine-tuning of causal LMs through Hugging Face Accelerate."""

__version__ = "0.1.0"
