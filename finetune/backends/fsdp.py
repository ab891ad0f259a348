"""FSDP2 (`fully_shard`, DTensor shards) and FSDP1 through Accelerate's FSDP
plugin, and real FSDP2 on CPU-only machines.

Accelerate only selects FSDP when it finds an accelerator device: on a CPU-only
machine `accelerate launch --config_file accelerate_configs/fsdp.yaml` starts
the processes, but each one ends up alone (`NO`) or in plain DDP (`MULTI_CPU`)
with the FSDP plugin silently dropped. PyTorch's FSDP2 runs on CPU over gloo,
so `process_group` sets up the gloo process group and hands it to Accelerate
as a multi-device one; Accelerate then builds its FSDP state and `prepare`
shards the model exactly as it would on GPUs.

Checkpoints: the model and optimizer as DCP shards (`pytorch_model_fsdp_0/`,
`optimizer_0/`), which any number of ranks can read back.
"""

from __future__ import annotations

from contextlib import contextmanager

import warnings
from datetime import timedelta
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, InitProcessGroupKwargs
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from finetune.backends.base import Backend, PlanInputs, ShardReport, check_partition, shard_report
from finetune.backends.mesh import asked_fsdp_mesh, config_sizes, mesh_of, tensor_parallel_size
from finetune.collectives import use_gloo_collectives
from finetune.errors import NotDistributed, UsageError
from finetune.estimates import Estimate, frozen_bytes, mesh_name
from finetune.launch_request import check_fsdp_runs_here, fsdp_requested, fsdp_version, has_accelerator_device
from finetune.model_dir import Weights
from finetune.verify import check_dcp_dir

MODEL_SHARDS_DIR = "pytorch_model_fsdp_0"


