"""Per-device memory before launching: what parameters, gradients, AdamW state,
gathered FSDP units and activations will take under each strategy.

Persistent state with AdamW and fp32 master weights is 16 bytes per parameter
(4 weights + 4 gradients + 8 moments); with adapters, the frozen base has only its
4 bytes of weights (about half a byte where held in 4 bits), and the adapters the whole 16. DDP keeps all of it on every device;
FSDP keeps 1/N of it and, while a unit computes, a gathered copy of that unit in
the compute dtype (two units with prefetch). SHARD_GRAD_OP keeps every unit
gathered from forward to backward. Offload moves the persistent state to CPU
memory. Activations follow the usual transformer estimate (Korthikanti et al.
2022, with memory-efficient attention): about 34 * hidden bytes per token and
layer in 16-bit, doubled in fp32, plus the logits (or, with the chunked loss, one
chunk of them and the gradients it keeps).

A CPU run's peak resident set per rank adds what a process holds beyond those
tensors, calibrated against measured runs (tests/e2e/test_memory_planner.py):

    runtime      the interpreter and the libraries after import (a constant)
    heap churn   tensors below glibc's mmap threshold (parameters, their
                 gradients and the optimizer's temporaries) are recycled
                 through the heap, which keeps its high-water mark; larger
                 tensors are mapped and unmapped, and cost nothing once freed
    load         what a rank holds while the weights arrive (host_ram below)

    peak RSS = runtime + max(load, tensors + heap churn)

Host RAM at load and at the final save (`host_ram`), per rank above the runtime:
    load         under fsdp_cpu_ram_efficient_loading, each rank reads only its
                 shard of a safetensors dir; a preset or Hub id is loaded by the
                 main process, which sends each rank its shard (one tensor in
                 flight); without the flag every rank loads the whole model
    final save   the main process holds one output file (--max_shard_size) and
                 the tensor being gathered; the others the gathered tensor
                 (twice: all-gather output and its padded buffer); an adapter
                 run's merge adds a merged copy of the tensor

Host RAM for the training data (`data_ram_line`): a stream holds what its
reader has parsed of the current file and a chunk of examples, whatever the
corpus's size, and each encoding worker its own tokenizer; map-style data is
the whole tokenized dataset, memory-mapped from datasets' cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import yaml
from transformers import AutoConfig, GPT2Config

from finetune.backends import REGISTRY as BACKENDS, for_launch_config
from finetune.backends.base import PlanInputs
from finetune.backends.mesh import config_sizes
from finetune.errors import UsageError
from finetune.estimates import (GIB, RUNTIME_BYTES, Estimate, ModelShape, activation_bytes, cpu_peak_rss,
                                frozen_bytes, fsdp_traffic, mesh_name)
from finetune.host_memory import MMAP_THRESHOLD_BYTES
from finetune.models import check_config_sizes, moe
from finetune.models.gguf import converted_dir, is_gguf
from finetune.models.vision import VISION_TOWERS, part_named
from finetune.presets import GPT2_PRESETS
from finetune.shard_loading import OwnShards
from finetune.tasks import REGISTRY, task_for_config, task_of_preset

class ShapesThePlan(Protocol):
    """The PEFT method, as the planner sees it: the model it trains and the weights it holds in 4 bits."""
    four_bit_bytes_per_weight: float

    def plan_model(self, model: torch.nn.Module, num_processes: int) -> tuple[torch.nn.Module, int]: ...


def model_shape(name_or_path: str, peft: ShapesThePlan | None = None, num_processes: int = 1,
                task: str = "causal-lm", images_per_sample: int = 1, max_pixels: int = 0,
                freeze_vision_tower: bool = True) -> ModelShape:
    """Counts parameters on the meta device: nothing is allocated or downloaded
    but the config. The activation model is a transformer's, so only causal LMs
    are estimated. The PEFT method (`peft`) shapes the model as it would train
    it (adapters added and trainable, the base frozen, some of it in 4 bits
    over `num_processes`). `task`: the head the objective trains on that
    language model: a reward model's is a score (`sequence-classification`),
    one output a token where a causal LM has the vocabulary. A vision-language
    model adds its tower: `images_per_sample` images a row, each of its fixed
    size or (a family that sizes images by pixel count) of `max_pixels`,
    through a tower that trains unless `freeze_vision_tower`."""
    causal_lm, vision = REGISTRY["causal-lm"], REGISTRY["image-text-to-text"]
    found = causal_lm
    if name_or_path in GPT2_PRESETS:
        config = GPT2Config(**GPT2_PRESETS[name_or_path])
    elif (preset_task := task_of_preset(name_or_path)) is not None:
        raise UsageError(f"estimate-memory models transformer causal LMs, and --model {name_or_path} is an "
                         f"{preset_task.name} model; pass a causal LM ({', '.join(causal_lm.presets)}, or a model dir)")
    else:
        try:
            source = converted_dir(name_or_path) if is_gguf(name_or_path) else name_or_path
            config = AutoConfig.from_pretrained(source, trust_remote_code=False)
        except UsageError:
            raise
        except Exception as e:  # noqa: BLE001  (a damaged config.json fails anywhere in its class)
            raise UsageError(f"could not read the config of --model {name_or_path} ({str(e).splitlines()[0]}); "
                             "pass a preset, a local HF model dir or a reachable Hub id") from None
        check_config_sizes(config, f"--model {name_or_path}")
        found = task_for_config(config)
        if found not in (causal_lm, vision):
            raise UsageError(f"estimate-memory models transformer causal LMs and vision-language models, and --model "
                             f"{name_or_path} is a {type(config).__name__}; pass a causal LM "
                             f"({', '.join(causal_lm.presets)}, or a model dir)")
    head = REGISTRY[task]
    if found is vision and head is not causal_lm:
        raise UsageError(f"--model {name_or_path} is a vision-language model, which --method reward does not train; "
                         "plan it with --method sft")
    if found is vision:
        head = vision
    elif head is not causal_lm:
        config.num_labels = 1  # a reward model's one score (scored_pairs.RewardModel)
    tower = vision_tower_shape(config, name_or_path, images_per_sample, max_pixels) if found is vision else {}
    with torch.device("meta"):
        model = head.auto().from_config(config)
    if found is vision and freeze_vision_tower:
        part_named(model, VISION_TOWERS)[1].requires_grad_(False)  # as a run freezes it by default
    experts = moe.parameter_counts(model, config) if moe.is_moe(config) else {"experts": 0, "active": 0}
    model, four_bit = peft.plan_model(model, num_processes) if peft else (model, 0)
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    unique = {id(p): p for p in model.parameters()}
    root = sum(p.numel() for i, p in unique.items() if i not in in_blocks)
    block = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    text = config.get_text_config()  # a vision-language model's language model; the model itself otherwise
    return ModelShape(params=sum(p.numel() for p in unique.values()), largest_unit=max(root, block),
                      trainable=sum(p.numel() for p in unique.values() if p.requires_grad), four_bit=four_bit,
                      four_bit_bytes_per_weight=peft.four_bit_bytes_per_weight if peft else 0.0,
                      layers=text.num_hidden_layers if found is vision else max(len(blocks), 1),
                      hidden=getattr(text, "hidden_size", 0) or getattr(text, "n_embd", 0),
                      vocab=text.vocab_size if head is not REGISTRY["sequence-classification"] else config.num_labels,
                      vision_frozen=freeze_vision_tower, **tower,
                      heap_params=sum(p.numel() for p in unique.values() if 4 * p.numel() < MMAP_THRESHOLD_BYTES),
                      largest_tensor=max(p.numel() for p in unique.values()),
                      tp_plan=bool(getattr(config, "base_model_tp_plan", None)),
                      expert_params=experts["experts"], active_params=experts["active"],
                      own_shards=name_or_path not in GPT2_PRESETS
                      and OwnShards.for_model(name_or_path, config, head.auto(), trust_remote_code=False) is not None)


def vision_tower_shape(config, name_or_path: str, images_per_sample: int, max_pixels: int) -> dict:
    """ModelShape's tower fields: its blocks and width (Qwen-VL's `depth` and
    `embed_dim` too), and the patches of one image: its fixed size's, or
    `max_pixels`' for a family that sizes images by pixel count."""
    tower = config.vision_config
    patch = tower.patch_size
    side = getattr(tower, "image_size", None)
    if side:
        patches = (side // patch) ** 2
    elif max_pixels:
        patches = max_pixels // patch**2
    else:
        raise UsageError(f"--model {name_or_path} sizes its images by pixel count; pass --max_pixels (the most pixels "
                         "an image is resized to, as in training)")
    return dict(vision_layers=getattr(tower, "num_hidden_layers", None) or getattr(tower, "depth", 0),
                vision_hidden=getattr(tower, "hidden_size", None) or getattr(tower, "embed_dim", 0),
                image_patches=patches, images_per_sample=images_per_sample)


@dataclass
class LaunchConfig:
    """What the planner takes from an accelerate config file."""
    num_processes: int = 2
    mixed_precision: str = "bf16"
    strategy: str = "FSDP full shard"
    ram_efficient_loading: bool = True  # fsdp_cpu_ram_efficient_loading, as in fsdp.yaml
    keeps_a_shard_when_loaded: bool = True  # each rank keeps its shard of the weights (FSDP), not all of them
    num_machines: int = 1
    dp_replicate: int | None = None  # the parallelism_config's sizes, where the config sets them
    tp: int | None = None


# Keys a DeepSpeed JSON has and an accelerate config never does.
DEEPSPEED_KEYS = {"zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_clipping",
                  "optimizer", "bf16", "fp16"}


MIXED_PRECISIONS = ("no", "fp16", "bf16", "fp8")  # what accelerate launch takes


def check_launch_settings(launch: dict, path: str) -> None:
    """The settings the plan reads, of the types accelerate launch takes: a
    damaged config is one line, not a traceback or a plan for -3 processes."""
    def refuse(key: str, expected: str) -> UsageError:
        return UsageError(f"--accelerate_config {path}: {key} is {str(launch[key])[:60]!r}, not {expected}; fix it "
                          "in the config, or pass one of `finetune configs`")

    for key in ("num_processes", "num_machines"):
        value = launch.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise refuse(key, "a positive whole number")
    if launch.get("mixed_precision", "no") not in MIXED_PRECISIONS:
        raise refuse("mixed_precision", f"one of {', '.join(MIXED_PRECISIONS)}")
    for key in ("fsdp_config", "deepspeed_config", "parallelism_config"):
        if launch.get(key) is not None and not isinstance(launch[key], dict):
            raise refuse(key, "a mapping of settings")
    if not isinstance(launch.get("distributed_type", ""), str):
        raise refuse("distributed_type", "a name such as FSDP, MULTI_CPU or DEEPSPEED")


def read_launch_config(path: str | None, num_processes: int | None = None) -> LaunchConfig:
    """Processes (`num_processes`, where given, instead of the config's), compute
    dtype and the sharding strategy an accelerate config runs."""
    if not path:
        return LaunchConfig()
    try:
        launch = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise UsageError(f"cannot read --accelerate_config {path} ({reason}); pass a YAML file") from None
    if not isinstance(launch, dict):
        raise UsageError(f"--accelerate_config {path} holds a {type(launch).__name__}, not the mapping of settings an "
                         "accelerate config is; pass one of `finetune configs`, or one `accelerate config` wrote")
    if "distributed_type" not in launch and DEEPSPEED_KEYS & set(launch):
        raise UsageError(f"--accelerate_config {path} is a DeepSpeed config, not an accelerate config; pass the "
                         "accelerate config that names it (e.g. `finetune configs --path zero3`), as accelerate "
                         "launch takes it")
    check_launch_settings(launch, path)
    if num_processes:
        launch = {**launch, "num_processes": num_processes}
    backend = for_launch_config(launch)
    mesh = config_sizes(launch)
    return LaunchConfig(num_processes=int(launch.get("num_processes", 2)),
                        num_machines=int(launch.get("num_machines", 1)),
                        dp_replicate=mesh.get("dp_replicate_size"), tp=mesh.get("tp_size"),
                        # a config without the key runs in fp32, as Accelerate's default (the zero*.yaml)
                        mixed_precision="no" if launch.get("mixed_precision", "no") == "no" else "bf16",
                        strategy=backend.strategy(launch, Path(path)),
                        ram_efficient_loading=backend.ram_efficient_loading(launch),
                        keeps_a_shard_when_loaded=backend.keeps_a_shard_when_loaded)


@dataclass
class HostRam:
    """Host RAM per rank above the runtime while the weights arrive and during the final save."""
    loading: str    # how the weights reach the ranks
    load_main: int
    load_other: int
    save_main: int
    save_other: int


def host_ram(shape: ModelShape, num_processes: int, sharded: bool, ram_efficient_loading: bool,
             weight_bytes: int = 4, max_shard_size: int = 2 * 10**9) -> HostRam:
    full = weight_bytes * shape.params
    shard = -(-full // num_processes) if sharded else full
    if not sharded:
        loading, load_main, load_other = "every rank loads the whole model", full, full
    elif ram_efficient_loading and shape.own_shards:
        loading, load_main, load_other = "each rank reads only its shard from the files", shard, shard
    elif ram_efficient_loading:
        loading = "the main process loads the model and sends each rank its shard"
        load_main, load_other = full + shard, shard + weight_bytes * shape.largest_tensor
    else:
        loading, load_main, load_other = "every rank loads the whole model, then keeps its shard", full + shard, full + shard
    if shape.four_bit:  # final/ merges the adapters into the base reloaded whole on the main process
        return HostRam(loading, load_main, load_other, full + weight_bytes * shape.largest_tensor, 0)
    # final/ is written in fp32 (a frozen base under adapters in its own dtype), one
    # file at a time; unsharded tensors are written as they are, without a copy.
    adapters = 0 < shape.trainable < shape.params
    state_bytes = weight_bytes if adapters else 4
    state, gathered = state_bytes * shape.params, (state_bytes * shape.largest_tensor if sharded else 0)
    merged_copy = state_bytes * shape.largest_tensor if adapters else 0  # each adapted tensor is merged into a new copy
    save_main = min(max_shard_size, state) + gathered + merged_copy if sharded or adapters else 0
    return HostRam(loading, load_main, load_other, save_main, 2 * gathered)


def planned_meshes(shape: ModelShape, num_processes: int, num_machines: int, dp_replicate: int | None,
                   tp: int | None) -> tuple[tuple[int, int, int], ...]:
    """(replicas, shards, tensor parallel) of the layouts past flat FSDP to
    plan: the one asked for; else, on several machines, HSDP with a replica
    per whole number of machines that divides them (2 x 32, 4 x 16 and 8 x 8
    on 8 machines of 8), and tensor parallel over each machine's GPUs with
    FSDP across the machines, for a model transformers has a plan for."""
    if dp_replicate is not None or tp is not None:
        replicas, split = dp_replicate or 1, tp or 1
        if num_processes % (replicas * split) or num_processes // (replicas * split) < 2:
            raise UsageError(f"--dp_replicate_size {replicas} x --tp_size {split} does not leave FSDP 2 or more "
                             f"shards of {num_processes} processes; pass sizes whose product divides "
                             "--num_processes at most half-way")
        if split > 1 and not shape.tp_plan:
            raise UsageError(f"tensor parallel {split} (--tp_size, or the accelerate config's "
                             "parallelism_config_tp_size): transformers has no tensor-parallel plan for this model; "
                             "plan it without (HSDP: --dp_replicate_size)")
        return ((replicas, num_processes // (replicas * split), split),) if replicas * split > 1 else ()
    if num_machines < 2:
        return ()
    if num_processes % num_machines:
        raise UsageError(f"--num_processes {num_processes} is not a whole number of processes on each of "
                         f"--num_machines {num_machines}; pass a multiple of it")
    gpus = num_processes // num_machines
    hsdp = [(replicas, num_processes // replicas, 1) for replicas in range(2, num_machines + 1)
            if num_machines % replicas == 0 and num_processes // replicas > 1]
    tensor_parallel = [(1, num_machines, gpus)] if shape.tp_plan and gpus > 1 else []
    return tuple(hsdp + tensor_parallel)


def mask_bytes(batch: int, block_size: int, attn_implementation: str, compute_bytes: int) -> int:
    """The [batch, 1, block, block] mask that keeps the examples of packed or
    padded rows apart under sdpa and eager attention: a boolean one, and the
    additive copy the kernel makes of it (eager: ours, in fp32; SDPA's fused
    kernels: one in the compute dtype). flex attention and flash-attention take
    the position ids instead: nothing quadratic."""
    per_element = {"sdpa": 1 + compute_bytes, "eager": 1 + 4}.get(attn_implementation, 0)
    return batch * block_size * block_size * per_element


def kv_cache_bytes(shape: ModelShape, sequences: int, tokens: int, compute_bytes: int) -> int:
    """A generation batch's KV cache: keys and values of every layer for every
    token. An upper bound: grouped-query attention keeps fewer heads."""
    return 2 * shape.layers * shape.hidden * sequences * tokens * compute_bytes


def engine_bytes(shape: ModelShape, engine: str, estimate: Estimate, compute_bytes: int, num_processes: int,
                 vllm_share: float, device_memory: int | None) -> int:
    """What a sampling objective's generation engine holds on each device
    beside training (engines.py): a replica, the whole policy in the compute
    dtype (auto takes it where the state is sharded); vLLM, its share of the
    device; sampling from the model as held, nothing."""
    if engine == "vllm":
        return int(vllm_share * device_memory) if device_memory else 0
    if engine == "replica" or (engine == "auto" and estimate.sharded and num_processes > 1):
        return shape.params * compute_bytes
    return 0


def vllm_kv_tokens(shape: ModelShape, vllm_share: float, device_memory: int, compute_bytes: int) -> int:
    """Tokens of KV cache vLLM's share holds once the weights are in it (negative: the weights do not fit)."""
    room = int(vllm_share * device_memory) - shape.params * compute_bytes
    return room // kv_cache_bytes(shape, 1, 1, compute_bytes)


def estimate(shape: ModelShape, num_processes: int, batch: int, block_size: int,
             mixed_precision: str = "bf16", loss_chunk_size: int = 0, weight_bytes: int = 4,
             ram_efficient_loading: bool = True, sequences_per_row: int = 1, samples: bool = False,
             reference_copy: bool = False, meshes: tuple[tuple[int, int, int], ...] = (),
             packed_rows: bool = False, attn_implementation: str = "flex_attention") -> list[Estimate]:
    """`weight_bytes` per parameter as loaded (--model_dtype). The frozen base
    under adapters stays so; trainable parameters are fp32 under mixed precision
    (Accelerate upcasts them) and adapters always are (the adapter library upcasts them).
    `sequences_per_row` above 1: an objective's rows put that many sequences
    through one forward (a preference pair's two), through the full logits;
    `samples`: `batch` completions sampled with a KV cache (held while sampling,
    in place of the training activations), then trained through the full logits; `reference_copy`: a frozen reference beside the
    parameters (the backends that refuse one have no rows then)."""
    n = num_processes
    if sequences_per_row > 1 or samples:  # objectives whose loss reads the full logits
        batch, loss_chunk_size = sequences_per_row * batch, 0
    compute = 2 if mixed_precision == "bf16" else 4
    p, t = shape.params, shape.trainable or shape.params
    mask = mask_bytes(batch, block_size, attn_implementation, compute) if packed_rows or sequences_per_row > 1 or samples else 0
    sampling = kv_cache_bytes(shape, batch, block_size, compute) if samples else 0
    inputs = PlanInputs(
        shape=shape, num_processes=n, compute_bytes=compute, mixed_precision=mixed_precision, weight_bytes=weight_bytes,
        trained_bytes=4 if t < p or mixed_precision != "no" else weight_bytes,
        activations=max(sampling, mask + activation_bytes(shape, batch, block_size, compute,
                                                          loss_chunk_size=loss_chunk_size)),
        checkpointed_activations=max(sampling, mask + activation_bytes(shape, batch, block_size, compute,
                                                                       checkpointing=True,
                                                                       loss_chunk_size=loss_chunk_size)),
        # Gathered copies: two units (the current one and the prefetched next one).
        gather_units=min(2 * shape.largest_unit, p) * compute if n > 1 else 0,
        frozen_whole=frozen_bytes(shape, weight_bytes), frozen_shard=frozen_bytes(shape, weight_bytes, n),
        # DPO's frozen reference, in the weights' dtype: each backend lays it out as its parameters
        reference_whole=weight_bytes * p if reference_copy else 0,
        reference_shard=weight_bytes * -(-p // n) if reference_copy else 0, meshes=meshes,
        split_activations={tp: tuple(mask + activation_bytes(shape, batch, block_size, compute,
                                                             checkpointing=checkpointing,
                                                             loss_chunk_size=loss_chunk_size, tensor_parallel=tp)
                                     for checkpointing in (False, True))
                           for tp in {mesh[2] for mesh in meshes}})
    usable = [b for b in BACKENDS if not (reference_copy and b.frozen_model_refusal)]
    estimates = [row for backend in usable for row in backend.plan(inputs)]
    for e in estimates:
        if e.cpu_calibrated:
            sharded = n > 1 and e.sharded
            load = host_ram(shape, n, sharded, ram_efficient_loading, weight_bytes).load_main
            e.peak_rss = cpu_peak_rss(shape, e, sharded, load)
    return estimates


def render(shape: ModelShape, estimates: list[Estimate], num_processes: int, device_memory: int | None,
           host: HostRam | None = None) -> str:
    trainable = (f", of which {shape.trainable:,} trainable ({100 * shape.trainable / shape.params:.2f}%)"
                 if shape.trainable and shape.trainable < shape.params else "")
    experts = (f"; a mixture of experts: {shape.expert_params:,} in the experts "
               f"({100 * shape.expert_params / shape.params:.1f}% of the state, every one held), {shape.active_params:,} "
               "active per token (the compute)" if shape.expert_params else "")
    lines = [f"{shape.params:,} parameters ({4 * shape.params / GIB:.2f} GiB in fp32){trainable}{experts}; largest "
             f"FSDP unit {shape.largest_unit:,} parameters; {num_processes} process(es). Bytes per device:", "",
             "| strategy | params | grads | AdamW state | gathered units | activations | total | peak RSS, CPU run | fits |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for column, held in (("frozen reference", "reference"), ("generation engine", "engine")):
        if any(getattr(e, held) for e in estimates):  # DPO's frozen reference, GRPO's engine: columns of their own
            lines[-2:] = [lines[-2].replace(" total |", f" {column} | total |"), lines[-1] + " --- |"]
    extra = [held for held in ("reference", "engine") if any(getattr(e, held) for e in estimates)]
    for e in estimates:
        fits = "-" if device_memory is None else ("yes" if e.total <= device_memory else "no")
        rss = e.no_peak_rss if e.peak_rss is None else f"{e.peak_rss:,} ({e.peak_rss / GIB:.2f} GiB)"
        columns = "".join(f" {getattr(e, held):,} |" for held in extra)
        lines.append(f"| {e.strategy} | {e.params:,} | {e.grads:,} | {e.optimizer:,} | {e.gathered:,} | "
                     f"{e.activations:,} |{columns} {e.total:,} ({e.total / GIB:.2f} GiB) | {rss} | {fits} |")
    if shape.vision_layers:
        lines += ["", f"Vision tower: {shape.vision_layers} blocks of width {shape.vision_hidden}, "
                      f"{'frozen (no activations kept for backward)' if shape.vision_frozen else 'trained'}; "
                      f"{shape.images_per_sample} image(s) a row of {shape.image_patches:,} patches each, their "
                      "tokens within --block_size; the activations column counts the tower's too."]
    if host is not None:
        lines += ["", f"Host RAM per rank above the runtime ({RUNTIME_BYTES:,}): loading the weights "
                      f"{host.load_main:,} on the main process, {host.load_other:,} on each other ({host.loading}); "
                      f"the final save {host.save_main:,} on the main process, {host.save_other:,} on each other."]
    return "\n".join(lines)


def render_traffic(shape: ModelShape, estimates: list[Estimate], num_processes: int, num_machines: int,
                   mixed_precision: str, device_memory: int | None, tokens: int) -> str:
    """Each fully sharded layout's bytes per GPU and step, within and across
    nodes (`tokens` per tensor-parallel group and micro-batch), and, on several
    nodes, the layout to use: of those that fit (with activation checkpointing
    if need be), the one sending the fewest bytes across nodes; where several
    send within 10% of that, the one with the fewest collectives across nodes
    (each waits on the slowest link)."""
    compute = 2 if mixed_precision == "bf16" else 4  # Accelerate reduces gradients in the compute dtype too
    gpus_per_node = max(num_processes // num_machines, 1)
    meshes = list(dict.fromkeys(e.mesh for e in estimates if e.mesh is not None))
    lines = [f"Traffic per optimizer step on {num_machines} node(s) of {gpus_per_node} GPU(s), bytes each GPU sends "
             "(ring collectives; a collective whose ranks span nodes runs at the speed of the links between them):",
             "", "| layout | within a node | across nodes | collectives across nodes | "
                 "per device | with activation checkpointing | fits |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    layouts = []
    for mesh in meshes:
        plain, checkpointed = ([e for e in estimates if e.mesh == mesh and ("checkpointing" in e.strategy) == ac][0]
                               for ac in (False, True))
        traffic = fsdp_traffic(shape, mesh, gpus_per_node, compute, compute, tokens)
        fits = ("-" if device_memory is None else "yes" if plain.total <= device_memory
                else "with activation checkpointing" if checkpointed.total <= device_memory else "no")
        layouts.append((mesh_name(mesh), traffic, fits))
        lines.append(f"| {mesh_name(mesh)} | {traffic.within_node:,} | {traffic.across_nodes:,} "
                     f"| {traffic.collectives_across:,} | {plain.total / GIB:.2f} GiB | {checkpointed.total / GIB:.2f} GiB "
                     f"| {fits} |")
    if num_machines < 2:
        return "\n".join(lines)
    usable = [layout for layout in layouts if layout[2] != "no"]
    if not usable:
        return "\n".join(lines + ["", "None of these layouts fits the device memory, even with activation "
                                       "checkpointing: add GPUs, train with --peft lora, or shorten --block_size."])
    fewest = min(traffic.across_nodes for _, traffic, _ in usable)
    near = [layout for layout in usable if layout[1].across_nodes <= 1.1 * fewest]
    label, traffic, fits = min(near, key=lambda layout: (layout[1].collectives_across, layout[1].across_nodes))
    how = " with activation checkpointing" if fits == "with activation checkpointing" else ""
    return "\n".join(lines + ["", f"Recommended: {label}{how}: "
                                   f"{traffic.across_nodes:,} bytes per GPU per step across nodes in "
                                   f"{traffic.collectives_across:,} collectives."])


# Measured (unique set size; scripts/bench.py --suite data, and a 4-shard
# .jsonl.gz corpus of 400,000 documents of 20 to 200 words): what a rank's stream
# holds above its process (21 to 33 MB), and what each encoding worker
# (--dataloader_num_workers) holds of its own (17 MB with a preset's tokenizer,
# 33 MB with SmolLM2's 49,152-token one).
STREAM_READER_BYTES = 32 * 2**20
ENCODING_WORKER_BYTES = 32 * 2**20


def data_ram_line(streaming: bool, workers: int, block_size: int) -> str:
    """What the training data holds in host RAM per rank."""
    if streaming:
        total = STREAM_READER_BYTES + workers * ENCODING_WORKER_BYTES
        return (f"Training data per rank, streamed: about {total:,} bytes ({STREAM_READER_BYTES:,} for the reader's "
                f"parsed block and a chunk of examples, {ENCODING_WORKER_BYTES:,} in each of {workers} encoding "
                "worker(s)), the same for any corpus size; a shard count the number of ranks does not divide makes "
                "every rank read (decompress and parse) every shard and keep its share of the examples.")
    return (f"Training data per rank, map-style: the whole tokenized dataset (8 bytes per token, blocks of "
            f"{block_size}), tokenized before step 1 and memory-mapped from datasets' cache; --streaming holds about "
            f"{STREAM_READER_BYTES:,} bytes instead, whatever the corpus's size.")
