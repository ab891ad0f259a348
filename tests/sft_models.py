"""Tiny Llama- and Qwen2-style chat models saved as HF model dirs (and one as a
GGUF file), with a ChatML tokenizer trained here, for the SFT tests."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

# ChatML as most chat models write it; no {% generation %} tags.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# The same rendering, with the answers and their end-of-turn token inside generation tags.
CHATML_TAGGED = ("{% for message in messages %}{% if message['role'] == 'assistant' %}"
                 "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
                 "{% endgeneration %}{{ '\n' }}{% else %}{{ '<|im_start|>' + message['role'] + '\n' + "
                 "message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _qwen3(tagged: bool) -> str:
    """Qwen3's template in its reasoning logic: reasoning from `reasoning_content`
    or a <think> block at the content's start, rendered only for the turns
    after the last user message; with `tagged`, each answer turn inside
    {% generation %} tags for transformers' assistant mask."""
    open_, close = ("{% generation %}", "{% endgeneration %}") if tagged else ("", "")
    return (
        "{%- set ns = namespace(last_query=-1) -%}"
        "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
        "{%- endfor -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'assistant' -%}"
        "{%- set content = m.content -%}{%- set reasoning = m.reasoning_content if m.reasoning_content else '' -%}"
        "{%- if '</think>' in content -%}"
        "{%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}"
        "{%- set content = content.split('</think>')[-1].lstrip('\n') -%}{%- endif -%}"
        "{{- '<|im_start|>assistant\n' -}}" + open_ +
        "{%- if loop.index0 > ns.last_query and reasoning -%}"
        "{{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' -}}{%- endif -%}"
        "{{- content + '<|im_end|>' -}}" + close + "{{- '\n' -}}"
        "{%- else -%}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}{%- endif -%}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}")


def _harmony(tagged: bool) -> str:
    """gpt-oss's harmony format in its channels: an answer's `thinking` in the
    analysis channel (kept only after the last user message), the answer in
    the final channel, <|return|> closing the conversation's last answer."""
    open_, close = ("{% generation %}", "{% endgeneration %}") if tagged else ("", "")
    return (
        "{%- set ns = namespace(last_query=-1) -%}"
        "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
        "{%- endfor -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'assistant' -%}{{- '<|start|>assistant' -}}" + open_ +
        "{%- if m.thinking and loop.index0 > ns.last_query -%}"
        "{{- '<|channel|>analysis<|message|>' + m.thinking + '<|end|><|start|>assistant' -}}{%- endif -%}"
        "{{- '<|channel|>final<|message|>' + m.content + ('<|return|>' if loop.last else '<|end|>') -}}" + close +
        "{%- else -%}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' -}}{%- endif -%}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}")


QWEN3, QWEN3_TAGGED = _qwen3(False), _qwen3(True)
HARMONY, HARMONY_TAGGED = _harmony(False), _harmony(True)
REASONING_SPECIAL = ["<|start|>", "<|end|>", "<|return|>", "<|message|>", "<|channel|>"]


def chat_tokenizer(texts: list[str], template: str = CHATML) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = SPECIAL + (REASONING_SPECIAL if "<|channel|>" in template else [])
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    tokenizer.chat_template = template
    return tokenizer


def conversations(count: int, seed: int = 0) -> list[dict]:
    """Ragged conversations: some with a system turn, some with two exchanges."""
    import random

    rng = random.Random(seed)
    words = ("the model reads a file and returns its lines sorted by length then writes them back to the disk "
             "unless an error occurs in which case nothing changes at all").split()
    rows = []
    for i in range(count):
        def say(lo, hi):
            return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))
        messages = [{"role": "system", "content": say(3, 6)}] if i % 3 == 0 else []
        messages += [{"role": "user", "content": say(2, 12)}, {"role": "assistant", "content": say(1, 20)}]
        if i % 4 == 1:
            messages += [{"role": "user", "content": say(2, 6)}, {"role": "assistant", "content": say(2, 8)}]
        rows.append({"messages": messages})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def save_chat_model(path: Path, arch: str = "llama", tie: bool = False, template: str = CHATML) -> Path:
    texts = [m["content"] for row in conversations(200) for m in row["messages"]]
    tokenizer = chat_tokenizer(texts, template)
    shape = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tie)
    model = LlamaForCausalLM(LlamaConfig(**shape)) if arch == "llama" else Qwen2ForCausalLM(Qwen2Config(**shape))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# Tiny random-weight models of the families users fine-tune now: each family's
# own config class (AutoConfig.for_model) at the chat models' shape, MoE ones
# with 4 experts of which 2 per token.
FAMILY_SHAPES = {
    "qwen3": {},  # head_dim 128, as every Qwen3 (transformers' GGUF reader assumes it)
    # every layer local below 6 layers, as llama.cpp has it; attention scaled by the head size (256, as Gemma 3's
    # 1B-12B: llama.cpp reads the head size, transformers' GGUF reader takes the scale to be 256)
    "gemma3_text": dict(head_dim=256, sliding_window=64, query_pre_attn_scalar=256),
    "phi3": {},
    "olmo2": {},
    "smollm3": {},
    # transformers' GGUF reader takes Qwen3-MoE's expert width to be its default (768, Qwen3-30B-A3B's)
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, head_dim=8, moe_intermediate_size=768, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, num_key_value_heads=4),  # no grouped queries, as OLMoE
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096),
}
MOE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss")


def save_family_model(path: Path, family: str, template: str = CHATML, seed: int = 0) -> Path:
    """A tiny `family` chat model dir (save_pretrained) with the ChatML tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    texts = [m["content"] for row in conversations(200) for m in row["messages"]]
    tokenizer = chat_tokenizer(texts, template)
    shape = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id)
    config = AutoConfig.for_model(family, **{**shape, **FAMILY_SHAPES[family]})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_gguf_model(path: Path) -> Path:
    """A tiny Llama as llama.cpp's GGUF writes one (fp32 tensors, a GPT-2-style
    BPE vocabulary, the ChatML template), written with the gguf package."""
    import gguf
    import numpy as np

    tokenizer = chat_tokenizer([m["content"] for row in conversations(200) for m in row["messages"]])
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    tokens = [token for token, _ in sorted(spec["model"]["vocab"].items(), key=lambda item: item[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    hidden, layers, heads, kv_heads, ffn = 32, 2, 4, 2, 64
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(CHATML)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (len(tokens), hidden), "output_norm.weight": (hidden,),
              "output.weight": (len(tokens), hidden)}
    kv_width = kv_heads * hidden // heads
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                       f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (kv_width, hidden),
                       f"blk.{i}.attn_v.weight": (kv_width, hidden), f"blk.{i}.attn_output.weight": (hidden, hidden),
                       f"blk.{i}.ffn_gate.weight": (ffn, hidden), f"blk.{i}.ffn_up.weight": (ffn, hidden),
                       f"blk.{i}.ffn_down.weight": (hidden, ffn)})
    for name, shape in shapes.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Words of a learnable preference: the preferred answers use the first five, the others the rest.
PREFERENCE_WORDS = "reads returns sorted writes changes error disk nothing file lines".split()


def preference_tokenizer() -> PreTrainedTokenizerFast:
    """The chat tokenizer, trained on the chat texts and the preference words."""
    return chat_tokenizer([m["content"] for row in conversations(60) for m in row["messages"]] + PREFERENCE_WORDS)


def tiny_llama(tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer Llama of random weights for `tokenizer`, in eval mode (no dropout)."""
    import torch

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config).eval()
