#!/usr/bin/env bash
# Installs what is missing, then runs the whole test suite (unit tests and real
# multi-process FSDP runs on CPU). Extra arguments go to pytest.
#   bash scripts/test.sh           the whole suite (what CI runs)
#   bash scripts/test.sh --quick   what runs in this process alone, nothing launched (the edit-test loop)
#   FINETUNE_TEST_WORKERS  test files run at once (default 2; 0 runs them in this process)
# Two workers keep both cores busy: much of a run is one process starting up.
# The tests marked `alone` hold runs' resident sets against tight bounds and
# take GBs: they run first, with only the files that launch nothing beside them
# (tests/conftest.py says how files are ordered).
FINETUNE_EXTRAS=test source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
workers="${FINETUNE_TEST_WORKERS:-2}"
if [ "${1:-}" = "--quick" ]; then
    shift
    exec python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder -m "not slow and not alone" "$@"
fi
# The whole suite (no arguments) ends with its CPU-seconds by file, checked against tests/budget.json.
report=""
if [ $# -eq 0 ]; then
    report="$(mktemp)"
    trap 'rm -f "$report"' EXIT
fi
export FINETUNE_CPU_REPORT="$report"
python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder -m "alone or beside_alone" "$@" \
    || [ $? -eq 5 ]  # 5: the arguments selected none of them
status=0
python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder -m "not alone and not beside_alone" "$@" \
    || status=$?
if [ -n "$report" ]; then  # the table also after a failure: it says where the time went
    python tests/budget.py "$report" || status=$((status ? status : 1))
fi
exit "$status"
