"""The trained model as a Hugging Face model dir (`RUN_DIR/final`): the
backend says how the ranks hand over the tensors, the PEFT method what
is saved (adapters merged into their base), and model_dir.py
writes the files. `finetune export` writes a checkpoint through the same two
questions (finetune/export.py)."""

from __future__ import annotations

from pathlib import Path

from finetune.collectives import WriteFailed, on_every_rank, serve_full_tensors
from finetune.config import byte_count, data_options
from finetune.errors import UsageError, write_failure_fix
from finetune.model_dir import write_model_dir
from finetune.parameters import canonical_name


def write_final_model(run) -> Path:
    """`run` is a finetune.train.Run. Written by the main process one output
    file at a time (`--max_shard_size`): the ranks gather the tensors of each
    file as it is written, so no rank ever holds the whole state; where the
    backend gathers the whole state at once (FSDP1, ZeRO-3), Accelerate does
    so on the main process first."""
    acc, backend, peft = run.accelerator, run.backend, run.task.peft
    final_dir = run.run_dir / "final"
    live_model = acc.unwrap_model(run.model)
    hf_config = live_model.config
    write_options = dict(tokenizer=run.data.saved_with_model, run_data=data_options(run.cfg.to_dict(), acc.num_processes),
                         max_shard_size=byte_count(run.cfg.max_shard_size), overwrite=True)

    def base():  # the weights the run started from, whole, on the main process
        return run.task.base_model(run.data.tokenizer)

    if backend.gathers_whole_state(acc):
        # Wrappers (torch.compile under `accelerate launch --dynamo_backend`) can leave their names in the keys.
        state = {canonical_name(name): tensor for name, tensor in (acc.get_state_dict(run.model) or {}).items()}

        def write() -> None:
            if acc.is_main_process:
                weights = peft.final_weights({name: (t.shape, t.dtype) for name, t in state.items()},
                                               lambda names: {name: state[name] for name in names}, live_model, base)
                write_model_dir(weights, hf_config, final_dir, **write_options)
    else:  # FSDP2 (DTensor shards), whole parameters on every rank (DDP, ZeRO-1/2) or one process
        tensors = {canonical_name(name): t for name, t in live_model.state_dict().items()}
        specs = {name: (t.shape, t.dtype) for name, t in tensors.items()}

        def write() -> None:
            serve_full_tensors(acc, tensors, lambda fetch: write_model_dir(
                peft.final_weights(specs, fetch, live_model, base), hf_config, final_dir, **write_options))
    try:
        with backend.models_built_whole(acc):
            on_every_rank(acc, write)
    except WriteFailed as e:
        raise UsageError(f"could not write {final_dir} ({e}); the final checkpoint holds the trained model: "
                         f"{write_failure_fix(str(e), run.run_dir)}, then `finetune export {run.run_dir} --output DIR`"
                         ) from None
    return final_dir
