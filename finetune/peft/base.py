"""What every PEFT method answers (`--peft none | lora | qlora`), with
the answers of a full fine-tune: every parameter trains and the model is
saved whole. A parameter-efficient method (finetune/peft/lora.py) overrides
what it does differently; the task, the loop, the checkpoints, the final
model, the export and the planner ask it instead of comparing strings."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar

import torch

from finetune.model_dir import TIED_FILE

# A checkpoint's model_config/ file naming the parameters that did not train (and so were not saved).
FROZEN_FILE = "frozen_parameters.json"

if TYPE_CHECKING:
    from accelerate import Accelerator

    from finetune.config import TrainConfig
    from finetune.model_dir import Weights

class FullFineTune:
    name: ClassVar[str] = "none"
    extra: ClassVar[str] = ""  # the pip extra it needs
    each_rank_loads_the_base: ClassVar[bool] = False  # no weights sent from the main process (QLoRA's 4-bit copy)
    four_bit_bytes_per_weight: ClassVar[float] = 0.0  # the planner's size of a weight it holds in 4 bits
    saves_adapters: ClassVar[bool] = False  # its checkpoints hold adapters, not the base: exports build the base again
    # How a preference run does without a frozen copy of the model.
    without_a_reference_copy: ClassVar[str] = "pass --peft lora (the reference is then the base with the adapters off)"

    def __init__(self, cfg: "TrainConfig | None" = None):
        self.cfg = cfg
        self.base_record: dict | None = None  # the frozen base's origin, shapes and fingerprint, where there is one

    # --- the run --------------------------------------------------------------------------------

    def check_supported_here(self) -> None:
        """Before any process group starts: one line for what this machine cannot run."""

    def check_backend(self, accelerator: "Accelerator") -> None:
        """One line for a launch this method cannot run under."""

    def wrap(self, model: torch.nn.Module, source: str, accelerator: "Accelerator",
             record_base: bool) -> torch.nn.Module:
        """The model to train, from the base loaded from `source`."""
        return model

    def summary_facts(self) -> dict:
        """summary.json's record of the method."""
        return {"peft": self.name}

    def trainable_note(self, trainable: int) -> str:
        """What the start line adds about the parameters that train."""
        return ""

    def adapters_off(self, model: torch.nn.Module):
        """A context in which the model computes without what this method added
        (a reference model for preference tuning). A full fine-tune added nothing:
        the frozen reference is a copy of the model, not this one."""
        return nullcontext()

    def added_by_peft(self, name: str) -> bool:
        """Whether a parameter is not the base's but this method's (not in the pretrained files)."""
        return False

    # --- checkpoints ----------------------------------------------------------------------------

    def write_checkpoint_files(self, model_files: Path, model: torch.nn.Module, tied: dict[str, str]) -> None:
        """What an offline export needs besides the weights and the HF config,
        into a checkpoint's model_config/: the parameters that share a tensor,
        and those frozen (a vision tower kept as loaded), which checkpoints
        leave out: an export reads them from the run's --model."""
        from finetune.parameters import canonical_name

        (model_files / TIED_FILE).write_text(json.dumps(tied, indent=2))
        frozen = [canonical_name(name) for name, p in model.named_parameters() if not p.requires_grad]
        if frozen:
            (model_files / FROZEN_FILE).write_text(json.dumps(frozen, indent=2))

    def needs_base(self, model_files: Path) -> bool:
        """Whether an export of this checkpoint builds the run's base too (for what the checkpoint left out)."""
        return self.saves_adapters or (model_files / FROZEN_FILE).is_file()

    def check_checkpoint(self, model_files: Path, checkpoint_dir: Path) -> None:
        """A resume's check that the checkpoint was written for this run's base."""

    def check_base_before_launch(self, task, model_files: Path, checkpoint_dir: Path) -> None:
        """The same check, before any process starts, where it needs no weights loaded."""

    # --- the final model and the export ---------------------------------------------------------

    def final_weights(self, specs: dict[str, tuple[torch.Size, torch.dtype]], fetch: Callable,
                      model: torch.nn.Module, base: Callable[[], torch.nn.Module]) -> "Weights":
        """The tensors of the model to save, read through `fetch(names)` (whole
        tensors, under the trained model's names `specs` describes). `base()`
        builds the base again (the weights it started from) where a method needs it."""
        from finetune.model_dir import Weights

        return Weights(specs, fetch)

    @staticmethod
    def wrote(model_files: Path) -> bool:
        """Whether a checkpoint's model_config/ holds this method's own files (a full fine-tune has none)."""
        return False

    def export_weights(self, checkpoint_dir: Path, weights: "Weights", base: Callable[[], torch.nn.Module],
                       base_source: str) -> "Weights":
        """The checkpoint's model for `finetune export`; `base()` builds the
        run's base from `base_source`, for the frozen parameters the checkpoint left out."""
        from finetune.model_dir import MODEL_CONFIG_DIR, Weights
        from finetune.parameters import canonical_name

        frozen_file = checkpoint_dir / MODEL_CONFIG_DIR / FROZEN_FILE
        if not frozen_file.is_file():
            return weights
        frozen = [name for name in json.loads(frozen_file.read_text()) if name not in weights.specs]
        loaded = {canonical_name(name): t for name, t in base().state_dict().items()}
        kept = {name: loaded[name] for name in frozen}
        return Weights({**weights.specs, **{name: (t.shape, t.dtype) for name, t in kept.items()}},
                       lambda names: {**weights.fetch([n for n in names if n not in kept]),
                                      **{n: kept[n].detach().to("cpu") for n in names if n in kept}})

    def export_adapter(self, checkpoint_dir: Path, weights: "Weights", output: Path) -> Path:
        """The adapters alone (`--adapter_only`), where the method `saves_adapters`."""
        raise NotImplementedError

    # --- the planner ----------------------------------------------------------------------------

    def plan_model(self, model: torch.nn.Module, num_processes: int) -> tuple[torch.nn.Module, int]:
        """The model (on the meta device) as this method trains it, and how many
        of its frozen weights it holds in 4 bits."""
        return model, 0
