"""DeepSpeed ZeRO-1/2/3 through Accelerate (zero1/2/3.yaml, each naming its
DeepSpeed JSON), on GPUs or over gloo on CPU.

What the run decides is filled into DeepSpeed's config before `prepare`
(`fit_to_run`). Checkpoints are DeepSpeed's own partition files under
`pytorch_model/`: torch.save pickles that DeepSpeed loads with
`weights_only=False`, so every file is checked first with `weights_only=True`
and the three DeepSpeed classes they hold, and DeepSpeed then reads them under
`loading_checkpoint()`, which forces the same. They resume on the world size
that wrote them only; `finetune export` consolidates them with DeepSpeed's
own zero_to_fp32.
"""

from __future__ import annotations

import copy

import json
import os
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs

from finetune.backends.base import Backend, PlanInputs, ShardReport, check_partition, shard_report
from finetune.backends.mesh import Mesh
from finetune.errors import NotDistributed, UsageError
from finetune.estimates import Estimate
from finetune.launch_request import deepspeed_requested, has_accelerator_device, launched_world_size
from finetune.model_dir import Weights
from finetune.parameters import full_numel, tally
from finetune.verify import check_pickled_file

DEEPSPEED_DIR = "pytorch_model"  # what DeepSpeed's save_checkpoint writes under Accelerate's save_state
INSTALL = "`DS_BUILD_OPS=0 pip install 'deepspeed>=0.19'`"


def pickled_classes() -> tuple:
    """What DeepSpeed's checkpoint files hold besides tensors and plain values:
    its loss scaler, its ZeRO stage enum and where each fp32 fragment sits."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return LossScaler, ZeroStageEnum, fragment_address


@contextmanager
def loads_weights_only():
    """DeepSpeed's own loading (resume, consolidation) with every torch.load
    forced to weights_only, allowing DeepSpeed's classes only."""
    before = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(list(pickled_classes())):
            yield
    finally:
        if before is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = before


def find_config_file() -> None:
    """The shipped zero*.yaml name their DeepSpeed JSON by file name: a path
    from the working directory when there is one, else the shipped file of
    that name (so the configs work from any directory)."""
    from finetune.launch_configs import CONFIG_DIR

    named = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not named or named == "none" or Path(named).is_file():
        return
    if (CONFIG_DIR / Path(named).name).is_file() and Path(named).name == named:
        os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(CONFIG_DIR / named)
        return
    raise UsageError(f"deepspeed_config_file {named} (from the accelerate config) does not exist; give its path from "
                     "the working directory, or launch with `--config_file $(finetune configs --path zero2)`")


def zero_stage_of(launch: dict, config_path: Path) -> int:
    """The ZeRO stage of an accelerate config: from the DeepSpeed JSON it names
    (next to it, from the working directory, or shipped), else its zero_stage."""
    from finetune.launch_configs import CONFIG_DIR

    deepspeed = launch.get("deepspeed_config") or {}
    named = deepspeed.get("deepspeed_config_file")
    if not named:
        return int(deepspeed.get("zero_stage", 2))
    for candidate in (config_path.parent / named, Path(named), CONFIG_DIR / Path(named).name):
        if candidate.is_file():
            try:
                return int(json.loads(candidate.read_text())["zero_optimization"]["stage"])
            except (ValueError, KeyError, TypeError):
                break
    raise UsageError(f"cannot read the ZeRO stage from {named} (named by {config_path}); pass a DeepSpeed JSON with "
                     "zero_optimization.stage")


