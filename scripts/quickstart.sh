#!/usr/bin/env bash
# The main job, from a fresh machine: install what is missing, then fine-tune a
# small GPT-2 with FSDP on the built-in corpus (docstrings of the Python
# standard library, built offline), with sharded checkpoints, the final model
# consolidated into outputs/quickstart-*/final, and a sample printed from it.
# Uses all GPUs where there are GPUs, else 2 processes on CPU.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
export TOKENIZERS_PARALLELISM=false

launch=(--config_file accelerate_configs/fsdp.yaml)
gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU" || true)
if [ "${gpus:-0}" -gt 0 ]; then
    launch+=(--num_processes "$gpus")
else
    launch+=(--num_processes 2)
    # bf16 is the config's default; CPUs without native bf16 run it far slower than fp32.
    if ! python -c "import sys; from finetune.distributed import cpu_has_native_bf16; sys.exit(not cpu_has_native_bf16())"; then
        echo "[quickstart] this CPU has no native bf16: training in fp32"
        launch+=(--mixed_precision no)
    fi
fi

run_dir="outputs/quickstart-$(date +%Y%m%d-%H%M%S)"
accelerate launch "${launch[@]}" -m finetune train \
    --model small-gpt2 --dataset builtin \
    --max_steps 150 --learning_rate 3e-3 --per_device_batch_size 8 --block_size 128 \
    --eval_every 50 --checkpoint_every 75 --keep_last 2 \
    --sample_prompt "Return the" \
    --output_dir "$run_dir" "$@"