class FSDP2(Backend):
    layout = "FSDP"
    written_as = "under FSDP"
    run_is = "an FSDP run"
    example_config = "fsdp"
    weights_name = MODEL_SHARDS_DIR
    weights_described = f"{MODEL_SHARDS_DIR}/ with DCP shards"
    fsdp_version: ClassVar[int] = 2
    keeps_a_shard_when_loaded = True
    mesh_dims = frozenset({"dp_replicate", "dp_shard", "tp"})  # flat FSDP, HSDP, and FSDP over tensor-parallel ranks

    @classmethod
    def requested(cls) -> bool:
        return fsdp_requested() and fsdp_version() == 2

    @classmethod
    def wrote(cls, checkpoint_dir: Path) -> bool:
        return (checkpoint_dir / MODEL_SHARDS_DIR).is_dir()

    @classmethod
    def holds_weights(cls, path: Path) -> bool:
        return path.is_dir() and (path / ".metadata").is_file()

    @classmethod
    def runs_launch_config(cls, launch: dict) -> bool:
        version = str((launch.get("fsdp_config") or {}).get("fsdp_version", 2))
        return launch.get("distributed_type") == "FSDP" and (version == "1") == (cls.fsdp_version == 1)

    # --- building and preparing -----------------------------------------------------------------

    def check_supported_here(self) -> None:
        check_fsdp_runs_here()

    def process_group(self, timeout: timedelta) -> InitProcessGroupKwargs:
        """On a CPU-only machine: `PartialState(cpu=True)` initialises the gloo
        process group as MULTI_CPU. `AcceleratorState` only turns FSDP on for the
        multi-device kinds, so the shared state is presented as MULTI_GPU while
        the Accelerator is built; `after_accelerator` puts it back. Nothing else
        is patched."""
        if not has_accelerator_device():
            state = PartialState(cpu=True, timeout=timeout)
            if state.distributed_type == DistributedType.MULTI_CPU:
                state.distributed_type = DistributedType.MULTI_GPU
        return InitProcessGroupKwargs(timeout=timeout)

    def after_accelerator(self) -> None:
        state = PartialState()
        if state.distributed_type == DistributedType.MULTI_GPU and not has_accelerator_device():
            state.distributed_type = DistributedType.MULTI_CPU

    def check_chosen(self, accelerator: Accelerator) -> None:
        if accelerator.distributed_type != DistributedType.FSDP:
            raise NotDistributed(f"the accelerate config asks for FSDP but Accelerate chose "
                                 f"{accelerator.distributed_type.value}; refusing to train unsharded")

    def check_model(self, accelerator: Accelerator, model: torch.nn.Module) -> None:
        """FSDP2's size-based wrap (fsdp_cnn.yaml, the lectures' policy) would wrap
        any module over the threshold, and fully_shard refuses containers without
        a forward (a transformer's ModuleList of blocks): say so in one line
        before `prepare` fails with a traceback."""
        plugin = accelerator.state.fsdp_plugin
        if "transformer" in str(plugin.auto_wrap_policy).lower() and plugin.transformer_cls_names_to_wrap is None:
            # A model's `_no_split_modules` may name classes of its family that it does not hold (a LLaVA's
            # CLIP tower has no CLIPTextEmbeddings), which Accelerate refuses: the units are those it holds.
            held = {type(module).__name__ for module in model.modules()}
            plugin.transformer_cls_names_to_wrap = [name for name in getattr(model, "_no_split_modules", None) or ()
                                                    if name in held]
        if "size_based" not in str(plugin.auto_wrap_policy).lower():
            return
        containers = [(name, type(module).__name__) for name, module in model.named_modules()
                      if name and type(module).forward is torch.nn.Module.forward
                      and sum(p.numel() for p in module.parameters()) > plugin.min_num_params]
        if containers:
            name, kind = containers[0]
            raise UsageError(f"this accelerate config wraps modules by size, which would make {name} (a {kind} without "
                             f"forward) an FSDP unit, and FSDP2 cannot; launch {type(model).__name__} with "
                             "`--config_file $(finetune configs --path fsdp)` (a unit per transformer block)")

    def split_layers(self, accelerator: Accelerator, model: torch.nn.Module) -> None:
        """Tensor parallel: transformers' own plan for the model (its config's
        `base_model_tp_plan`: which matrices split by rows, which by columns, and
        the hooks that gather their outputs), applied on the `tp` ranks of
        Accelerate's mesh, so that `prepare` can shard the result over the
        other ranks of the same mesh (a mesh of transformers' own would not
        combine with it)."""
        size = tensor_parallel_size(accelerator)
        if size == 1:
            return
        from transformers.distributed import DistributedConfig
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        base = accelerator.unwrap_model(model)
        if hasattr(base, "peft_config"):
            raise UsageError(f"parallelism_config_tp_size {size} with --peft: finetune splits full models over "
                             "tensor-parallel ranks, not adapters; drop --peft, or train the adapters with "
                             "`--config_file $(finetune configs --path fsdp)` (they need far less memory)")
        if not getattr(base.config, "base_model_tp_plan", None):
            raise UsageError(f"{type(base).__name__} has no tensor-parallel plan in transformers, so "
                             "parallelism_config_tp_size must be 1 for it; train it with `--config_file $(finetune "
                             "configs --path hsdp)` or `fsdp`, or pick a family with a plan (Llama, Qwen2, Mistral, ...)")
        plan, _, _ = base._resolve_parallel_plans(DistributedConfig(tp_size=size))  # the plan, one entry per layer
        apply_tensor_parallelism(base, accelerator.torch_device_mesh["tp"], plan)
        self.leave_loading_to_the_ranks(accelerator)  # each rank holds its split weights already: nothing to send

    def fit_to_run(self, accelerator: Accelerator, micro_batch_size: int, max_grad_norm: float) -> None:
        """Under tensor parallelism, `prepare` shards the model as it shards any
        other: `split_layers` made the split matrices DTensors, and transformers'
        hooks keep the replicated ones' gradients whole across the tensor-parallel
        ranks. Accelerate 1.15's own tensor-parallel step for FSDP2 (`_prepare_tp`)
        would redo the latter with a class transformers 5 no longer has
        (ImportError: ReplicateParallel), so the model's `prepare` skips it."""
        if tensor_parallel_size(accelerator) == 1:
            return
        prepare_tp = accelerator._prepare_tp
        accelerator._prepare_tp = lambda *args: (
            list(args) if any(isinstance(a, torch.nn.Module) for a in args) else prepare_tp(*args))

    def after_prepare(self, model: torch.nn.Module) -> None:
        use_gloo_collectives(model)

    def after_evaluation(self, model: torch.nn.Module) -> None:
        """FSDP2 keeps the root unit's parameters gathered after forward (the
        backward wants them at once); after an evaluation no backward frees them,
        and the rank would go on holding them whole (GPT-2's embedding: 206 MB
        at the 355 M shape) into the final save."""
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def shards_parameters(self, accelerator: Accelerator) -> bool:
        return accelerator.num_processes > 1

    def sampling_dtype(self, model: torch.nn.Module) -> torch.dtype:
        """Mixed precision's parameter dtype, which each unit's forward gathers its weights in."""
        state = model._get_fsdp_state() if hasattr(model, "_get_fsdp_state") else None
        policy = getattr(state, "_mp_policy", None)
        return getattr(policy, "param_dtype", None) or super().sampling_dtype(model)

    @contextmanager
    def generating(self, model: torch.nn.Module):
        """The root unit gathered for the whole generation: a PEFT model's
        `generate` runs the forwards of the base inside it, so the root's own
        hooks (which gather its parameters, e.g. the final norm) never fire. The
        layers gather and free themselves, forward by forward."""
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule):
            yield
            return
        # The root's state is set up by its first forward, which must come before any unit's:
        # an evaluation may generate before training ran one.
        model._get_fsdp_state()._lazy_init()
        model.unshard()
        try:
            yield
        finally:
            self.after_evaluation(model)

    def prepare_frozen(self, accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
        """Sharded like the trained model (the same units, mixed precision and
        loading), outside `prepare`: Accelerate's FSDP2 `prepare` wants an
        optimizer, and what it prepares it also checkpoints."""
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        if tensor_parallel_size(accelerator) > 1:
            raise UsageError("a frozen reference model (--method dpo without --peft) is not split over "
                             "tensor-parallel ranks; set parallelism_config_tp_size to 1 (`--config_file "
                             "$(finetune configs --path fsdp)` or `hsdp`)")
        model = fsdp2_prepare_model(accelerator, model.requires_grad_(False).eval())
        self.after_prepare(model)
        return model

    def verify_sharded(self, model: torch.nn.Module, accelerator: Accelerator) -> ShardReport:
        """Fail loudly when FSDP was asked for and the parameters are not laid
        out on the mesh the launch asked for: every parameter a DTensor, on a
        mesh of the asked sizes, each replica's ranks holding the whole model between them."""
        asked = asked_fsdp_mesh(accelerator)
        if accelerator.num_processes == 1:
            return shard_report(model, accelerator, asked)
        unsharded = [name for name, p in model.named_parameters() if not hasattr(p, "to_local")]
        if unsharded:
            raise NotDistributed(f"FSDP was asked for but {len(unsharded)} parameters are not sharded "
                                 f"(first: {unsharded[0]}); refusing to train unsharded")
        got = mesh_of(model) if self.fsdp_version == 2 else asked  # FSDP1's flat parameters carry no mesh
        if got != asked:
            raise NotDistributed(f"the launch asked for a mesh of {asked.describe()} ({asked.as_dict()}) but the "
                                 f"parameters are laid out as {got.describe()} ({got.as_dict()}); refusing to train")
        report = shard_report(model, accelerator, got)
        check_partition(report, "FSDP shards", replicas=got.dp_replicate)
        return report

    def units(self, model: torch.nn.Module) -> int:
        """The root included."""
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        return sum(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())

    def summary_facts(self, accelerator: Accelerator) -> dict:
        return {"fsdp_version": accelerator.state.fsdp_plugin.fsdp_version, "zero_stage": None}

    def layout_line(self, accelerator: Accelerator, shards: ShardReport, units: int) -> str:
        mesh = f" as {shards.mesh.describe()}" if shards.mesh.dp_replicate > 1 or shards.mesh.tp > 1 else ""
        return (f"{accelerator.distributed_type.value} on {accelerator.num_processes} process(es){mesh}, "
                f"{shards.total_params:,} parameters in {units} FSDP unit(s), per rank {shards.local_params_per_rank}")

    def weights_from_main_process(self, accelerator: Accelerator) -> bool:
        """fsdp_cpu_ram_efficient_loading under FSDP2: only the main process reads
        the weights; `prepare` shards the model on the meta device and sends every
        rank its shards from the main process's copy (Accelerate's
        fsdp2_load_full_state_dict). A run holds one full copy, not one per rank."""
        return (accelerator.num_processes > 1 and bool(accelerator.state.fsdp_plugin.cpu_ram_efficient_loading)
                and tensor_parallel_size(accelerator) == 1)  # tensor parallel: every rank loads, then splits

    def leave_loading_to_the_ranks(self, accelerator: Accelerator) -> None:
        accelerator.state.fsdp_plugin.cpu_ram_efficient_loading = False

    # --- checkpoints ----------------------------------------------------------------------------

    def check_checkpoint_files(self, checkpoint_dir: Path) -> None:
        check_dcp_dir(checkpoint_dir / MODEL_SHARDS_DIR)
        super().check_checkpoint_files(checkpoint_dir)

    def saved_shapes(self, checkpoint_dir: Path) -> dict[str, tuple[int, ...]]:
        metadata = check_dcp_dir(checkpoint_dir / MODEL_SHARDS_DIR)
        return {fqn.removeprefix("model."): tuple(meta.size) for fqn, meta in metadata.state_dict_metadata.items()
                if hasattr(meta, "size")}

    def export_weights(self, weights: Path) -> Weights:
        """From DCP shards (any number of ranks), only the byte ranges of the tensors asked for."""
        metadata = check_dcp_dir(weights)  # read without unpickling anything but DCP's metadata
        tensors = {fqn: meta for fqn, meta in metadata.state_dict_metadata.items()
                   if isinstance(meta, TensorStorageMetadata)}
        # Accelerate saves {"model": state_dict}: every key path is ("model", name).
        paths = metadata.planner_data or {}
        nested = tensors and all(len(paths.get(fqn, ())) == 2 and paths[fqn][0] == "model" for fqn in tensors)
        fqn_of = {(paths[fqn][1] if nested else fqn): fqn for fqn in tensors}

        def read_shards(names: list[str]) -> dict[str, torch.Tensor]:
            # Empty tensors of the saved shapes and dtypes, filled in place by DCP's public loader.
            part = {fqn_of[name]: torch.empty(tensors[fqn_of[name]].size, dtype=tensors[fqn_of[name]].properties.dtype)
                    for name in names}
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(part, storage_reader=dcp.FileSystemReader(str(weights)),
                         planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
            return {name: part[fqn_of[name]] for name in names}
        return Weights({name: (tensors[fqn].size, tensors[fqn].properties.dtype) for name, fqn in fqn_of.items()},
                       read_shards)

    # --- the planner ----------------------------------------------------------------------------

    @classmethod
    def strategy(cls, launch: dict, path: Path) -> str:
        fsdp = launch.get("fsdp_config", {}) or {}
        if fsdp.get("fsdp_offload_params"):
            return "FSDP + CPU offload (state in CPU RAM)"
        if fsdp.get("fsdp_activation_checkpointing"):
            return "FSDP + activation checkpointing"
        if fsdp.get("fsdp_reshard_after_forward") is False:
            return "FSDP SHARD_GRAD_OP"
        sizes = config_sizes(launch)
        replicas, tp = sizes.get("dp_replicate_size", 1), sizes.get("tp_size", 1)
        if replicas > 1 or tp > 1:
            return mesh_name((replicas, int(launch.get("num_processes", 2)) // (replicas * tp), tp))
        return "FSDP full shard"

    @classmethod
    def ram_efficient_loading(cls, launch: dict) -> bool:
        return bool((launch.get("fsdp_config") or {}).get("fsdp_cpu_ram_efficient_loading"))

    @classmethod
    def plan(cls, p: PlanInputs) -> list[Estimate]:
        """1/N of the state; while a unit computes, a gathered copy of it in the
        compute dtype (two with prefetch); SHARD_GRAD_OP keeps every unit
        gathered from forward to backward; offload moves the state to CPU RAM.
        HSDP: the state split over one replica's ranks only."""
        every_unit = p.shape.params * p.compute_bytes if p.num_processes > 1 else 0

        def sharded_over(ranks: int, strategy: str, gathered: int, activations: int, **kwargs) -> Estimate:
            trained = -(-(p.shape.trainable or p.shape.params) // ranks)  # ceil: FSDP pads the last shard
            reference = p.weight_bytes * -(-p.shape.params // ranks) if p.reference_whole else 0
            return Estimate(strategy, frozen_bytes(p.shape, p.weight_bytes, ranks) + p.trained_bytes * trained,
                            p.trained_bytes * trained, 2 * p.trained_bytes * trained, gathered, activations,
                            reference=reference, **kwargs)

        n, flat = p.num_processes, (1, p.num_processes, 1)
        rows = [sharded_over(n, "FSDP full shard", p.gather_units, p.activations, cpu_calibrated=True, mesh=flat),
                sharded_over(n, "FSDP SHARD_GRAD_OP", every_unit, p.activations, cpu_calibrated=True),
                sharded_over(n, "FSDP + activation checkpointing", p.gather_units, p.checkpointed_activations,
                             cpu_calibrated=True, mesh=flat),
                Estimate("FSDP + CPU offload (state in CPU RAM)", 0, 0, 0, p.gather_units, p.activations)]
        for mesh in p.meshes:
            replicas, shards, tp = mesh
            # The state split over one replica's ranks (its shards and tensor-parallel splits; the few
            # replicated vectors, norms and biases, counted as split too); each gathered unit is a tp-th.
            name = mesh_name(mesh)
            plain, checkpointed = p.split_activations.get(tp, (p.activations, p.checkpointed_activations))
            rows += [sharded_over(shards * tp, name, p.gather_units // tp, plain, mesh=mesh,
                                  no_peak_rss="not calibrated"),
                     sharded_over(shards * tp, f"{name} + activation checkpointing", p.gather_units // tp,
                                  checkpointed, mesh=mesh, no_peak_rss="not calibrated")]
        return rows


class FSDP1(FSDP2):
    """FullyShardedDataParallel with flat parameters (fsdp1.yaml), GPUs only
    (measured on CPU: FSDP1 rejects `cpu:0`, `fsdp_sync_module_states` finds
    no device). Same checkpoint layout and planner rows as FSDP2; Accelerate
    gathers its final state whole on the main process."""
    fsdp_version = 1
    mesh_dims = frozenset()

    @classmethod
    def requested(cls) -> bool:
        return fsdp_requested() and fsdp_version() == 1

    def after_prepare(self, model: torch.nn.Module) -> None:
        """FSDP1 takes no custom collectives."""

    # FSDP1's own state-dict hooks run after the wrapped model's and check that
    # every parameter is still there (one H200: the first save stopped with
    # FSDP's AssertionError on GPT-2's tied output layer): its checkpoints
    # store a tied parameter under each name, and a frozen base too.
    checkpoints_leave_out_stored_state = False

    frozen_model_refusal = ("finetune shards a frozen reference model under FSDP2 (and DeepSpeed), not FSDP1; "
                            "launch with `--config_file $(finetune configs --path fsdp)`")
    # Sampling runs transformers' generate on the sharded model: through FSDP2's per-layer
    # gathering only (FSDP1's root would need its flat parameters summoned, untested here).
    generation_refusal = ("--method grpo samples from the model as FSDP2 (and DDP, DeepSpeed) hold it, not FSDP1; "
                          "launch with `--config_file $(finetune configs --path fsdp)`")

    def weights_from_main_process(self, accelerator: Accelerator) -> bool:
        return False

    def gathers_whole_state(self, accelerator: Accelerator) -> bool:
        return True

    @classmethod
    def plan(cls, p: PlanInputs) -> list[Estimate]:
        return []  # FSDP2's rows: the same state per rank
