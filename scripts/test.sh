#!/usr/bin/env bash
# Installs what is missing, then runs the whole test suite (unit tests and real
# multi-process FSDP runs on CPU). Extra arguments go to pytest.
FINETUNE_EXTRAS=test source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m pytest "$@"
