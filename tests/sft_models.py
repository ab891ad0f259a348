"""Tiny Llama- and Qwen2-style chat models saved as HF model dirs, with a
ChatML tokenizer trained here, for the SFT tests."""

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


def chat_tokenizer(texts: list[str], template: str = CHATML) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False,
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
