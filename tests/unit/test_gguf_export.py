"""`finetune export --format gguf`: the file reads back through transformers'
own GGUF reader (the `gguf` package underneath) with the tokenizer's ids, its
chat template and the model's logits; where llama-cpp-python is installed,
llama.cpp itself runs it. The export streams tensor by tensor, and refuses
what it cannot convert in one line, leaving any existing file alone."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO, check_ok, run_in_process
from sft_models import CHATML, MOE_FAMILIES, chat_tokenizer, conversations, save_chat_model, save_family_model
from e2e.test_errors import one_error_line

gguf = pytest.importorskip("gguf")

TEXTS = ["the model reads a file and returns its lines", "  two spaces, digits 12345 and a tab\there",
         "unknown words: zyxt qoph \u00e9t\u00e9 \u4e2d\u6587 \U0001f600", "<|im_start|>user\nhello<|im_end|>\n"]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what changes at all"},
        {"role": "assistant", "content": "nothing changes 42"}]
# Largest |logit error| / max |logit| measured over the families here: f16 3.4e-4, bf16 2.9e-3, q8_0 1.0e-2
# (Qwen3, Phi-3, the MoE families where routed alike: f16 5e-4, q8_0 1.5e-2).
LOGIT_BOUND = {"f16": 2e-3, "bf16": 1e-2, "q8_0": 3e-2}
# Gemma 3 rounds through four norms a layer and a sqrt(hidden)-scaled embedding: q8_0 measured 3.5e-2.
BOUND_OF = {("gemma3_text", "q8_0"): 5e-2}


def save_gpt2_model(path):
    """GPT-2 with its real 1024 positions: transformers' GGUF reader sizes GPT-2's
    position table at 1024 whatever the file says (llama.cpp reads the file's)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = chat_tokenizer([m["content"] for row in conversations(200) for m in row["messages"]])
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=len(tokenizer), n_positions=1024,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
                    ).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_mistral_model(path):
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    llama = save_chat_model(path.parent / "llama-for-mistral")
    tokenizer = AutoTokenizer.from_pretrained(llama)
    torch.manual_seed(0)
    MistralForCausalLM(MistralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
                                     eos_token_id=tokenizer.eos_token_id)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def sentencepiece_tokenizer(texts: list[str]):
    """A Llama-2-style vocabulary: SentencePiece BPE pieces ('\u2581' for a space, merged within words only)
    numbered in merge order after <unk>, <s>, </s> and the 256 byte tokens it falls back to."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import LlamaTokenizerFast

    spaces = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    learner = Tokenizer(models.BPE())
    learner.normalizer = spaces
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=True)
    learner.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    learnt = json.loads(learner.to_str())["model"]
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials + [f"<0x{byte:02X}>" for byte in range(256)])}
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learnt["merges"]]
    for first, second in merges:
        vocab.setdefault(first + second, len(vocab))
    for token in learnt["vocab"]:  # the single characters
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = spaces
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    tokenizer = LlamaTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   add_bos_token=True, legacy=True)
    tokenizer.chat_template = CHATML
    return tokenizer


def save_sentencepiece_llama(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = sentencepiece_tokenizer([m["content"] for row in conversations(200) for m in row["messages"]])
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
                     ).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


FAMILIES = {"llama": lambda path: save_chat_model(path, "llama", tie=False),   # untied, grouped-query attention
            "llama-sentencepiece": save_sentencepiece_llama,  # Llama 2's and Mistral 7B's kind of vocabulary
            "qwen2-tied": lambda path: save_chat_model(path, "qwen2", tie=True),  # q/k/v biases, tied embeddings
            "mistral": save_mistral_model,
            "gpt2": save_gpt2_model}


# The families users take to llama.cpp now, by llama.cpp's architecture; transformers' GGUF reader reads the first four.
NEW_FAMILIES = {"qwen3": "qwen3", "qwen3_moe": "qwen3moe", "gemma3_text": "gemma3", "phi3": "phi3",
                "mixtral": "llama", "olmoe": "olmoe", "gpt_oss": "gpt-oss"}
READ_BY_TRANSFORMERS = ("qwen3", "qwen3_moe", "gemma3_text", "phi3")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-models")
    return {family: save(root / f"tiny-{family}") for family, save in FAMILIES.items()}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-families")
    # llama.cpp sets Phi-3 tokens' attributes by the model's name, from a vocabulary ours does not have
    return {family: save_family_model(root / family.replace("phi3", "phi-iii"), family) for family in NEW_FAMILIES}


def stored_as_asked(name: str, dims: int) -> bool:
    """Weight matrices (expert stacks too) take the asked type; vectors, biases and routers stay f32."""
    return dims >= 2 and name.endswith(".weight") and ".ffn_gate_inp." not in name


def assert_same_next_tokens_beyond_ties(read_back: torch.Tensor, reference: torch.Tensor) -> None:
    """The next token (argmax) is the same wherever the reference's top two
    logits lie further apart than twice the largest logit error: only a tie
    within the rounding may flip."""
    tolerance = (read_back - reference).abs().max()
    top_two = reference.topk(2, dim=-1).values
    flipped = read_back.argmax(-1) != reference.argmax(-1)
    assert ((top_two[..., 0] - top_two[..., 1])[flipped] <= 2 * tolerance).all(), (flipped.sum(), tolerance)


def refused(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    return one_error_line(proc.stderr)


def gguf_fields(path) -> dict:
    reader = gguf.GGUFReader(str(path))
    return {"reader": reader, **{name: field.contents() for name, field in reader.fields.items()
                                 if name == "tokenizer.ggml.pre" or not name.startswith("tokenizer.ggml.")}}


@pytest.mark.parametrize("gguf_type", ["f16", "bf16", "q8_0"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_reads_back_with_the_same_tokens_and_logits(family, gguf_type, model_dirs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = model_dirs[family]
    out = tmp_path / f"{family}-{gguf_type}.gguf"
    check_ok(run_in_process("export", source, "--format", "gguf", "--gguf_type", gguf_type, "--output", out))

    fields = gguf_fields(out)
    expected_type = {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16,
                     "q8_0": gguf.GGMLQuantizationType.Q8_0}[gguf_type]
    for tensor in fields["reader"].tensors:  # matrices as asked (all rows here are whole q8_0 blocks), vectors f32
        assert tensor.tensor_type == (expected_type if stored_as_asked(tensor.name, len(tensor.shape))
                                      else gguf.GGMLQuantizationType.F32)
    assert fields["general.architecture"] == {"gpt2": "gpt2", "qwen2-tied": "qwen2"}.get(family, "llama")
    assert fields["tokenizer.chat_template"] == CHATML

    reference_tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    for text in [*TEXTS, reference_tokenizer.apply_chat_template(CHAT, tokenize=False)]:
        assert tokenizer(text)["input_ids"] == reference_tokenizer(text)["input_ids"], text
    assert tokenizer.apply_chat_template(CHAT, tokenize=False) == reference_tokenizer.apply_chat_template(
        CHAT, tokenize=False)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (reference_tokenizer.bos_token_id,
                                                                 reference_tokenizer.eos_token_id)

    ids = torch.tensor([reference_tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]])
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(source).eval()(ids).logits
        read_back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name,
                                                         dtype=torch.float32).eval()(ids).logits
    error = ((read_back - reference).abs().max() / reference.abs().max()).item()
    assert error < LOGIT_BOUND[gguf_type], error
    assert_same_next_tokens_beyond_ties(read_back, reference)


@pytest.mark.parametrize("gguf_type", ["f16", "q8_0"])
@pytest.mark.parametrize("family", READ_BY_TRANSFORMERS)
def test_new_families_read_back_with_the_same_logits(family, gguf_type, family_dirs, tmp_path):
    """Qwen3, Qwen3-MoE (experts from their per-expert files), Gemma 3 (norms
    as 1 + w) and Phi-3 (fused qkv and gate_up) through transformers' reader."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = family_dirs[family]
    out = tmp_path / f"{family}-{gguf_type}.gguf"
    check_ok(run_in_process("export", source, "--format", "gguf", "--gguf_type", gguf_type, "--output", out))
    assert gguf_fields(out)["general.architecture"] == NEW_FAMILIES[family]
    ids = torch.tensor([AutoTokenizer.from_pretrained(source).apply_chat_template(CHAT, tokenize=True,
                                                                                  return_dict=True)["input_ids"]])
    moe = {"output_router_logits": True} if family in MOE_FAMILIES else {}
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(source).eval()(ids, **moe)
        read_back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32).eval()(
            ids, **moe)
    # A token whose hidden state rounds across a router's tie goes to other experts: a
    # different function, not an error of the file. The positions routed alike are compared.
    same_route = torch.ones(ids.shape[1], dtype=torch.bool)
    for ours, theirs in zip(getattr(reference, "router_logits", None) or (), getattr(read_back, "router_logits", None) or ()):
        same_route &= (ours.topk(2).indices.sort().values == theirs.topk(2).indices.sort().values).all(-1)
    assert same_route.float().mean() >= 0.9, same_route
    reference, read_back = reference.logits[:, same_route], read_back.logits[:, same_route]
    error = ((read_back - reference).abs().max() / reference.abs().max()).item()
    assert error < BOUND_OF.get((family, gguf_type), LOGIT_BOUND[gguf_type]), error
    assert_same_next_tokens_beyond_ties(read_back, reference)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_stacks_go_in_as_llama_cpp_lays_them_out(family, family_dirs, tmp_path):
    """Every MoE family's file: its expert counts, and per layer a router and
    gate/up/down stacks of [experts, out, in] (numpy order) whose expert 0 is
    the model's first expert's projections, computed here from the model's own
    forward: x @ gate.T for the gate and up rows transformers' experts module uses."""
    from transformers import AutoModelForCausalLM

    source = family_dirs[family]
    out = tmp_path / f"{family}.gguf"
    check_ok(run_in_process("export", source, "--format", "gguf", "--gguf_type", "f16", "--output", out))
    fields = gguf_fields(out)
    arch = NEW_FAMILIES[family]
    assert fields["general.architecture"] == arch
    assert (fields[f"{arch}.expert_count"], fields[f"{arch}.expert_used_count"]) == (4, 2)
    tensors = {t.name: t for t in fields["reader"].tensors}
    model = AutoModelForCausalLM.from_pretrained(source).eval()
    experts = model.model.layers[0].mlp.experts
    gate_up = experts.gate_up_proj[0].detach()
    # each module's own reading of its fused tensor: gpt-oss's [in, out] interleaved, the others [out, in] halves
    gate, up = ((gate_up[:, ::2].T, gate_up[:, 1::2].T) if family == "gpt_oss" else gate_up.chunk(2, dim=0))
    down = experts.down_proj[0].detach()
    down = down.T if family == "gpt_oss" else down
    for name, expected in (("ffn_gate_exps", gate), ("ffn_up_exps", up), ("ffn_down_exps", down)):
        stored = torch.from_numpy(np.array(tensors[f"blk.0.{name}.weight"].data, dtype=np.float32))
        assert stored.shape[0] == 4 and stored.shape[1:] == expected.shape, name
        x = torch.randn(3, expected.shape[1])  # the projection's input: hidden states, or the expert's inner width
        torch.testing.assert_close(x @ stored[0].T, x @ expected.T, rtol=2e-3, atol=2e-3)
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32


