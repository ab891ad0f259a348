"""The arithmetic of the memory planner: a model's shape, one row of bytes
per device, activations, and a CPU rank's resident set. Each backend
(finetune/backends) computes its rows with it; finetune/memory.py collects
them (see its docstring for the model behind the numbers)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from finetune.host_memory import MIB

GIB = 1024**3

# Calibrated on fp32 CPU runs (torch 2.13, transformers 5.23, glibc 2.36):
# tiny-gpt2, the GPT-2 124M shape and a 34 M-parameter Llama, on 1, 2 and 3
# processes; tests/e2e/test_memory_planner.py keeps the prediction within 15%.
RUNTIME_BYTES = 530 * MIB
# The heap's high-water mark above the live tensors, in fp32 bytes of the
# parameters held in tensors below the mmap threshold: on one process their
# gradients and the optimizer's temporaries pass through it; sharded, also
# the gathered units and their unsharded gradients. (Sharded it was 3.25 with
# gloo's own reduce-scatter and all-gather, whose temporaries were whole units;
# finetune/collectives.py's reduce in place and gather in 4 MB pieces.)
HEAP_CHURN_ONE_PROCESS = 2.0
HEAP_CHURN_SHARDED = 0.9


@dataclass
class ModelShape:
    params: int
    largest_unit: int   # parameters of the largest FSDP unit (a block, or what the root keeps)
    layers: int
    hidden: int
    vocab: int
    heap_params: int = 0  # parameters in tensors small enough (in fp32) to come from the heap
    trainable: int = 0    # parameters with gradients and optimizer state (all but a frozen base under adapters)
    four_bit: int = 0     # frozen parameters held in 4 bits
    four_bit_bytes_per_weight: float = 0.0  # what each of those takes, their scales included
    largest_tensor: int = 0  # elements of the largest parameter
    own_shards: bool = False  # a safetensors dir each rank can read its shards from (shard_loading.py)
    tp_plan: bool = False     # transformers has a tensor-parallel plan for the model
    expert_params: int = 0    # a mixture of experts': the experts' parameters (all held, few computed with)
    active_params: int = 0    # the parameters one token computes with (all but the experts it is not routed to)
    # A vision-language model's tower: its blocks, their width, the patches of one image through it, the
    # images of one row, and whether it trains (a frozen one keeps no activations for backward).
    vision_layers: int = 0
    vision_hidden: int = 0
    image_patches: int = 0
    images_per_sample: int = 0
    vision_frozen: bool = True


@dataclass
class Estimate:
    strategy: str
    params: int
    grads: int
    optimizer: int
    gathered: int
    activations: int
    peak_rss: int | None = None  # a CPU run's resident set per rank; None where not known
    no_peak_rss: str = "GPU only"  # what the table says where peak_rss is None
    sharded: bool = True  # each rank holds a share of the state (with more than one process)
    cpu_calibrated: bool = False  # a CPU run's peak_rss is predicted (calibrated against measured runs)
    reference: int = 0  # DPO's frozen reference model (no gradients, no optimizer state)
    engine: int = 0  # a sampling objective's generation engine: a replica's weights, or vLLM's share of the device
    mesh: tuple[int, int, int] | None = None  # (replicas, shards, tensor parallel) of an FSDP layout, for its traffic

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.state + self.reference + self.engine + self.gathered + self.activations


def activation_bytes(shape: ModelShape, batch: int, block_size: int, compute_bytes: int,
                     checkpointing: bool = False, loss_chunk_size: int = 0, tensor_parallel: int = 1) -> int:
    """`tensor_parallel` ranks split the attention and MLP activations, 24 of
    the 34 (Korthikanti et al.), and compute the full logits (the output
    layer's scores are gathered, so the chunked loss is off)."""
    tokens = batch * block_size
    per_layer = int((10 + 24 / tensor_parallel) * shape.hidden * tokens * compute_bytes) // 2
    layers = (shape.layers * 2 * shape.hidden * tokens + per_layer) if checkpointing else shape.layers * per_layer
    layers += vision_activation_bytes(shape, batch, compute_bytes, checkpointing)
    if not loss_chunk_size or tensor_parallel > 1:
        # The logits, their fp32 copy and gradient, and the output layer's weight gradient.
        return (layers + tokens * shape.vocab * (compute_bytes + 4 + 4)
                + shape.vocab * shape.hidden * compute_bytes)
    # One chunk's logits, fp32 scores and their gradient at a time, and the
    # gradients the chunked loss keeps for backward: the hidden states' and the
    # output layer's (fp32).
    chunk = min(tokens, loss_chunk_size) * shape.vocab * (compute_bytes + 4 + compute_bytes)
    return layers + chunk + tokens * shape.hidden * compute_bytes + shape.vocab * shape.hidden * 4


def vision_activation_bytes(shape: ModelShape, batch: int, compute_bytes: int, checkpointing: bool = False) -> int:
    """A vision tower's activations for the images of `batch` rows (a
    transformer's per patch, as the language model's per token). A frozen
    tower runs without autograd: one block's at a time."""
    patches = batch * shape.images_per_sample * shape.image_patches
    per_layer = int(34 * shape.vision_hidden * patches * compute_bytes) // 2
    if shape.vision_frozen or not patches:
        return per_layer
    if checkpointing:
        return shape.vision_layers * 2 * shape.vision_hidden * patches * compute_bytes // 2 + per_layer
    return shape.vision_layers * per_layer


def frozen_bytes(shape: ModelShape, weight_bytes: int, ranks: int = 1) -> int:
    """A rank's share of the frozen base (none in a full fine-tune): `weight_bytes`
    per parameter, and the 4-bit size for those held in 4 bits."""
    frozen = shape.params - (shape.trainable or shape.params)
    return weight_bytes * -(-(frozen - shape.four_bit) // ranks) + math.ceil(shape.four_bit_bytes_per_weight * shape.four_bit / ranks)


def cpu_peak_rss(shape: ModelShape, e: Estimate, sharded: bool, load: int) -> int:
    """What a CPU rank's resident set peaks at (see the module docstring)."""
    churn = (HEAP_CHURN_SHARDED if sharded else HEAP_CHURN_ONE_PROCESS) * 4 * shape.heap_params
    return RUNTIME_BYTES + max(load, e.total + int(churn))


def mesh_name(mesh: tuple[int, int, int]) -> str:
    """(replicas, shards, tensor parallel) as the planner's rows name it: HSDP 8 x 8, FSDP 8 x TP 8."""
    replicas, shards, tp = mesh
    name = f"HSDP {replicas} x {shards}" if replicas > 1 else f"FSDP {shards}"
    return f"{name} x TP {tp}" if tp > 1 else name


@dataclass
class Traffic:
    """Bytes one GPU sends per optimizer step under a fully sharded layout on
    nodes of `gpus_per_node`, by ring collectives (each rank sends (n-1)/n of
    the buffer per all-gather or reduce-scatter, twice that per all-reduce). A
    collective whose group spans nodes runs at the speed of the links between
    them, so all its bytes count as across nodes."""
    within_node: int
    across_nodes: int
    collectives_across: int  # collectives per step whose group spans nodes


def fsdp_traffic(shape: ModelShape, mesh: tuple[int, int, int], gpus_per_node: int, compute_bytes: int,
                 reduce_bytes: int, tokens: int) -> Traffic:
    """The ranks of a mesh (replicas, shards, tensor parallel) in that order,
    tensor parallel innermost, as Accelerate's device mesh lays them out.
    Tensor parallel: each layer's two split blocks all-reduce their outputs in
    forward and their inputs' gradients in backward (4 all-reduces of the
    `tokens` x hidden activations). FSDP within each replica: every unit (its
    tensor-parallel share) all-gathered for forward and again for backward
    (reshard after forward) in the compute dtype, the trained parameters'
    gradients reduce-scattered in the reduce dtype. Across replicas: each
    rank's gradient shard all-reduced."""
    replicas, shards, tp = mesh
    params, trainable, units = -(-shape.params // tp), -(-(shape.trainable or shape.params) // tp), shape.layers + 1
    tensor = 4 * shape.layers * 2 * (tp - 1) * tokens * shape.hidden * compute_bytes // tp
    shard = 2 * (shards - 1) * params * compute_bytes // shards + (shards - 1) * trainable * reduce_bytes // shards
    replica = 2 * (replicas - 1) * -(-trainable // shards) * reduce_bytes // replicas
    groups = [(tensor, tp > gpus_per_node, 4 * shape.layers),  # (bytes, spans nodes, collectives)
              (shard, shards > 1 and shards * tp > gpus_per_node, 3 * units),
              (replica, replicas > 1 and replicas * shards * tp > gpus_per_node, units)]
    return Traffic(within_node=sum(b for b, across, _ in groups if not across),
                   across_nodes=sum(b for b, across, _ in groups if across),
                   collectives_across=sum(n for b, across, n in groups if across and b))
