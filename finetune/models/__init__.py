"""Models: GPT-2 and the lectures' CNN built from a config (the named shapes
are in finetune/presets.py), or any HF model by id or dir.

Nothing here knows about training, sharding, devices or tasks. Light at
import (the config reads models/attention.py's names): torch and transformers
are imported where a model is built or read.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from finetune.errors import UsageError, first_line

if TYPE_CHECKING:  # the model code (transformers' and the CNN's) is imported where a model is built
    import torch
    from transformers import GPT2Config, PretrainedConfig, PreTrainedModel

NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def gpt2_config(shape: dict, bos_token_id: int, eos_token_id: int) -> GPT2Config:
    from transformers import GPT2Config

    return GPT2Config(**shape, **NO_DROPOUT, bos_token_id=bos_token_id, eos_token_id=eos_token_id)


def build_gpt2(config: GPT2Config) -> PreTrainedModel:
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel(config)


def placeholder_model(config: PretrainedConfig, auto_class, dtype: torch.dtype,
                      trust_remote_code: bool) -> PreTrainedModel:
    """The architecture a config describes, for a process that will receive its
    weights from another: the buffers computed in `__init__` are real (rotary
    frequencies, masks: nobody sends those), the parameters are allocated but
    never written, so their pages take no RAM, and each has its own storage
    (Accelerate matches an optimizer's parameters to the sharded ones by address)."""
    import torch
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = auto_class.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    allocated: dict[int, torch.nn.Parameter] = {}  # by the meta parameter's id: tied weights stay one tensor
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in allocated:
                    allocated[id(param)] = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype),
                                                              requires_grad=param.requires_grad)
                module._parameters[name] = allocated[id(param)]
    model.tie_weights()  # init_empty_weights re-registers every parameter, which unties them
    return model


def upcast_trainable(model: torch.nn.Module, written: bool) -> None:
    """Trainable parameters in fp32, as Accelerate makes them before sharding
    under mixed precision (the fp32 master copy), done before `prepare` so that
    every rank builds the same layout. Where the parameters were never written
    (`placeholder_model`) they get new unwritten fp32 tensors: upcasting them
    would write a whole fp32 model on every rank."""
    import torch

    for param in model.parameters():  # tied parameters once
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.to(torch.float32) if written else torch.empty(param.shape, dtype=torch.float32)


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
    from finetune.models.cnn import LectureCNN, LectureCNNConfig

    return LectureCNN(LectureCNNConfig(**shape))


def check_model_files(model_dir: Path, what: str) -> None:
    """A local model dir's weight and tokenizer files, read as far as needed to
    know they are whole and of their kind, before transformers reads them (a
    truncated download, a pickle, a tokenizer.json of another structure would
    otherwise end in its traceback)."""
    import pickle

    import torch
    from safetensors import SafetensorError, safe_open

    from finetune.safetensors_index import missing_weight_files

    missing_weight_files(model_dir, what)  # (transformers joins what the index names to the dir, wherever it leads)
    safetensors = sorted(model_dir.glob("*.safetensors"))
    for file in safetensors:
        try:
            with safe_open(str(file), "pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise UsageError(f"{what}: {file} is not a whole safetensors file ({first_line(e)}); copy or download "
                             "it again") from None
    for file in [] if safetensors else sorted(model_dir.glob("pytorch_model*.bin")):
        try:
            torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError):
            raise UsageError(f"{what}: {file} is a pickle holding more than tensors, which finetune never unpickles; "
                             "convert the model to safetensors where it came from") from None
    if (tokenizer_file := model_dir / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # noqa: BLE001  (the Rust reader's errors have no common type)
            raise UsageError(f"{what}: {tokenizer_file} is not a tokenizer file ({first_line(e)[:120]}); save the "
                             "model's tokenizer with save_pretrained") from None


# A config's sizes, and the most any model has had (with room to spare): a
# larger or non-positive one is a damaged or crafted config.json, refused in
# one line before anything is built from it (hours of meta-device work, or
# an overflow deep in a library).
CONFIG_SIZES = {
    "num_hidden_layers": 4096, "n_layer": 4096, "hidden_size": 1 << 20, "n_embd": 1 << 20,
    "num_attention_heads": 1 << 16, "n_head": 1 << 16, "num_key_value_heads": 1 << 16,
    "intermediate_size": 1 << 22, "vocab_size": 1 << 24, "max_position_embeddings": 1 << 26,
    "n_positions": 1 << 26, "num_local_experts": 1 << 14, "num_experts": 1 << 14, "head_dim": 1 << 16,
}


def check_config_sizes(config: PretrainedConfig, where: str) -> None:
    """Each size a config states is a positive integer no larger than any model's."""
    for name, largest in CONFIG_SIZES.items():
        value = config.__dict__.get(name)
        if value is None:
            continue
        values = value if isinstance(value, (list, tuple)) and value else [value]  # per-layer sizes (OpenELM)
        if any(isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= largest for v in values):
            raise UsageError(f"the config of {where} has {name} {value!r}, which no model has (a positive integer "
                             f"up to {largest:,}); the config.json is damaged or crafted: fix it, or use the model's "
                             "own")


def load_config(name_or_path: str, trust_remote_code: bool, presets: str, option: str = "--model") -> PretrainedConfig:
    """The HF config of a Hub id or a local HF model dir, with errors that say
    what to do (`presets` names the presets to suggest instead, `option` the
    option that named it); a local dir's weight and tokenizer files are checked too."""
    path = Path(name_or_path)
    if path.exists() and not (path / "config.json").is_file():
        instead = f", a Hub id, or a preset ({presets})" if presets else " or a Hub id"
        raise UsageError(f"{option} {name_or_path} is not a model directory (no config.json); "
                         f"pass a dir written by save_pretrained{instead}")
    if path.is_dir():
        check_model_files(path, f"{option} {name_or_path}")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001  (a damaged config.json fails anywhere in its class: OSError, a field's type, ...)
        raise UsageError(f"could not load {option} {name_or_path} ({first_line(e)}); pass a local HF model dir, "
                         f"a reachable Hub id{f', or a preset ({presets})' if presets else ''}") from None
    check_config_sizes(config, f"{option} {name_or_path}")
    return config


def load_pretrained(name_or_path: str, auto_class, config: PretrainedConfig, trust_remote_code: bool,
                    presets: str, dtype: torch.dtype | None = None, option: str = "--model") -> PreTrainedModel:
    """`auto_class.from_pretrained` in `dtype` (float32 when None), with errors that say what to do."""
    import torch

    dtype = dtype or torch.float32
    try:
        return auto_class.from_pretrained(name_or_path, config=config, trust_remote_code=trust_remote_code,
                                          dtype=dtype)
    except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: weights that do not fit the config
        raise UsageError(f"could not load {option} {name_or_path} ({first_line(e)}); pass a local HF model dir, "
                         f"a reachable Hub id{f', or a preset ({presets})' if presets else ''}") from None
