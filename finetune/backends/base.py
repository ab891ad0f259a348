"""What every backend answers, with the answers of a run that holds the whole
model on every rank (one process, DDP). A backend (FSDP2, FSDP1, DDP,
DeepSpeed, one process) overrides what it does differently; the loop, the
checkpoints, the export and the planner ask it instead of branching."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import ClassVar, Iterator

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import InitProcessGroupKwargs

from finetune.backends.mesh import Mesh
from finetune.collectives import gather_ints, whole_tensors
from finetune.errors import NotDistributed, UsageError
from finetune.estimates import Estimate, ModelShape
from finetune.launch_request import has_accelerator_device, launched_world_size, no_deepspeed_engine
from finetune.model_dir import Weights
from finetune.parameters import full_numel, local_numel, tally
from finetune.shard_loading import safetensors_weights
from finetune.verify import check_dcp_dir, check_pickled_file


@dataclass
class ShardReport:
    total_params: int
    local_params_per_rank: list[int]
    mesh: Mesh = Mesh()  # how the ranks split the work (summary.json's `parallelism`)


def shard_report(model: torch.nn.Module, accelerator: Accelerator, mesh: Mesh | None = None) -> ShardReport:
    """Count this rank's share of the parameters and gather everyone's."""
    params = list(model.parameters())
    total = sum(full_numel(p) for p in params)
    return ShardReport(total_params=total, local_params_per_rank=gather_ints(accelerator, sum(local_numel(p) for p in params)),
                       mesh=mesh or Mesh(dp_replicate=accelerator.num_processes))


def check_partition(report: ShardReport, what: str, replicas: int = 1) -> None:
    """Each rank holds less than the model, and the ranks of each of the
    `replicas` hold all of it between them."""
    local, total = report.local_params_per_rank, report.total_params
    if sum(local) < replicas * total or max(local) >= total:
        raise NotDistributed(f"{what} do not partition the model: per-rank {local}, total {total}"
                             f"{f' in each of {replicas} replicas' if replicas > 1 else ''}; refusing to train unsharded")


@dataclass
class PlanInputs:
    """What every backend's planner rows are computed from (finetune/memory.py fills it)."""
    shape: ModelShape
    num_processes: int
    compute_bytes: int        # 2 under bf16 mixed precision, else 4
    mixed_precision: str
    weight_bytes: int         # per parameter as loaded (--model_dtype)
    trained_bytes: int        # per trained element: fp32 under mixed precision and for adapters
    activations: int
    checkpointed_activations: int
    gather_units: int         # two gathered units in the compute dtype (0 on one process)
    frozen_whole: int         # the frozen base under adapters, whole
    frozen_shard: int         # and a rank's share of it
    reference_whole: int = 0  # DPO's frozen reference model, whole (0 where there is none)
    reference_shard: int = 0  # and a rank's share of it
    # (replicas, shards, tensor parallel) of the layouts past flat FSDP to plan (HSDP, tensor parallel),
    # and the activations (plain, checkpointed) per tensor-parallel size.
    meshes: tuple[tuple[int, int, int], ...] = ()
    split_activations: dict[int, tuple[int, int]] = field(default_factory=dict)


OPTIMIZER_SHARDS_DIR = "optimizer_0"  # Accelerate's save_state, for a sharded optimizer


# Parameters gathered whole together (one collective), up to about this many bytes.
WHOLE_TENSORS_BATCH_BYTES = 256 * 2**20


