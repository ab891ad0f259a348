"""The lectures' CNN's config (finetune/models/cnn.py has the model), apart
from the model so that reading and writing model dirs (export) needs no model
code: AutoConfig knows `lecture-cnn` once this module is imported."""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

from finetune.presets import CNN_MODEL_TYPE


class LectureCNNConfig(PretrainedConfig):
    model_type = CNN_MODEL_TYPE

    def __init__(self, image_size: int = 28, num_channels: int = 1, conv_channels: tuple[int, int] = (8, 16),
                 kernel_sizes: tuple[int, int] = (3, 5), hidden_size: int = 64, num_labels: int = 10, **kwargs):
        self.image_size = image_size
        self.num_channels = num_channels
        self.conv_channels = list(conv_channels)
        self.kernel_sizes = list(kernel_sizes)
        self.hidden_size = hidden_size
        super().__init__(num_labels=num_labels, **kwargs)


AutoConfig.register(LectureCNNConfig.model_type, LectureCNNConfig, exist_ok=True)