def test_a_family_llama_cpp_runs_differently_is_refused(family_dirs, tmp_path):
    source = tmp_path / "unnormalised"
    shutil.copytree(family_dirs["qwen3_moe"], source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "norm_topk_prob": False}))
    message = refused(run_in_process("export", source, "--format", "gguf", "--output", tmp_path / "x.gguf"))
    assert "norm_topk_prob" in message and "--format safetensors" in message
    assert not (tmp_path / "x.gguf").exists()


def test_a_split_pattern_pre_tokenizer_goes_in_by_llama_cpps_name(model_dirs, tmp_path):
    """Qwen2's and Llama 3's tokenizers split text with a regex before the byte-level merges: the file
    names that pattern as llama.cpp does (`qwen2`), and the reader splits the same way again."""
    from tokenizers import Regex, pre_tokenizers
    from transformers import AutoTokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    source = tmp_path / "qwen2-split"
    shutil.copytree(model_dirs["qwen2-tied"], source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.save_pretrained(source)
    out = tmp_path / "qwen2-split.gguf"
    check_ok(run_in_process("export", source, "--format", "gguf", "--output", out))
    assert gguf_fields(out)["tokenizer.ggml.pre"] == "qwen2"
    read_back = AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    reference = AutoTokenizer.from_pretrained(source)
    for text in TEXTS:
        assert read_back(text)["input_ids"] == reference(text)["input_ids"], text


def save_llama3_scaled(path):
    """Llama 3.1's rotary scaling, with an original context short enough (64) that a test's tokens reach it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = chat_tokenizer([m["content"] for row in conversations(200) for m in row["messages"]])
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                 rope_parameters=rope)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_llama_3_rotary_scaling_goes_in_as_llama_cpps_factors(tmp_path):
    """transformers' GGUF reader rebuilds no Llama rotary scaling, so the file is
    checked here against transformers' own llama3 frequencies (and by llama.cpp below)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    source = save_llama3_scaled(tmp_path / "llama3")
    check_ok(run_in_process("export", source, "--format", "gguf", "--output", tmp_path / "llama3.gguf"))
    config = AutoConfig.from_pretrained(source)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    head_dim = config.hidden_size // config.num_attention_heads
    plain = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    factors = next(t for t in gguf.GGUFReader(str(tmp_path / "llama3.gguf")).tensors if t.name == "rope_freqs.weight")
    assert factors.tensor_type == gguf.GGMLQuantizationType.F32
    torch.testing.assert_close(torch.from_numpy(np.array(factors.data)), plain / scaled, rtol=1e-5, atol=0)
    assert {1.0, 8.0} < set(np.array(factors.data).tolist())  # kept, slowed and blended frequencies all occur


def test_llama_cpp_runs_the_export_with_the_models_next_token_logits(model_dirs, family_dirs, tmp_path):
    """llama.cpp's own loader and kernels, through llama-cpp-python (a source
    build: `pip install llama-cpp-python`, with cmake and a C++ compiler)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    scaled = save_llama3_scaled(tmp_path / "llama3-scaled")
    for family, source in [*model_dirs.items(), *family_dirs.items(), ("llama3-scaled", scaled)]:
        for gguf_type in ("f16", "q8_0"):
            out = tmp_path / f"{family}-{gguf_type}.gguf"
            check_ok(run_in_process("export", source, "--format", "gguf", "--gguf_type", gguf_type, "--output", out))
            ids = AutoTokenizer.from_pretrained(source)(TEXTS[0])["input_ids"] * 8  # past 64 positions
            model = llama_cpp.Llama(model_path=str(out), n_ctx=256, logits_all=True, verbose=False)
            # add_bos: as the file's tokenizer.ggml.add_bos_token says
            assert model.tokenize(TEXTS[0].encode(), add_bos=True, special=True) == ids[:len(ids) // 8], family
            model.eval(ids)
            theirs = torch.tensor(np.array(model.scores[:len(ids)]))
            with torch.no_grad():
                ours = AutoModelForCausalLM.from_pretrained(source).eval()(torch.tensor([ids])).logits[0]
            error = ((theirs - ours).abs().max() / ours.abs().max()).item()
            if family in MOE_FAMILIES and gguf_type == "q8_0":
                # a rounded hidden state can cross a router's tie and go to other experts (see the reader's
                # test); llama.cpp shows no router logits to leave those positions out, so most must agree
                assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean() >= 0.9, family
                continue
            assert error < BOUND_OF.get((family, gguf_type), LOGIT_BOUND[gguf_type]), (family, gguf_type, error)
            assert_same_next_tokens_beyond_ties(theirs, ours)


@pytest.mark.slow
def test_the_export_streams_one_tensor_at_a_time(tmp_path):
    """A 238 MB Llama whose largest tensor is 4.2 MB: the export's peak RSS
    stays within its baseline (after a small export) plus 10 of the largest
    tensor, a sixth of the model (measured: 23 MB), and every tensor is written."""
    from transformers import LlamaConfig, LlamaForCausalLM

    small, big = save_chat_model(tmp_path / "small"), tmp_path / "big"
    tokenizer_dir = small
    config = LlamaConfig(vocab_size=400, hidden_size=1024, intermediate_size=1024, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(big)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    del model
    for file in tokenizer_dir.glob("tokenizer*"):
        (big / file.name).write_bytes(file.read_bytes())
    assert model_bytes > 50 * largest
    script = f"""
from pathlib import Path
from finetune.cli import main

def status(field):  # bytes
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024

assert main(["export", {str(small)!r}, "--format", "gguf", "--output", {str(tmp_path / "small.gguf")!r}]) == 0
baseline = status("VmRSS")
Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from here
assert main(["export", {str(big)!r}, "--format", "gguf", "--output", {str(tmp_path / "big.gguf")!r}]) == 0
print("rise", status("VmHWM") - baseline)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    check_ok(proc)
    rise = int(proc.stdout.split("rise")[-1])
    assert rise < 10 * largest, (rise, largest, model_bytes)
    assert (tmp_path / "big.gguf").stat().st_size > model_bytes // 2 - 1  # f16 matrices, every tensor written


def test_what_gguf_cannot_hold_is_one_line_and_leaves_the_output_alone(model_dirs, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import OPTConfig, OPTForCausalLM, PreTrainedTokenizerFast

    out = tmp_path / "model.gguf"
    out.write_bytes(b"the user's own file")
    line = refused(run_in_process("export", model_dirs["llama"], "--format", "gguf", "--output", out))
    assert "exists" in line and "--overwrite" in line
    assert out.read_bytes() == b"the user's own file"

    opt = tmp_path / "opt"
    OPTForCausalLM(OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=400,
                             word_embed_proj_dim=32)).save_pretrained(opt)
    line = refused(run_in_process("export", opt, "--format", "gguf", "--output", tmp_path / "opt.gguf"))
    assert "'opt'" in line and "Llama" in line and "GPT-2" in line and "--format safetensors" in line

    word_pieces = tmp_path / "word-pieces"
    save_chat_model(word_pieces)
    backend = Tokenizer(models.WordPiece({"[UNK]": 0, "the": 1, "model": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    for file in word_pieces.glob("tokenizer*"):
        file.unlink()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(word_pieces)
    line = refused(run_in_process("export", word_pieces, "--format", "gguf", "--output", tmp_path / "w.gguf"))
    assert "byte-level BPE" in line and "WordPiece" in line

    for bad, words in ((["--output", tmp_path / "a-dir"], "NAME.gguf"),
                       (["--output", tmp_path / "x.gguf", "--dtype", "bfloat16"], "--gguf_type"),
                       (["--output", tmp_path / "x.gguf", "--adapter_only"], "--gguf_type")):
        line = refused(run_in_process("export", model_dirs["llama"], "--format", "gguf", *bad))
        assert words in line, line
    damaged = tmp_path / "damaged"
    for name, damage, words in (("model.safetensors", lambda b: b[:len(b) // 2], "not a whole safetensors file"),
                                ("config.json", lambda b: b[:20], "could not read the model config"),
                                ("tokenizer.json", lambda b: b"garbage", "is not a tokenizer file")):
        shutil.rmtree(damaged, ignore_errors=True)
        shutil.copytree(model_dirs["llama"], damaged)
        (damaged / name).write_bytes(damage((damaged / name).read_bytes()))
        line = refused(run_in_process("export", damaged, "--format", "gguf", "--output", tmp_path / "d.gguf"))
        assert words in line, (name, line)
    shutil.rmtree(damaged)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "opt", "word-pieces"]  # nothing else written
    assert out.read_bytes() == b"the user's own file"
    check_ok(run_in_process("export", model_dirs["llama"], "--format", "gguf", "--output", out, "--overwrite"))
    assert out.read_bytes()[:4] == b"GGUF"


@pytest.mark.slow  # a fresh interpreter of its own (what it imports): not the quick tier's
def test_generate_from_a_gguf_file_imports_no_deepspeed_and_prints_only_the_text(tmp_path, env):
    """The first read of a GGUF file converts it (save_pretrained, whose unwrap
    imported DeepSpeed wherever installed, and DeepSpeed's warning landed in
    the text `generate` prints on stdout). A GPT-2 of 128 positions, as the
    docs' tiny-gpt2: transformers' reader sized its position table at 1024.
    Its log, redirected, holds lines, not the libraries' redrawn bars."""
    pytest.importorskip("deepspeed")
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = chat_tokenizer([m["content"] for row in conversations(200) for m in row["messages"]])
    GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=len(tokenizer), n_positions=128,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
                    ).save_pretrained(tmp_path / "gpt2-128")
    tokenizer.save_pretrained(tmp_path / "gpt2-128")
    out = tmp_path / "gpt2-128.gguf"
    check_ok(run_in_process("export", tmp_path / "gpt2-128", "--format", "gguf", "--output", out))
    script = f"""
import sys
from finetune.cli import main
code = main(["generate", {str(out)!r}, "--prompt", "the model", "--max_new_tokens", "3"])
code = code or main(["export", {str(tmp_path / "gpt2-128")!r}, "--format", "gguf", "--output",
                     {str(tmp_path / "again.gguf")!r}])
# Commands that do not train import no backend (nor its collectives and checkpoint reader).
print("training modules:", sorted(m for m in sys.modules if m.startswith(("finetune.backends", "finetune.collectives",
                                                                          "finetune.checkpoint", "finetune.train"))))
print("deepspeed imported:", "deepspeed" in sys.modules)
sys.exit(code)
"""
    no_setting = {k: v for k, v in env.items() if k != "TQDM_DISABLE"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO,
                          env={**no_setting, "FINETUNE_CACHE": str(tmp_path / "cache")},
                          capture_output=True, text=True, timeout=300)
    check_ok(proc)
    assert "converting" in proc.stderr  # the conversion ran in this process
    assert re.search(r"cache/gguf holds 1 conversion\(s\), [\d,]+ MB", proc.stderr), proc.stderr  # the cache's size
    assert "\r" not in proc.stderr and "it/s]" not in proc.stderr, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "deepspeed imported: False" and lines[0].startswith("the model"), proc.stdout
    assert lines[-2] == "training modules: []", proc.stdout


def test_a_link_planted_at_the_scratch_name_is_not_written_through_and_files_get_the_usual_mode(model_dirs, tmp_path):
    """The scratch file the export writes before renaming it: a name beside
    the output that anyone may guess (this process's id), where a link to
    another file could stand. And what it writes is readable as any file
    (safetensors and mkstemp make their files their owner's alone)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    out = tmp_path / "model.gguf"
    (tmp_path / f".{out.name}.tmp-{os.getpid()}").symlink_to(victim)
    check_ok(run_in_process("export", model_dirs["gpt2"], "--format", "gguf", "--output", out))
    assert victim.read_text() == "keep" and gguf.GGUFReader(str(out)).tensors
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask
    from transformers import AutoModelForCausalLM

    from finetune.model_dir import write_model_dir

    model = AutoModelForCausalLM.from_pretrained(model_dirs["gpt2"])
    written = write_model_dir(model.state_dict(), model.config, tmp_path / "written", max_shard_size=10**5)
    assert len(list(written.glob("*.safetensors"))) > 1
    assert {f.name: f.stat().st_mode & 0o777 for f in written.iterdir()} == \
        {f.name: 0o666 & ~umask for f in written.iterdir()}


def test_named_chat_templates_are_kept_as_llama_cpp_keeps_them(model_dirs, tmp_path):
    from transformers import AutoTokenizer

    model_dir = tmp_path / "named"
    shutil.copytree(model_dirs["llama"], model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tool_use = CHATML.replace("<|im_start|>", "<|im_start|>tools ")
    tokenizer.chat_template = {"default": CHATML, "tool_use": tool_use}
    tokenizer.save_pretrained(model_dir)
    assert AutoTokenizer.from_pretrained(model_dir).chat_template == {"default": CHATML, "tool_use": tool_use}
    out = tmp_path / "named.gguf"
    check_ok(run_in_process("export", model_dir, "--format", "gguf", "--output", out))
    fields = gguf_fields(out)
    assert fields["tokenizer.chat_template"] == CHATML
    assert fields["tokenizer.chat_template.tool_use"] == tool_use


@pytest.mark.parametrize("change, words", [
    ({"num_hidden_layers": 3}, "does not describe its weights: model.layers.2"),
    ({"intermediate_size": 96}, "does not describe its weights: model.layers.0.mlp.down_proj.weight"),
    ({"num_attention_heads": 0}, "could not read the model config of"),
    ({"vocab_size": "many"}, "could not read the model config of"),
])
def test_a_config_that_contradicts_the_weights_makes_no_gguf(model_dirs, tmp_path, change, words):
    model_dir = tmp_path / "edited"
    shutil.copytree(model_dirs["llama"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **change}))
    out = tmp_path / "edited.gguf"
    line = refused(run_in_process("export", model_dir, "--format", "gguf", "--output", out))
    assert words in line and ("fix config.json" in line or "pass a whole model dir" in line), line
    assert not out.exists() and not list(tmp_path.glob(".edited.gguf.tmp-*"))


def test_a_vision_language_model_is_refused_naming_llama_cpps_mmproj_route():
    from vlm_models import vlm_parts

    from finetune.errors import UsageError
    from finetune.gguf_export import family_of

    config, _ = vlm_parts("gemma3")  # its text model is a family GGUF export converts; the vision tower is not
    with pytest.raises(UsageError, match="has a vision tower .*--format safetensors, then convert .*--mmproj"):
        family_of(config)
