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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from finetune.errors import UsageError
from finetune.model_dir import MODEL_CONFIG_DIR, Weights, atomic_dir, weights_fingerprint
from finetune.parameters import base_model_name, canonical_name
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


# peft's task type for each task, and the heads it trains whole beside the adapters (a reward model's score).
PEFT_TASK_TYPES = {"causal-lm": ("CAUSAL_LM", None), "image-text-to-text": ("CAUSAL_LM", None),
                   "sequence-classification": ("SEQ_CLS", ["score", "classifier"])}


def lora_config(r: int, alpha: float, dropout: float, target_modules: str, task: str = "causal-lm"):
    """peft's LoraConfig for our options: `all-linear` (every linear layer but
    the output layer and the routers, and every fused expert parameter) or
    comma-separated names of modules or parameters; `add_adapters` resolves
    them against the model. A sequence classifier's head trains whole."""
    require_peft("lora")
    from peft import LoraConfig

    targets = target_modules if target_modules == "all-linear" else [n.strip() for n in target_modules.split(",") if n.strip()]
    task_type, whole = PEFT_TASK_TYPES[task]
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type=task_type,
                      modules_to_save=whole)


# What peft puts LoRA adapters on (and transformers' Conv1D, GPT-2's linear layer).
ADAPTABLE = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d)


def is_linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"


def _parameter_target(name: str) -> str:
    """peft's target for a parameter: its module's last two names and its own
    (`mlp.experts.gate_up_proj`), which every layer's copy ends with."""
    return ".".join(name.split(".")[-3:])


@dataclass
class Targets:
    """Where the adapters go in one model: linear layers by name (peft's
    target_modules) and parameters adapted in place (target_parameters: fused
    experts, routers), which peft adapts without dropout."""
    modules: list[str]
    parameters: list[str]
    frozen: list[str] = field(default_factory=list)  # linear layers that stay as loaded, whatever the names match

    def peft_config(self, config):
        """`config` with these targets; no dropout where parameters are adapted
        (peft refuses it there; `add_adapters` puts it back on the linear layers)."""
        from dataclasses import replace

        return replace(config, target_modules=self.modules, target_parameters=self.parameters,
                       exclude_modules=self.frozen or None, lora_dropout=0.0 if self.parameters else config.lora_dropout)


