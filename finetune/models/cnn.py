"""The lectures' two-branch CNN for 28x28 grayscale images, as a Hugging Face
model: `save_pretrained` / `from_pretrained` and the Auto classes work once
this module is imported.

Two convolutional stacks look at the same image with different kernel sizes;
each is followed by its own linear stack, the two branch outputs are summed,
and a final stack maps the sum to class scores. The lectures end that stack in
a softmax and apply cross-entropy to its output, which applies log-softmax a
second time; here `forward` returns logits (train on those with
cross-entropy) and the softmax lives only in `predict_proba`.

Nothing here knows about training, sharding or devices.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForImageClassification, PreTrainedModel
from transformers.modeling_outputs import ImageClassifierOutput

from finetune.models.cnn_config import LectureCNNConfig


def _cnn_stack(config: LectureCNNConfig, kernel_size: int) -> nn.Sequential:
    """Two conv -> ReLU -> 2x2 max-pool blocks; 28x28 becomes 7x7."""
    c1, c2 = config.conv_channels
    pad = kernel_size // 2
    return nn.Sequential(
        nn.Conv2d(config.num_channels, c1, kernel_size, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, kernel_size, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
    )


def _linear_stack(config: LectureCNNConfig) -> nn.Sequential:
    features = config.conv_channels[1] * (config.image_size // 4) ** 2
    # Flatten here, not at the end of the conv stack: an FSDP unit that returns a
    # view would lose its backward hook to any in-place op downstream.
    return nn.Sequential(nn.Flatten(), nn.Linear(features, config.hidden_size), nn.ReLU())


class LectureCNN(PreTrainedModel):
    config_class = LectureCNNConfig
    main_input_name = "pixel_values"
    base_model_prefix = "lecture_cnn"

    def __init__(self, config: LectureCNNConfig):
        super().__init__(config)
        k1, k2 = config.kernel_sizes
        self.cnn_stack1 = _cnn_stack(config, k1)
        self.linear_stack1 = _linear_stack(config)
        self.cnn_stack2 = _cnn_stack(config, k2)
        self.linear_stack2 = _linear_stack(config)
        # The lectures' "softmax stack", minus the softmax: it produces logits.
        self.softmax_stack = nn.Sequential(nn.Linear(config.hidden_size, config.num_labels))
        self.post_init()

    def get_input_embeddings(self) -> None:
        return None  # pixels go straight into the convolutions; there is no embedding table

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            module.reset_parameters()  # PyTorch's own (Kaiming-uniform) initialisation

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None, **kwargs) -> ImageClassifierOutput:
        """pixel_values: [batch, channels, image_size, image_size] in [0, 1]."""
        x1 = self.linear_stack1(self.cnn_stack1(pixel_values))
        x2 = self.linear_stack2(self.cnn_stack2(pixel_values))
        logits = self.softmax_stack(x1 + x2)
        loss = nn.functional.cross_entropy(logits.float(), labels) if labels is not None else None
        return ImageClassifierOutput(loss=loss, logits=logits)

    @torch.no_grad()
    def predict_proba(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.forward(pixel_values).logits.float().softmax(dim=-1)


AutoModelForImageClassification.register(LectureCNNConfig, LectureCNN, exist_ok=True)