class DeepSpeed(Backend):
    layout = "DeepSpeed"
    written_as = "under DeepSpeed"
    run_is = "a DeepSpeed run"
    example_config = "zero2"
    weights_name = DEEPSPEED_DIR
    weights_described = f"{DEEPSPEED_DIR}/ from DeepSpeed"

    @classmethod
    def requested(cls) -> bool:
        return deepspeed_requested()

    @classmethod
    def wrote(cls, checkpoint_dir: Path) -> bool:
        return (checkpoint_dir / DEEPSPEED_DIR).is_dir()

    @classmethod
    def holds_weights(cls, path: Path) -> bool:
        return path.name == DEEPSPEED_DIR and path.is_dir()

    @classmethod
    def runs_launch_config(cls, launch: dict) -> bool:
        return launch.get("distributed_type") == "DEEPSPEED"

    @staticmethod
    def zero_stage(accelerator: Accelerator) -> int:
        return int(accelerator.state.deepspeed_plugin.zero_stage)

    # --- building and preparing -----------------------------------------------------------------

    def import_libraries(self) -> None:
        """Imported with the other imports, so that the run's memory phases
        measure what they say (the load phase: the weights), and Accelerate's
        unwrap (which imports it anyway) finds it."""
        import deepspeed  # noqa: F401

    def check_supported_here(self) -> None:
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            raise UsageError(f"the accelerate config asks for DeepSpeed, which is not installed; {INSTALL}, "
                             "or launch with an FSDP config") from None
        find_config_file()

    def process_group(self, timeout: timedelta) -> InitProcessGroupKwargs:
        if not has_accelerator_device() and launched_world_size() > 1:
            # DeepSpeed's own process group: without a backend named, Accelerate
            # finds no device and leaves every CPU rank alone.
            return InitProcessGroupKwargs(backend="gloo", timeout=timeout)
        return InitProcessGroupKwargs(timeout=timeout)

    def shards_parameters(self, accelerator: Accelerator) -> bool:
        return self.zero_stage(accelerator) == 3 and accelerator.num_processes > 1

    def whole_parameters(self, model: torch.nn.Module, wanted):
        """ZeRO-3's partitions gathered one parameter at a time with its own API
        (as TRL's ds3_gather_for_generation), copied out before it frees them."""
        import deepspeed

        for name, p in model.named_parameters():
            if wanted(name):
                with deepspeed.zero.GatheredParameters([p]):
                    yield name, p.detach().clone()

    def prepare_frozen(self, accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
        """ZeRO-1/2 keep every parameter on every rank, and so does the reference.
        Under ZeRO-3 transformers built it partitioned (zero.Init), like the
        policy: an engine of its own, without optimizer, gathers its layers in
        each forward."""
        model = model.requires_grad_(False).eval()
        if self.zero_stage(accelerator) != 3:
            return model.to(accelerator.device)
        import deepspeed

        config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
        for trains in ("optimizer", "scheduler"):
            config.pop(trains, None)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()  # the engine's eval returns nothing
        return engine

    def check_chosen(self, accelerator: Accelerator) -> None:
        if accelerator.distributed_type != DistributedType.DEEPSPEED:
            raise NotDistributed(f"the accelerate config asks for DeepSpeed but Accelerate chose "
                                 f"{accelerator.distributed_type.value}; refusing to train without it")

    def fit_to_run(self, accelerator: Accelerator, micro_batch_size: int, max_grad_norm: float) -> None:
        """The micro-batch (Accelerate reads it from a prepared loader only when
        the model is prepared with one) and the clipping norm (DeepSpeed clips at
        1.0 unless told otherwise; 0 turns it off)."""
        plugin = accelerator.state.deepspeed_plugin
        config = plugin.deepspeed_config
        config["train_micro_batch_size_per_gpu"] = micro_batch_size
        config["train_batch_size"] = micro_batch_size * accelerator.gradient_accumulation_steps * accelerator.num_processes
        config["gradient_clipping"] = float(max_grad_norm or 0.0)
        if plugin.zero_stage == 3:  # the end-of-run model is gathered from the partitions
            config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True

    def verify_sharded(self, model: torch.nn.Module, accelerator: Accelerator) -> ShardReport:
        n = accelerator.num_processes
        # ZeRO-3 splits the parameters over every rank; stages 1 and 2 keep them whole on each.
        mesh = Mesh(dp_shard=n) if self.zero_stage(accelerator) == 3 else Mesh(dp_replicate=n)
        report = shard_report(model, accelerator, mesh)
        if self.zero_stage(accelerator) == 3 and n > 1:
            check_partition(report, "ZeRO-3 partitions")
        return report

    def layout_line(self, accelerator: Accelerator, shards: ShardReport, units: int) -> str:
        stage = self.zero_stage(accelerator)
        partitioned = {1: "optimizer state", 2: "optimizer state and gradients"}.get(stage)
        if partitioned is None:  # ZeRO-3: the parameters too
            return (f"{accelerator.distributed_type.value} ZeRO-3 on {accelerator.num_processes} process(es), "
                    f"{shards.total_params:,} parameters, per rank {shards.local_params_per_rank}")
        return (f"{accelerator.distributed_type.value} ZeRO-{stage} on {accelerator.num_processes} process(es), each "
                f"holding all {shards.total_params:,} parameters ({partitioned} partitioned)")

    def summary_facts(self, accelerator: Accelerator) -> dict:
        return {"fsdp_version": None, "zero_stage": self.zero_stage(accelerator)}

    @contextmanager
    def models_built_whole(self, accelerator: Accelerator):
        """While a ZeRO-3 config is active, transformers builds every model under
        DeepSpeed's zero.Init, which partitions it over the ranks: a collective.
        Inside this, the main process alone can build an empty model (the
        end-of-run writing does)."""
        if self.zero_stage(accelerator) != 3:
            yield
            return
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        try:
            yield
        finally:
            accelerator.state.deepspeed_plugin.set_deepspeed_weakref()

    def end_training(self, accelerator: Accelerator) -> None:
        """Models built afterwards in this process (the sample from the final
        model) are built whole again."""
        accelerator.end_training()
        if self.zero_stage(accelerator) == 3:
            from transformers.integrations import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()

    # --- what a rank holds ----------------------------------------------------------------------

    measures_state_after_first_step = False  # each group's gradient is freed as the next one steps

    def state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, int]]:
        """`optimizer` is the one inside the ZeRO optimizer, which steps one
        group of this rank's fp32 master partitions at a time and frees each
        group's gradient right after: measure any time after the first step. The
        masters count as optimizer state (as the ZeRO paper counts them). The
        gradients are what the stage keeps between backward and step: ZeRO-1
        accumulates them whole in the model's parameters, ZeRO-2/3 only this
        rank's partition (the masters' size, in the model's dtype). A ZeRO-3
        parameter holds only its partition (`ds_tensor`)."""
        params = [getattr(p, "ds_tensor", p) for p in model.parameters()]
        moments = [v for state in optimizer.state.values() for v in state.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0]
        stage = model.zero_optimization_stage()
        masters = list(optimizer.state)  # the partitions the inner optimizer stepped, keyed as its state
        trainable = [p for p in model.parameters() if p.requires_grad]
        grad_elements = sum(full_numel(p) for p in trainable) if stage == 1 else sum(m.numel() for m in masters)
        element_size = trainable[0].element_size() if trainable else 0
        grads = {"elements": grad_elements, "bytes": grad_elements * element_size}
        return {"params": tally(params), "grads": grads, "optimizer": tally([*moments, *masters])}

    def gathers_whole_state(self, accelerator: Accelerator) -> bool:
        return self.zero_stage(accelerator) == 3

    # --- checkpoints ----------------------------------------------------------------------------

    def check_checkpoint_files(self, checkpoint_dir: Path) -> None:
        """DeepSpeed's files, each loadable with weights_only and DeepSpeed's classes."""
        try:
            allowed = pickled_classes()
        except ImportError:
            raise UsageError(f"{checkpoint_dir} is a DeepSpeed checkpoint and DeepSpeed is not installed; "
                             f"{INSTALL}") from None
        files = sorted((checkpoint_dir / DEEPSPEED_DIR).glob("*.pt"))
        if not any(f.name.endswith("model_states.pt") for f in files):
            raise UsageError(f"{checkpoint_dir / DEEPSPEED_DIR} holds no DeepSpeed model states; the checkpoint is "
                             "incomplete, resume from an earlier one")
        for path in files:
            check_pickled_file(path, allowed)

    def saved_shapes(self, checkpoint_dir: Path) -> dict[str, tuple[int, ...]]:
        """Read from the model states file (checked by check_checkpoint_files)."""
        states = sorted((checkpoint_dir / DEEPSPEED_DIR).glob("*model_states.pt"))[0]
        with torch.serialization.safe_globals(list(pickled_classes())):
            saved = torch.load(states, map_location="cpu", weights_only=True, mmap=True)
        groups = [*(saved.get("param_shapes") or []), saved.get("frozen_param_shapes") or {}]
        return {name: tuple(shape) for group in groups for name, shape in group.items()}

    def check_resume_world_size(self, checkpoint_dir: Path, written_by: int, num_processes: int) -> None:
        if written_by != num_processes:
            raise UsageError(f"{checkpoint_dir} was written by {written_by} DeepSpeed rank(s) and this run has "
                             f"{num_processes}: DeepSpeed checkpoints resume on the same number of processes; "
                             f"relaunch with --num_processes {written_by}, or export it and start from the "
                             "export with --model")

    def loading_checkpoint(self):
        return loads_weights_only()

    def export_weights(self, weights: Path) -> Weights:
        """Consolidated whole in memory, in fp32, by DeepSpeed's own zero_to_fp32."""
        checkpoint_dir = weights.parent
        self.check_checkpoint_files(checkpoint_dir)
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with loads_weights_only():
            state_dict = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=DEEPSPEED_DIR)
        return Weights.in_memory(state_dict)

    # --- relaunching ----------------------------------------------------------------------------

    @staticmethod
    def launch_files() -> dict:
        """The DeepSpeed JSON the config names, by content, as this process found it (find_config_file)."""
        named = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
        if named != "none" and Path(named).is_file():
            return {"deepspeed_config": json.loads(Path(named).read_text())}
        return {}

    @staticmethod
    def write_launch_files(launch: dict, config: dict, scratch: Path) -> dict:
        if launch.get("deepspeed_config") is None:
            return config
        deepspeed_file = scratch / "deepspeed_config.json"
        deepspeed_file.write_text(json.dumps(launch["deepspeed_config"], indent=2))
        return {**config, "deepspeed_config": {**config.get("deepspeed_config", {}),
                                               "deepspeed_config_file": str(deepspeed_file)}}

    # --- the planner ----------------------------------------------------------------------------

    @classmethod
    def strategy(cls, launch: dict, path: Path) -> str:
        return f"DeepSpeed ZeRO-{zero_stage_of(launch, path)}"

    @classmethod
    def plan(cls, p: PlanInputs) -> list[Estimate]:
        """DeepSpeed's engine holds the trained weights in the compute dtype and,
        next to them, an fp32 master partition with the two AdamW moments (12
        bytes per element per rank); ZeRO-1 keeps whole gradients, ZeRO-2
        partitions them, ZeRO-3 the weights too. Checked against the engine in
        tests/e2e/test_deepspeed.py; the CPU resident set is not calibrated."""
        n, t = p.num_processes, p.shape.trainable or p.shape.params
        model_bytes = 2 if p.mixed_precision == "bf16" else 4
        whole, part, optimizer = model_bytes * t, model_bytes * -(-t // n), 12 * -(-t // n)
        return [Estimate("DeepSpeed ZeRO-1", p.frozen_whole + whole, whole, optimizer, 0, p.activations,
                         no_peak_rss="not calibrated", reference=p.reference_whole),
                Estimate("DeepSpeed ZeRO-2", p.frozen_whole + whole, part, optimizer, 0, p.activations,
                         no_peak_rss="not calibrated", reference=p.reference_whole),
                Estimate("DeepSpeed ZeRO-3", p.frozen_shard + part, part, optimizer, p.gather_units, p.activations,
                         no_peak_rss="not calibrated", reference=p.reference_shard)]