def resolve_targets(model: torch.nn.Module, config) -> Targets:
    """The modules and parameters `config.target_modules` names in `model`.
    A name that matches nothing, or a module that takes no adapter, is the user's to fix."""
    from finetune.models import moe

    routers = moe.routers(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    modules = dict(model.named_modules())
    whole = set(config.modules_to_save or ())  # trained whole: no adapters
    linear = {name: m for name, m in modules.items() if is_linear(m) and m is not head and name not in routers
              and name.rsplit(".", 1)[-1] not in whole}
    # A layer frozen before the adapters come (a vision tower kept as loaded) gets none.
    frozen = sorted(name for name, m in linear.items() if not any(p.requires_grad for p in m.parameters()))
    linear = {name: m for name, m in linear.items() if name not in frozen}
    fused = moe.fused_expert_parameters(model)
    if isinstance(config.target_modules, str):  # all-linear
        leaves = {name.rsplit(".", 1)[-1] for name in linear}
        # a leaf name that also names a layer left out (the head, a router) is given whole
        shared = {name.rsplit(".", 1)[-1] for name, m in modules.items() if name not in linear and name} & leaves
        names = sorted((leaves - shared) | {name for name in linear if name.rsplit(".", 1)[-1] in shared})
        return Targets(names, sorted({_parameter_target(name) for name in fused}), frozen)
    choices = ", ".join(sorted({name.rsplit(".", 1)[-1] for name in linear}
                               | ({moe.EXPERTS_MODULE} if fused else set())
                               | {name.rsplit(".", 1)[-1] for name in routers}))
    names, parameters = [], set()
    params = dict(model.named_parameters())
    for key in config.target_modules:
        def named(name):
            return name == key or name.endswith("." + key)
        matches = [name for name in modules if name and named(name)]
        matched_params = [name for name in params if named(name) and len(moe.full_shape(params[name])) >= 2]
        if not matches and not matched_params:
            raise UsageError(f"--lora_target_modules names {key}, which matches no module or parameter of the model; "
                             f"its adaptable layers are {choices} (or pass all-linear)")
        if matched_params and not matches:  # experts.gate_up_proj, gate_up_proj
            parameters |= {_parameter_target(name) for name in matched_params}
            continue
        for name in matches:
            module = modules[name]
            if name in routers:
                parameters.add(_parameter_target(f"{name}.weight"))
            elif name.rsplit(".", 1)[-1] == moe.EXPERTS_MODULE and any(n.startswith(name + ".") for n in fused):
                parameters |= {_parameter_target(n) for n in fused if n.startswith(name + ".")}
            elif not (isinstance(module, ADAPTABLE) or is_linear(module)):
                raise UsageError(f"--lora_target_modules names {key}, a {type(module).__name__}, which takes no LoRA "
                                 f"adapter; name linear layers, experts or routers ({choices}) or pass all-linear")
        if any(not (n in routers or n.rsplit(".", 1)[-1] == moe.EXPERTS_MODULE) for n in matches):
            names.append(key)
    return Targets(names, sorted(parameters), frozen)


def add_adapters(model: PreTrainedModel, config) -> PreTrainedModel:
    """The model with LoRA adapters on its target modules and parameters and
    every other parameter frozen. peft adapts a parameter in place, where it
    cannot apply dropout to the input: the linear layers get the dropout asked for, those get none."""
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer

    targets = resolve_targets(model, config)
    with quiet_peft():
        model = get_peft_model(model, targets.peft_config(config))
    if targets.parameters and config.lora_dropout:
        for layer in model.modules():
            if isinstance(layer, LoraLayer) and not hasattr(layer, "parameter_name") and ADAPTER_NAME in layer.lora_A:
                layer.lora_dropout[ADAPTER_NAME] = torch.nn.Dropout(config.lora_dropout)
    return model


def dropout_note(model: torch.nn.Module, dropout: float) -> str:
    """What the start line says when some adapters train without the dropout asked for."""
    config = model.peft_config[ADAPTER_NAME]
    if not (dropout and config.target_parameters):
        return ""
    adapted_in_place = ", ".join(sorted(config.target_parameters))  # sorted: peft may hold them as a set
    return (f"; no dropout on the adapters of {adapted_in_place} (peft adapts those parameters in place, where it "
            f"cannot apply dropout), {dropout} on the linear layers'")


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


def adapted_tensors(layers: dict[str, torch.nn.Module]) -> dict[str, str]:
    """The name of each base tensor an adapter changes -> the name of the LoRA
    layer that adapts it, among a PeftModel's modules by name. A linear layer's
    is `<layer>.base_layer.weight`; a parameter adapted in place (peft's
    ParamWrapper, one per parameter, nested where a module has several) sits
    in the module under the innermost wrapper."""
    from peft.tuners.lora import LoraLayer

    adapted = {}
    for name, layer in layers.items():
        if not isinstance(layer, LoraLayer) or ADAPTER_NAME not in layer.lora_A:
            continue
        inner, base = layer.base_layer, f"{name}.base_layer"
        while isinstance(inner, LoraLayer):
            inner, base = inner.base_layer, f"{base}.base_layer"
        adapted[f"{base}.{getattr(layer, 'parameter_name', 'weight')}"] = name
    return adapted


def merged_weights(live: dict[str, tuple[torch.Size, torch.dtype]], fetch, layers: dict[str, torch.nn.Module]):
    """The merged model's tensors, computed a few at a time as they are
    fetched, from a PeftModel's (`live`: shapes and dtypes under peft's names;
    `fetch(names)` returns those tensors whole; `layers`: its modules by name):
    a target's base tensor plus its adapter's delta, as peft's
    `merge_and_unload` adds it; every other tensor as it is."""
    adapted = adapted_tensors(layers)
    sources: dict[str, list[str]] = {}  # the merged model's name -> the live tensors it is made of
    for name in live:
        if ".lora_" in name or ".original_module." in name:  # a head trained whole: its trained copy is kept
            continue
        merged_name = base_model_name(name.replace(f".modules_to_save.{ADAPTER_NAME}.", "."))
        sources[merged_name] = [name]
        if layer := adapted.get(name):
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
            merged += _delta_weight(layers[adapted[base]], *(got[a] for a in adapter)).to(merged.dtype)
            out[name] = merged
        return out
    return Weights({name: live[names[0]] for name, names in sources.items()}, fetch_merged)


def _delta_weight(layer, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    """peft's `get_delta_weight` for whole adapter tensors (the layer's may be
    shards): `B @ A` for a linear layer; for fused experts ([experts, ., .]), each
    expert's rank-r block of A and B, laid out as the parameter is."""
    from peft.utils.other import transpose

    cast_to_fp32 = lora_b.device.type == "cpu" and lora_b.dtype in (torch.float16, torch.bfloat16)
    a, b = (lora_a.float(), lora_b.float()) if cast_to_fp32 else (lora_a, lora_b)
    experts = getattr(layer, "num_experts", 1)
    if experts == 1:
        delta = transpose(b @ a, layer.fan_in_fan_out) * layer.scaling[ADAPTER_NAME]
    else:
        a = a.reshape(experts, -1, a.shape[-1])  # experts x rank x in
        b = b.reshape(b.shape[0], -1, experts)   # out x rank x experts
        layout = "e o i" if layer._did_swap_in_out_features else "e i o"
        delta = torch.einsum(f"o r e, e r i -> {layout}", b, a) * layer.scaling[ADAPTER_NAME]
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
    dropout_note = ""

    def check_supported_here(self) -> None:
        require_peft(self.name)

    def config(self):
        cfg = self.cfg
        return lora_config(cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules, cfg.task)

    def adapt_base(self, model: PreTrainedModel) -> PreTrainedModel:
        """The base as the adapters go onto it."""
        return model

    def wrap(self, model: PreTrainedModel, source: str, accelerator: Accelerator, record_base: bool) -> PreTrainedModel:
        if record_base:  # the base as loaded, before anything changes it
            self.base_record = base_record(source, model)
        model = add_adapters(self.adapt_base(model), self.config())
        self.dropout_note = dropout_note(model, self.cfg.lora_dropout)
        return model

    def trainable_note(self, trainable: int) -> str:
        return f", of which {trainable:,} trainable ({self.name} adapters on a frozen base{self.dropout_note})"

    def adapters_off(self, model: torch.nn.Module):
        """The base's forward, the adapters kept."""
        return adapters_disabled(model)

    def added_by_peft(self, name: str) -> bool:
        return ".lora_" in name or name.startswith("lora_") or f".modules_to_save.{ADAPTER_NAME}." in name

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
