#!/usr/bin/env bash
# Packed SFT on one GPU, our attention paths and kernels against TRL's
# SFTTrainer (padding_free), on a Llama-3.2-1B and a Qwen2.5-0.5B shape built
# from a seed: scripts/gpu_bench.py says what each case runs. Aims at 8 minutes
# or less on one H100 or H200, with no network.
#
# What the device needs beyond this repo's install (carry the wheels; no network there):
#   trl            (pip download trl --no-deps)              TRL's row
#   liger-kernel   (pip download liger-kernel --no-deps)     the Liger row (its triton comes with CUDA torch)
#   flash-attn     (a wheel built for the device's torch and CUDA; optional)   the varlen row
#   torchao        (the qlora extra)                          the QLoRA row
#   vllm           (a wheel for the device's torch and CUDA)      the GRPO vllm rows (ours and TRL's colocate mode)
# A row whose package is missing says so instead of failing.
#
#   bash scripts/gpu_bench.sh            # the full run: outputs/gpu-bench/table.md
#   bash scripts/gpu_bench.sh --smoke    # the same code paths on CPU, a tiny model, about a minute (the suite runs it)
# Uses $PYTHON (default: python3 on PATH) as it is (run scripts/_env.sh first on a new machine).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" scripts/gpu_bench.py "$@"