class Backend:
    """The one-process run; also the base of every other backend."""
    # Checkpoints: how this backend stores the model in `save_state` output, and how messages name it.
    layout: ClassVar[str] = "unsharded"
    written_as: ClassVar[str] = "without sharding"
    run_is: ClassVar[str] = "not sharded"
    example_config: ClassVar[str] = "ddp"   # a shipped config that reads this layout
    weights_name: ClassVar[str] = "model.safetensors"
    weights_described: ClassVar[str] = "model.safetensors"  # for messages

    # --- selection ------------------------------------------------------------------------------

    fallback: ClassVar[bool] = False  # chosen only when no other backend is asked for (whole replicas)
    # The parallelism_config dimensions (finetune/backends/mesh.py) this backend lays a model out on.
    mesh_dims: ClassVar[frozenset[str]] = frozenset()
    # Checkpoints store a tied parameter once and leave a frozen base out (checkpoint.StoredState).
    checkpoints_leave_out_stored_state: ClassVar[bool] = True

    @classmethod
    def requested(cls) -> bool:
        """Whether the environment `accelerate launch` set up asks for this backend."""
        return launched_world_size() == 1

    @classmethod
    def wrote(cls, checkpoint_dir: Path) -> bool:
        """Whether a checkpoint is in this backend's layout."""
        return (checkpoint_dir / cls.weights_name).is_file()

    @classmethod
    def holds_weights(cls, path: Path) -> bool:
        """Whether `path` is a model's weights in this layout."""
        return path.name == cls.weights_name and path.is_file()

    @classmethod
    def runs_launch_config(cls, launch: dict) -> bool:
        """Whether an accelerate config file (as a dict) runs this backend."""
        return launch.get("distributed_type", "NO") == "NO"

    # --- building and preparing -----------------------------------------------------------------

    def import_libraries(self) -> None:
        """A run without DeepSpeed's engine keeps Accelerate from importing it."""
        no_deepspeed_engine()

    def check_supported_here(self) -> None:
        """One line (UsageError) for what this machine cannot run."""

    def process_group(self, timeout: timedelta) -> InitProcessGroupKwargs:
        """Sets up what Accelerate needs to start the ranks, before the Accelerator is built."""
        if not has_accelerator_device() and launched_world_size() > 1:
            PartialState(cpu=True, timeout=timeout)  # without cpu=True, Accelerate leaves every CPU rank alone (NO)
        return InitProcessGroupKwargs(timeout=timeout)

    def after_accelerator(self) -> None:
        """Undoes what `process_group` changed in Accelerate's shared state."""

    def check_chosen(self, accelerator: Accelerator) -> None:
        """Stops a run whose Accelerator did not become this backend."""

    def check_model(self, accelerator: Accelerator, model: torch.nn.Module) -> None:
        """What `prepare` would refuse with a traceback, refused before it in one line."""

    def split_layers(self, accelerator: Accelerator, model: torch.nn.Module) -> None:
        """Splits the model's matrices over the tensor-parallel ranks, in place,
        before the optimizer sees its parameters; nothing where there are none."""

    def fit_to_run(self, accelerator: Accelerator, micro_batch_size: int, max_grad_norm: float) -> None:
        """The run's options where the engine would otherwise use its own; before `prepare`."""

    def after_prepare(self, model: torch.nn.Module) -> None:
        """Adjusts the prepared model to the machine."""

    def after_evaluation(self, model: torch.nn.Module) -> None:
        """Frees what forward passes without a backward left gathered."""

    generation_refusal: str | None = None  # why an online objective cannot sample under this backend, and the fix

    @contextmanager
    def generating(self, model: torch.nn.Module):
        """Around transformers' `generate` on the prepared model, whose forwards
        may start below the model the backend wrapped (a PEFT model's base)."""
        yield

    def shards_parameters(self, accelerator: Accelerator) -> bool:
        """Whether a rank holds only a part of the parameters (sampling from them gathers the rest)."""
        return False

    def whole_parameter_count(self, model: torch.nn.Module) -> int:
        return sum(full_numel(p) for p in model.parameters())

    def sampling_dtype(self, model: torch.nn.Module) -> torch.dtype:
        """The dtype the model's forward computes in."""
        return next(p.dtype for p in model.parameters() if p.is_floating_point())

    def whole_parameters(self, model: torch.nn.Module, wanted) -> Iterator[tuple[str, torch.Tensor]]:
        """The parameters whose names `wanted` takes, each whole, one at a time,
        named as the module names them. Where each rank holds a part this is a
        collective: every rank iterates the same names."""
        names, tensors, batch_bytes = [], [], 0
        for name, p in model.named_parameters():
            if not wanted(name):
                continue
            names.append(name)
            tensors.append(p)
            batch_bytes += full_numel(p) * p.element_size()
            if batch_bytes >= WHOLE_TENSORS_BATCH_BYTES:
                yield from zip(names, whole_tensors(tensors))
                names, tensors, batch_bytes = [], [], 0
        yield from zip(names, whole_tensors(tensors))

    # A model that only runs forward (a preference objective's frozen reference).
    frozen_model_refusal: str | None = None  # why this backend cannot hold one, and what to do instead

    def prepare_frozen(self, accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
        """The model laid out as the trained one is, with no gradients and no
        optimizer state; here every rank holds it whole, as it holds the trained one."""
        return model.requires_grad_(False).eval().to(accelerator.device)

    def verify_sharded(self, model: torch.nn.Module, accelerator: Accelerator) -> ShardReport:
        """Each rank's parameters; fails loudly where sharding was asked for and did not happen."""
        return shard_report(model, accelerator)

    def weights_from_main_process(self, accelerator: Accelerator) -> bool:
        """Whether only the main process reads the pretrained weights and `prepare` sends the others theirs."""
        return False

    def leave_loading_to_the_ranks(self, accelerator: Accelerator) -> None:
        """Each rank reads its own weights after all (its shards, or a 4-bit base it quantises itself)."""

    def units(self, model: torch.nn.Module) -> int:
        """Modules the auto-wrap policy made into FSDP units; 0 where there are none."""
        return 0

    def summary_facts(self, accelerator: Accelerator) -> dict:
        return {"fsdp_version": None, "zero_stage": None}

    def layout_line(self, accelerator: Accelerator, shards: ShardReport, units: int) -> str:
        if accelerator.num_processes > 1:
            return (f"{accelerator.distributed_type.value} on {accelerator.num_processes} processes, each holding all "
                    f"{shards.total_params:,} parameters")
        return f"1 process, {shards.total_params:,} parameters (no sharding)"

    @contextmanager
    def models_built_whole(self, accelerator: Accelerator):
        """Inside, a model built on one rank alone is built whole (no collective)."""
        yield

    def end_training(self, accelerator: Accelerator) -> None:
        accelerator.end_training()

    # --- what a rank holds ----------------------------------------------------------------------

    measures_state_after_first_step: ClassVar[bool] = True  # with the gradients alive, before they are freed

    def state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, int]]:
        """Elements and bytes this rank holds in parameters, gradients and
        optimizer state. `optimizer` is the torch optimizer that steps; measure
        right after its step, before the gradients are freed."""
        params = list(model.parameters())
        moments = [v for state in optimizer.state.values() for v in state.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0]
        return {"params": tally(params), "grads": tally(p.grad for p in params if p.grad is not None),
                "optimizer": tally(moments)}

    # --- the end of the run ---------------------------------------------------------------------

    def gathers_whole_state(self, accelerator: Accelerator) -> bool:
        """Whether the final state comes whole to the main process at once
        (Accelerate's `get_state_dict`), instead of tensor by tensor."""
        return False

    # --- checkpoints ----------------------------------------------------------------------------

    def check_checkpoint_files(self, checkpoint_dir: Path) -> None:
        """This layout's files, checked before anything is loaded (finetune/verify.py):
        the optimizer's, as DCP shards (`optimizer_0/`) or one file."""
        if (checkpoint_dir / OPTIMIZER_SHARDS_DIR).is_dir():
            check_dcp_dir(checkpoint_dir / OPTIMIZER_SHARDS_DIR)
        else:
            check_pickled_file(checkpoint_dir / "optimizer.bin")

    def saved_shapes(self, checkpoint_dir: Path) -> dict[str, tuple[int, ...]]:
        from safetensors import SafetensorError, safe_open

        weights = checkpoint_dir / self.weights_name
        if not weights.is_file():
            raise UsageError(f"{checkpoint_dir} holds no model weights (pytorch_model_fsdp_0/ or model.safetensors); "
                             "resume from another checkpoint")
        try:
            with safe_open(str(weights), "pt") as f:
                return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        except (OSError, SafetensorError) as e:
            raise UsageError(f"{weights} is not readable safetensors ({str(e).strip().splitlines()[0][:80]}); the "
                             "checkpoint is damaged, resume from an earlier one") from None

    def check_resume_world_size(self, checkpoint_dir: Path, written_by: int, num_processes: int) -> None:
        """A checkpoint this backend cannot reshard to `num_processes` ranks stops the resume."""

    def loading_checkpoint(self):
        """Around the engine's own reading of a checkpoint (nothing unpickled unchecked)."""
        return nullcontext()

    def export_weights(self, weights: Path) -> Weights:
        """The model's tensors at `weights` (this layout's `weights_name` in a
        checkpoint), read a few at a time, for `finetune export`."""
        return safetensors_weights(weights)

    # --- relaunching ----------------------------------------------------------------------------

    @staticmethod
    def launch_files() -> dict:
        """Files the accelerate config names, recorded by content with the run (finetune/launch.py)."""
        return {}

    @staticmethod
    def write_launch_files(launch: dict, config: dict, scratch: Path) -> dict:
        """The recorded files written into `scratch` for a relaunch; the accelerate config naming them."""
        return config

    # --- the planner ----------------------------------------------------------------------------

    keeps_a_shard_when_loaded: ClassVar[bool] = False  # each rank keeps only its shard once the weights are in

    @classmethod
    def ram_efficient_loading(cls, launch: dict) -> bool:
        """Whether an accelerate config of this backend loads the weights once, not on every rank."""
        return False

    @classmethod
    def strategy(cls, launch: dict, path: Path) -> str:
        """The planner's row name for an accelerate config of this backend."""
        return "DDP"

    @classmethod
    def plan(cls, p: PlanInputs) -> list[Estimate]:
        """This backend's rows in `finetune estimate-memory`: bytes per device."""
        return []
