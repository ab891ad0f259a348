"""Models: GPT-2 and the lectures' CNN built from a config (the named shapes
are in finetune/presets.py), or any HF model by id or dir.

Nothing here knows about training, sharding, devices or tasks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, GPT2Config, GPT2LMHeadModel, PretrainedConfig, PreTrainedModel

from finetune.errors import UsageError
from finetune.models.cnn import LectureCNN, LectureCNNConfig

NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def build_gpt2(shape: dict, bos_token_id: int, eos_token_id: int) -> PreTrainedModel:
    return GPT2LMHeadModel(GPT2Config(**shape, **NO_DROPOUT, bos_token_id=bos_token_id, eos_token_id=eos_token_id))


def fuse_activations(model: torch.nn.Module) -> int:
    """Swap transformers' tanh-approximated GELU written as element-wise ops
    (gelu_new, gelu_fast: GPT-2, Phi, GPT-J, ...) for the same function as one
    kernel (GELUTanh, `gelu_pytorch_tanh`). Each of those ops keeps its own
    [tokens, 4 x width] tensor for backward, about 1 GB for GPT-2 124M at
    4 x 512 tokens; the kernel keeps only its input. The results differ in the
    last bits only, and the config is untouched. Returns how many were swapped."""
    from transformers.activations import FastGELUActivation, GELUTanh, NewGELUActivation

    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) in (NewGELUActivation, FastGELUActivation):
                setattr(module, name, GELUTanh())
                swapped += 1
    return swapped


def build_cnn(shape: dict) -> PreTrainedModel:
    return LectureCNN(LectureCNNConfig(**shape))


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def load_config(name_or_path: str, trust_remote_code: bool, presets: str) -> PretrainedConfig:
    """The HF config of a Hub id or a local HF model dir, with errors that say
    what to do (`presets` names the presets to suggest instead)."""
    path = Path(name_or_path)
    if path.exists() and not (path / "config.json").is_file():
        raise UsageError(f"--model {name_or_path} is not a model directory (no config.json); "
                         f"pass a dir written by save_pretrained, a Hub id, or a preset ({presets})")
    try:
        return AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UsageError(f"could not load --model {name_or_path} ({_first_line(e)}); pass a local HF model dir, "
                         f"a reachable Hub id, or a preset ({presets})") from None


def load_pretrained(name_or_path: str, auto_class, config: PretrainedConfig, trust_remote_code: bool,
                    presets: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """`auto_class.from_pretrained` in `dtype`, with errors that say what to do."""
    try:
        return auto_class.from_pretrained(name_or_path, config=config, trust_remote_code=trust_remote_code,
                                          dtype=dtype)
    except (OSError, ValueError) as e:
        raise UsageError(f"could not load --model {name_or_path} ({_first_line(e)}); pass a local HF model dir, "
                         f"a reachable Hub id, or a preset ({presets})") from None
