"""`--peft lora`: low-rank adapters through peft on a frozen base. The loop
sees a model whose base parameters are frozen (requires_grad False) and whose
adapters are not; checkpoints store only the adapters, with the base's
fingerprint; the final model and `finetune export` merge them into the base
(`merged_weights`, the one merge), or export them as an adapter dir that
`PeftModel.from_pretrained` loads.
"""

from __future__ import annotations

import json
import logging
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from finetune.errors import UsageError
from finetune.model_dir import MODEL_CONFIG_DIR, Weights, atomic_dir, weights_fingerprint
from finetune.parameters import canonical_name
from finetune.peft.base import FullFineTune

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PreTrainedModel

# peft imports torchao wherever it is installed (the qlora extra). Without CUDA, torchao logs each of its
# CUDA kernels failing to load and torch warns about enums it registers; neither concerns NF4, plain torch code.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_RECORD = "peft_base.json"  # in a checkpoint's model_config/: which base the adapters belong to
ADAPTER_NAME = "default"        # peft's name for the one adapter; its saved files leave it out of the keys


@contextmanager
def quiet_peft():
    """peft's notes that are not the user's business: it sets fan_in_fan_out for
    GPT-2's Conv1D layers itself, and calls a transformers API deprecated in v5."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        yield


def require_peft(method: str) -> None:
    try:
        import peft  # noqa: F401
    except ImportError:
        install = "pip install 'finetune[qlora]'" if method == "qlora" else "pip install 'peft>=0.13'"
        raise UsageError(f"--peft {method} needs the peft package, which finetune depends on and this environment "
                         f"lacks: {install}") from None


def lora_config(r: int, alpha: float, dropout: float, target_modules: str):
    """peft's LoraConfig for our options: `all-linear` (every linear layer but
    the output layer, peft's shorthand) or comma-separated module names."""
    require_peft("lora")
    from peft import LoraConfig

    targets = target_modules if target_modules == "all-linear" else [n.strip() for n in target_modules.split(",") if n.strip()]
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM")


# What peft puts LoRA adapters on (and transformers' Conv1D, GPT-2's linear layer).
ADAPTABLE = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d)


def add_adapters(model: PreTrainedModel, config) -> PreTrainedModel:
    """The model with LoRA adapters on its target modules and every other
    parameter frozen; a target that matches nothing is the user's to fix."""
    from peft import get_peft_model

    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"})
    if not isinstance(config.target_modules, str):  # peft only refuses a list none of whose names match
        for key in sorted(config.target_modules):
            matches = [m for name, m in model.named_modules() if name == key or name.endswith("." + key)]
            if not matches:
                raise UsageError(f"--lora_target_modules names {key}, which matches no module of the model; its "
                                 f"linear layers are {', '.join(linear)} (or pass all-linear)")
            other = next((m for m in matches if not isinstance(m, ADAPTABLE) and type(m).__name__ != "Conv1D"), None)
            if other is not None:
                raise UsageError(f"--lora_target_modules names {key}, a {type(other).__name__}, which takes no LoRA "
                                 f"adapter; name linear layers ({', '.join(linear)}) or pass all-linear")
    with quiet_peft():
        return get_peft_model(model, config)


