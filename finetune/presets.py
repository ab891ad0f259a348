"""Named models built from scratch, by the shape of their config. Pure data:
the command line reads it without importing torch; finetune/models builds
them and finetune/tasks says which task each serves.
"""

# GPT-2 shapes (GPT2Config keyword arguments). Dropout is off, as in nanoGPT's
# from-scratch runs, so that the same seed gives the same losses on any number
# of processes.
GPT2_PRESETS: dict[str, dict] = {
    "tiny-gpt2": dict(n_layer=2, n_head=4, n_embd=64, n_positions=256, vocab_size=2048),
    "small-gpt2": dict(n_layer=4, n_head=4, n_embd=128, n_positions=256, vocab_size=4096),
    "gpt2-small": dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=50257),
}

# The lectures' CNN (LectureCNNConfig keyword arguments).
CNN_PRESETS: dict[str, dict] = {"lecture-cnn": {}}
CNN_MODEL_TYPE = "lecture-cnn"  # finetune.models.cnn_config.LectureCNNConfig.model_type
