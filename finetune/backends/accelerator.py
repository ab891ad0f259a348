"""Building the Accelerator for the backend the launch asked for, and the
checks that a run which asked for several processes really trains on them."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, ProjectConfiguration

from finetune.backends import requested_backend
from finetune.backends.base import Backend
from finetune.backends.mesh import check_requested_mesh
from finetune.errors import NotDistributed
from finetune.hardware import check_processes_fit_devices
from finetune.launch_request import has_accelerator_device, launched_world_size
from finetune.host_memory import keep_freed_memory_in_process
from finetune.liveness import end_with_launcher


def build_accelerator(gradient_accumulation_steps: int, seed: int, log_with: list | None = None,
                      run_dir: Path | None = None, timeout_s: int = 1800,
                      backend: Backend | None = None) -> Accelerator:
    """The Accelerator of `backend` (by default the one the launch asks for)."""
    backend = backend or requested_backend()
    end_with_launcher()
    check_processes_fit_devices()
    check_requested_mesh(launched_world_size(), backend.mesh_dims, type(backend).__name__, has_accelerator_device())
    backend.check_supported_here()
    if not has_accelerator_device():
        keep_freed_memory_in_process()
    process_group = backend.process_group(timedelta(seconds=timeout_s))
    accelerator = Accelerator(
        # The loop tells Accelerate where each step ends (train.train_step):
        # not from the data loader, which the loop reads a whole step ahead.
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=gradient_accumulation_steps,
                                                                sync_with_dataloader=False),
        # We step the LR schedule once per optimizer step ourselves, so the
        # schedule does not depend on the number of processes.
        step_scheduler_with_optimizer=False,
        # Data order depends on (seed, epoch) only: the same on every rank and
        # after a resume.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=seed),
        log_with=log_with or None,
        kwargs_handlers=[process_group],
        project_config=ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir)) if run_dir else None,
    )
    backend.after_accelerator()
    quiet_other_ranks(accelerator)

    if accelerator.num_processes != launched_world_size():
        raise NotDistributed(f"launched {launched_world_size()} processes but Accelerate sees {accelerator.num_processes}: "
                             "the ranks are not training together; refusing to train")
    backend.check_chosen(accelerator)
    return accelerator


def quiet_other_ranks(accelerator: Accelerator) -> None:
    """Only the main process reports progress and the warnings every rank would
    repeat; other ranks print errors and their own `[rank N]` warnings."""
    if accelerator.is_main_process:
        return
    import warnings

    import datasets
    import transformers

    warnings.filterwarnings("ignore")
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()