def adapted_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The base layer of each module peft put adapters on, by the module's name."""
    from peft.tuners.lora import LoraLayer

    return {name: module.get_base_layer() for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def saved_name(live_name: str) -> str:
    """An adapter tensor's key in peft's saved files (peft drops the adapter's name)."""
    return live_name.replace(f".{ADAPTER_NAME}.", ".")


def write_adapter(adapter: dict[str, torch.Tensor], config, out_dir: Path, base_model: str) -> None:
    """adapter_config.json + adapter_model.safetensors, as `PeftModel.save_pretrained` writes them."""
    from safetensors.torch import save_file

    config = type(config).from_pretrained(config) if isinstance(config, (str, Path)) else config
    config.base_model_name_or_path = base_model
    config.save_pretrained(str(out_dir))
    save_file({saved_name(name): t.contiguous() for name, t in adapter.items()}, str(out_dir / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})


def merged_weights(live: dict[str, tuple[torch.Size, torch.dtype]], fetch, layers: dict[str, torch.nn.Module]):
    """The merged model's tensors, computed a few at a time as they are
    fetched, from a PeftModel's (`live`: shapes and dtypes under peft's names;
    `fetch(names)` returns those tensors whole; `layers`: its modules by name):
    a target's base weight plus its adapter's delta, as peft's
    `merge_and_unload` adds it; every other tensor as it is."""
    prefix = "base_model.model."
    sources: dict[str, list[str]] = {}  # the merged model's name -> the live tensors it is made of
    for name in live:
        if ".lora_" in name:
            continue
        merged_name = name.removeprefix(prefix).replace(".base_layer.", ".")
        sources[merged_name] = [name]
        layer = name.removesuffix(".base_layer.weight")
        if layer != name and ADAPTER_NAME in getattr(layers.get(layer), "lora_A", {}):
            sources[merged_name] += [f"{layer}.lora_A.{ADAPTER_NAME}.weight", f"{layer}.lora_B.{ADAPTER_NAME}.weight"]

    def fetch_merged(names: list[str]) -> dict[str, torch.Tensor]:
        got = fetch([source for name in names for source in sources[name]])
        out = {}
        for name in names:
            base, *adapter = sources[name]
            if not adapter:
                out[name] = got[base]
                continue
            merged = got[base].clone()  # fetch may hand out the live tensor itself (one process)
            merged += _delta_weight(layers[base.removesuffix(".base_layer.weight")], *(got[a] for a in adapter))
            out[name] = merged
        return out
    return Weights({name: live[names[0]] for name, names in sources.items()}, fetch_merged)


def _delta_weight(layer, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    """peft's `Linear.get_delta_weight` for whole adapter tensors (the layer's may be shards)."""
    from peft.utils.other import transpose

    cast_to_fp32 = lora_b.device.type == "cpu" and lora_b.dtype in (torch.float16, torch.bfloat16)
    a, b = (lora_a.float(), lora_b.float()) if cast_to_fp32 else (lora_a, lora_b)
    delta = transpose(b @ a, layer.fan_in_fan_out) * layer.scaling[ADAPTER_NAME]
    return delta.to(lora_b.dtype) if cast_to_fp32 else delta


# --- which base the adapters belong to -------------------------------------------------------------

def base_shapes(model: PreTrainedModel) -> dict[str, list[int]]:
    return {name: list(p.shape) for name, p in model.named_parameters()}


def base_record(source: str, model: PreTrainedModel) -> dict:
    """What a LoRA checkpoint keeps of its base (BASE_RECORD): where it came from, its shapes and fingerprint."""
    return {"model": source, "shapes": base_shapes(model), "fingerprint": weights_fingerprint(source, model)}


def check_same_base(recorded: dict, current: dict, where: Path) -> None:
    """Adapters only mean something on the base they were trained on: the
    `base_record` of this run's base against the one `where` holds."""
    theirs, ours = recorded.get("shapes") or {}, current["shapes"]
    if theirs != ours:
        diff = next((n for n in {**theirs, **ours} if theirs.get(n) != ours.get(n)), "?")
        raise UsageError(f"--model {current['model']} is not the base the adapters in {where} were trained on ({diff} "
                         f"is {theirs.get(diff)} there and {ours.get(diff)} here); pass the run's base, "
                         f"{recorded.get('model')}")
    if recorded.get("fingerprint") != current["fingerprint"]:
        raise UsageError(f"the weights of --model {current['model']} are not those the adapters in {where} were "
                         f"trained on (same shapes, other files); pass the run's base, {recorded.get('model')}, as "
                         "it was")


def read_base_record(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        raise UsageError(f"{path} is missing or damaged; it says which base model the adapters belong to: resume or "
                         "export from another checkpoint") from None
    return record if isinstance(record, dict) else {}


def merged_into(base: PreTrainedModel, adapters: dict[str, torch.Tensor], config) -> Weights:
    """`base` with the adapters (peft's names) merged in by `merged_weights`,
    a tensor at a time: the base's own weights, not a 4-bit copy of them."""
    from peft import get_peft_model

    with quiet_peft():
        peft_model = get_peft_model(base, config)
    missing, unexpected = peft_model.load_state_dict(adapters, strict=False)
    absent = [name for name in missing if ".lora_" in name]
    if unexpected or absent:
        raise UsageError(f"the adapters do not fit the base model ({(unexpected or absent)[0]} does not match); merge "
                         "with the base the run was trained from (--model)")
    tensors = peft_model.state_dict()
    layers = dict(peft_model.named_modules())
    return merged_weights({name: (t.shape, t.dtype) for name, t in tensors.items()},
                          lambda names: {name: tensors[name] for name in names}, layers)


@contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Each adapted layer computes as its base, the adapters' requires_grad
    untouched. peft's own switch (`disable_adapter`) also turns requires_grad
    off, and FSDP2 under mixed precision fixes a parameter's gradient dtype at
    its first forward: a first forward with the adapters off
    (--precompute_reference) had the first backward refuse their bf16 gradients."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    before = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, disabled in zip(layers, before):
            layer._disable_adapters = disabled


class LoRA(FullFineTune):
    """Adapters on a frozen base, whose origin the checkpoints record."""
    name = "lora"
    extra = "lora"
    saves_adapters = True

    def check_supported_here(self) -> None:
        require_peft(self.name)

    def config(self):
        cfg = self.cfg
        return lora_config(cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)

    def adapt_base(self, model: PreTrainedModel) -> PreTrainedModel:
        """The base as the adapters go onto it."""
        return model

    def wrap(self, model: PreTrainedModel, source: str, accelerator: Accelerator, record_base: bool) -> PreTrainedModel:
        if record_base:  # the base as loaded, before anything changes it
            self.base_record = base_record(source, model)
        return add_adapters(self.adapt_base(model), self.config())

    def trainable_note(self, trainable: int) -> str:
        return f", of which {trainable:,} trainable ({self.name} adapters on a frozen base)"

    def adapters_off(self, model: torch.nn.Module):
        """The base's forward, the adapters kept."""
        return adapters_disabled(model)

    def added_by_method(self, name: str) -> bool:
        return ".lora_" in name or name.startswith("lora_")

    # --- checkpoints ----------------------------------------------------------------------------

    def write_checkpoint_files(self, model_files: Path, model: torch.nn.Module, tied: dict[str, str]) -> None:
        """The adapters' peft config and which base they belong to (an export
        builds that base, which knows its own ties)."""
        model.peft_config[ADAPTER_NAME].save_pretrained(str(model_files))
        (model_files / BASE_RECORD).write_text(json.dumps(self.base_record))

    def check_checkpoint(self, model_files: Path, checkpoint_dir: Path) -> None:
        check_same_base(read_base_record(model_files / BASE_RECORD), self.base_record, checkpoint_dir)

    def check_base_before_launch(self, task, model_files: Path, checkpoint_dir: Path) -> None:
        """A local base: its shapes (built on the meta device) and its files;
        a Hub id or a preset is checked once loaded."""
        from finetune.models import load_config
        from finetune.models.gguf import is_gguf

        source = task.model_source
        if not Path(source).exists() or is_gguf(source):
            return
        config = load_config(source, task.cfg.trust_remote_code, ", ".join(task.entry.presets))
        with torch.device("meta"):
            base = task.entry.auto().from_config(config, trust_remote_code=task.cfg.trust_remote_code)
        check_same_base(read_base_record(model_files / BASE_RECORD), base_record(source, base), checkpoint_dir)

    # --- the final model and the export ---------------------------------------------------------

    def final_weights(self, specs: dict[str, tuple[torch.Size, torch.dtype]], fetch: Callable,
                      model: torch.nn.Module, base: Callable[[], PreTrainedModel]) -> Weights:
        """Each adapted weight plus its adapter's delta, as `merge_and_unload` adds it."""
        return merged_weights(specs, fetch, {canonical_name(name): module for name, module in model.named_modules()})

    @staticmethod
    def wrote(model_files: Path) -> bool:
        return (model_files / ADAPTER_CONFIG).is_file()

    def export_weights(self, checkpoint_dir: Path, weights: Weights, base: Callable[[], PreTrainedModel],
                       base_source: str) -> Weights:
        """The run's base (or --model), checked against the one the adapters
        were trained on, with the adapters merged in. The base is held whole in
        memory once."""
        from peft import LoraConfig

        model_files = checkpoint_dir / MODEL_CONFIG_DIR
        recorded = read_base_record(model_files / BASE_RECORD)
        model = base()
        check_same_base(recorded, base_record(base_source, model), checkpoint_dir)
        return merged_into(model, weights.fetch(list(weights.specs)), LoraConfig.from_pretrained(str(model_files)))

    def export_adapter(self, checkpoint_dir: Path, weights: Weights, output: Path) -> Path:
        """adapter_config.json + adapter_model.safetensors, which `PeftModel.from_pretrained(base, output)` loads."""
        from peft import LoraConfig

        model_files = checkpoint_dir / MODEL_CONFIG_DIR
        config = LoraConfig.from_pretrained(str(model_files))
        recorded = read_base_record(model_files / BASE_RECORD)
        with atomic_dir(output) as tmp:
            write_adapter(weights.fetch(list(weights.specs)), config, tmp, base_model=recorded.get("model", ""))
        return output

    # --- the planner ----------------------------------------------------------------------------

    def plan_model(self, model: torch.nn.Module, num_processes: int) -> tuple[torch.nn.Module, int]:
        return add_adapters(self.adapt_base(model), self.config()), 0
