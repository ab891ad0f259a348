# Sourced by quickstart.sh and test.sh: makes (or reuses) a virtual environment
# with torch pinned first, then this package, its dependencies and the extras
# the sourcing script names (each script installs only what it needs).
#   FINETUNE_EXTRAS         set by the sourcing script: "gguf" (quickstart) or "test" (the suite)
#   FINETUNE_VENV           where the venv lives (default: .venv in the repo)
#   FINETUNE_TORCH_VERSION  the torch release to install when none is present (default 2.13.0)
# torch is installed on its own, pinned, so that no other package's range pulls
# the newest multi-GB build. On a CPU machine that release is the CPU build; on
# a GPU machine pip picks the matching CUDA build.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FINETUNE_VENV:-$REPO/.venv}"
TORCH_VERSION="${FINETUNE_TORCH_VERSION:-2.13.0}"
# DeepSpeed (an extra) compiles its kernels when first used, not at install:
# installing it needs no CUDA toolkit.
export DS_BUILD_OPS="${DS_BUILD_OPS:-0}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtual environment $VENV"
    python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

if ! python -c "import torch" 2>/dev/null; then
    echo "[setup] installing torch==$TORCH_VERSION"
    python -m pip install --disable-pip-version-check -q "torch==$TORCH_VERSION"
fi

# One stamp per set of extras: the suite's venv also serves the quickstart, not the reverse.
extras="${FINETUNE_EXTRAS:?the sourcing script names its extras}"
stamp="$VENV/.finetune-deps-$extras"
want="$(sha256sum "$REPO/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] && [ "$(cat "$VENV/.finetune-deps-test" 2>/dev/null)" != "$want" ] \
        || ! python -c "import finetune" 2>/dev/null; then
    echo "[setup] installing finetune and its dependencies, with the extras [$extras]"
    python -m pip install --disable-pip-version-check -q -e "$REPO[$extras]"
    echo "$want" > "$stamp"
fi
cd "$REPO"
