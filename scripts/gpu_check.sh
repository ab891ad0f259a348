#!/usr/bin/env bash
# End to end on the GPUs of this machine, for the configs CI (CPU only) cannot
# run: train with a checkpoint, resume to more steps, export, generate and
# evaluate, under each accelerate config named (default: the GPU-only ones,
# bf16 FSDP2, and QLoRA under FSDP2). CONFIG.yaml:PEFT adds --peft PEFT. One
# process per GPU. Prints one line per stage and the facts of each run's
# summary.json; stops at the first failure.
#   bash scripts/gpu_check.sh [CONFIG.yaml[:lora|:qlora] ...]
#   FINETUNE_GPU_CHECK_MODEL=small-gpt2 FINETUNE_GPU_CHECK_STEPS=20 bash scripts/gpu_check.sh
# Uses $PYTHON (default: python3 on PATH) as it is (run scripts/_env.sh first on a new machine).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
MODEL="${FINETUNE_GPU_CHECK_MODEL:-small-gpt2}"
STEPS="${FINETUNE_GPU_CHECK_STEPS:-20}"
OUT="${FINETUNE_GPU_CHECK_DIR:-outputs/gpu-check}"
GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
if [ "$GPUS" -lt 1 ]; then
    echo "error: no GPU visible to torch; this script checks the GPU-only paths (CI covers the CPU ones)" >&2
    exit 2
fi
"$PY" -c 'import torch; print(f"torch {torch.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")'
configs=("$@")
[ ${#configs[@]} -gt 0 ] || configs=(fsdp.yaml fsdp1.yaml fsdp_offload.yaml fsdp.yaml:qlora)
mkdir -p "$OUT"

stage() {  # stage NAME COMMAND...: run, time, and stop the script on failure
    local name="$1"; shift
    local start=$SECONDS
    if ! "$@" >"$OUT/$name.log" 2>&1; then
        echo "FAILED $name (the whole output: $OUT/$name.log):"
        grep -E "error:|Error" "$OUT/$name.log" | grep -v -E "ChildFailedError|elastic" | tail -10; exit 1
    fi
    echo "ok     $name ($((SECONDS - start)) s)"
}

for case in "${configs[@]}"; do
    config="${case%%:*}"
    peft=(); [ "$case" = "$config" ] || peft=(--peft "${case#*:}")
    name="${config%.yaml}${peft[1]:+-${peft[1]}}"
    run="$OUT/$name"
    rm -rf "$run" "$run-export"
    launch=("$PY" -m accelerate.commands.launch --config_file "accelerate_configs/$config" --num_processes "$GPUS")
    stage "$name-train" "${launch[@]}" -m finetune train --model "$MODEL" --max_steps "$STEPS" "${peft[@]}" \
        --checkpoint_every $((STEPS / 2)) --eval_every $((STEPS / 2)) --output_dir "$run" --sample_prompt ""
    stage "$name-resume" "${launch[@]}" -m finetune resume "$run" --max_steps $((STEPS + STEPS / 2))
    stage "$name-export" "$PY" -m finetune export "$run" --output "$run-export" --dtype bfloat16
    stage "$name-generate" "$PY" -m finetune generate "$run-export" --prompt "Return the"
    stage "$name-evaluate" "$PY" -m finetune evaluate "$run-export"
    "$PY" - "$run" <<'EOF'
import json, sys
s = json.load(open(f"{sys.argv[1]}/summary.json"))
keys = ("distributed_type", "fsdp_version", "mixed_precision", "world_size", "steps", "final_loss", "total_params",
        "local_params_per_rank", "state_bytes_per_rank", "peak_memory_bytes_per_rank", "train_time_s")
print("       " + ", ".join(f"{k}={s[k]}" for k in keys))
print(f"       last eval {s['last_eval']}")
EOF
    tail -1 "$OUT/$name-evaluate.log"
done
