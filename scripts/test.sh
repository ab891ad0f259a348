#!/usr/bin/env bash
# Installs what is missing, then runs the whole test suite (unit tests and real
# multi-process FSDP runs on CPU). Extra arguments go to pytest.
#   FINETUNE_TEST_WORKERS  test files run at once (default 2; 0 runs them in this process)
# Two workers keep both cores busy: much of a run is one process starting up.
# The tests marked `alone` hold the 355 M model's resident sets against tight
# bounds and take GBs: they run first, with only the light files
# (conftest.BESIDE_THE_ALONE) beside them.
FINETUNE_EXTRAS=test source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
workers="${FINETUNE_TEST_WORKERS:-2}"
python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder -m "alone or beside_alone" "$@" \
    || [ $? -eq 5 ]  # 5: the arguments selected none of them
python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder -m "not alone and not beside_alone" "$@"
