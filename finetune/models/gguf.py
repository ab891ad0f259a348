"""GGUF files (llama.cpp's format) as HF model dirs.

transformers reads a GGUF file itself and dequantises it into a dense model
(the optional `gguf` package does the reading), but marks the result as
quantized and refuses to save it. So the dense weights go into a plain model
built from the same config, which is saved, with the tokenizer and its chat
template, into a cache dir keyed by the file's content: every later run (and
every rank) loads that dir in a second instead of converting again.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import struct
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from finetune.data.builtin import cache_root
from finetune.errors import UsageError, not_a_file
from finetune.launch_request import no_deepspeed_engine


def is_gguf(name_or_path: str) -> bool:
    return name_or_path.lower().endswith(".gguf")


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


# Far above any model's (SmolLM2: 272 tensors, 36 keys), far below what a crafted header could ask to allocate.
MAX_GGUF_ENTRIES = 1 << 20


def check_gguf_header(path: Path) -> None:
    """The fixed header of a GGUF file (magic, version, tensor and key counts),
    checked before a reader trusts its counts."""
    with path.open("rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != b"GGUF":
        raise UsageError(f"{path} is not a GGUF file (no GGUF header); pass a .gguf model file")
    version, tensors, keys = struct.unpack("<IQQ", head[4:24])
    if version not in (2, 3) or tensors > MAX_GGUF_ENTRIES or keys > MAX_GGUF_ENTRIES:
        raise UsageError(f"{path}: its GGUF header is not one a model has (version {version}, {tensors} "
                         f"tensors, {keys} keys); the file is damaged or not a model: fetch it again")


def converted_dir(gguf_path: str) -> Path:
    """The HF model dir of a GGUF file, converted on first use."""
    path = Path(gguf_path)
    if not path.is_file():
        raise UsageError(f"{gguf_path} {not_a_file(path)}; pass an existing .gguf file")
    check_gguf_header(path)
    target = cache_root() / "gguf" / f"{path.stem}-{file_digest(path)[:16]}"
    if (target / "config.json").is_file():
        return target
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError:
        raise UsageError(f"{gguf_path} needs the gguf package: pip install 'finetune[gguf]'") from None
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    print(f"converting {path} into a model dir (once, cached in {target})", file=sys.stderr, flush=True)
    try:
        with each_file_parsed_once():
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, trust_remote_code=False)
            if getattr(config, "n_ctx", None) and hasattr(config, "n_positions"):
                # GPT-2's position table holds the file's context length; transformers' reader
                # sets only n_ctx from it and sizes the table at its default 1024.
                config.n_positions = config.n_ctx
            quantized = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                             dtype=torch.float32, trust_remote_code=False)
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001  (a parser of an untrusted binary: any failure is the file's)
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UsageError(f"could not read {gguf_path} as GGUF ({reason}); pass a whole GGUF file of an "
                         "architecture transformers supports") from None
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    model.tie_weights()
    if unexpected or set(missing) - {"lm_head.weight"}:  # a tied head is restored by tie_weights
        raise UsageError(f"{gguf_path}: its weights do not fit {type(model).__name__} (missing "
                         f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}); pass a supported GGUF file")
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    no_deepspeed_engine()  # save_pretrained's unwrap would import DeepSpeed, and warn on stdout
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, target)  # atomic: a half-written dir is never taken for the model
    size = sum(f.stat().st_size for f in target.iterdir() if f.is_file())
    # Each GGUF file read is converted once: say what the cache holds, since nothing else would.
    kept = [d for d in target.parent.iterdir() if d.is_dir() and (d / "config.json").is_file()]
    total = sum(f.stat().st_size for d in kept for f in d.iterdir() if f.is_file())
    print(f"converted: {size / 1e6:,.0f} MB in {target}, read again for this file; {target.parent} holds "
          f"{len(kept)} conversion(s), {total / 1e6:,.0f} MB (FINETUNE_CACHE moves it; delete a dir to free its "
          "space)", file=sys.stderr, flush=True)
    return target


@contextmanager
def each_file_parsed_once():
    """transformers parses a GGUF file whole three times (for the config, the
    weights and the tokenizer: each parse walks every string of the vocabulary,
    3.5 s for SmolLM2's 49,152 tokens here), and builds gguf's tensor-name map
    once per module (397 times, 5 s). Within this block the readers of a file
    and the maps of an architecture are built once and shared: transformers
    only reads them."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.cache(reader_class)
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map
