"""Instruction and chat fine-tuning: which tokens are targets, packing that
keeps examples apart, loss normalisation over the global batch, and SFT end to
end under FSDP."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import check_ok, run_cli, run_in_process, train_rows
from finetune.config import TrainConfig
from finetune.data.chat import (EXAMPLE_NUMBER, IGNORE, ChatEncoder, PadCollator, build_sft_splits, encode_split,
                                 pack, unpacked)
from finetune.tasks.causal_lm import CausalLM
from sft_models import CHATML, CHATML_TAGGED, conversations, save_chat_model, write_jsonl

CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What does sorted do?"},
    {"role": "assistant", "content": "It returns the lines sorted by length."},
    {"role": "user", "content": "And then?"},
    {"role": "assistant", "content": "It writes them back to the disk."},
]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("models") / "llama-chat", "llama")


def piecewise(tokenizer, messages) -> tuple[list[int], list[bool]]:
    """ChatML tokens built piece by piece, and which of them are targets: an
    assistant turn's content and its <|im_end|>; never the role header, the
    newline after <|im_end|>, or any system or user token."""
    ids, targets = [], []
    for m in messages:
        answer = m["role"] == "assistant"
        for piece, is_target in ((f"<|im_start|>{m['role']}\n", False), (m["content"], answer),
                                 ("<|im_end|>", answer), ("\n", False)):
            piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
            ids += piece_ids
            targets += [is_target] * len(piece_ids)
    return ids, targets


@pytest.mark.parametrize("template", [CHATML, CHATML_TAGGED], ids=["no-generation-tags", "generation-tags"])
def test_labels_are_the_answers_and_their_end_of_turn_token(chat_model, template):
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    tokenizer.chat_template = template
    encoded = ChatEncoder(tokenizer, "chat", train_on_prompt=False).encode({"messages": CONVERSATION}, 0)
    ids, targets = piecewise(tokenizer, CONVERSATION)
    assert encoded.input_ids == ids
    assert encoded.labels == [t if is_target else IGNORE for t, is_target in zip(ids, targets)]
    if template == CHATML_TAGGED:  # transformers' own reading of the tags agrees
        rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=True)
        assert [label != IGNORE for label in encoded.labels] == [bool(m) for m in rendered["assistant_masks"]]
    every = ChatEncoder(tokenizer, "chat", train_on_prompt=True).encode({"messages": CONVERSATION}, 0)
    assert every.labels == ids


def test_a_template_that_rewrites_the_answer_trains_the_turn_through_its_end_token_only(chat_model):
    """When the answer is not found verbatim (the template rewrites it), the
    targets are the whole answer turn through <|im_end|>: never the newline after it."""
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    tokenizer.chat_template = CHATML.replace("message['content']", "(message['content'] | upper)")
    encoded = ChatEncoder(tokenizer, "chat", train_on_prompt=False).encode({"messages": CONVERSATION}, 0)
    upper = [{**m, "content": m["content"].upper()} for m in CONVERSATION]
    ids, targets = piecewise(tokenizer, upper)
    assert encoded.input_ids == ids
    assert encoded.labels == [t if is_target else IGNORE for t, is_target in zip(ids, targets)]


@pytest.mark.parametrize("turn, words", [
    ({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "ls"}}]},
     "calls tools (tool_calls)"),
    ({"role": "assistant", "content": "  "}, "an assistant turn is empty"),
])
def test_an_answer_with_nothing_to_learn_is_refused_naming_the_example(chat_model, turn, words):
    from finetune.errors import UsageError

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    tokenizer.chat_template = CHATML
    row = {"messages": [*CONVERSATION[:4], turn], EXAMPLE_NUMBER: 7}
    with pytest.raises(UsageError, match=r"^example 7: .*" + re.escape(words)):
        ChatEncoder(tokenizer, "chat", train_on_prompt=False).encode(row, 0)


@pytest.mark.parametrize("long_examples, fix", [
    ("truncate", "raise --block_size: cut there, no example keeps a token of its answer"),
    ("drop", "raise --block_size or pass --long_examples truncate"),
])
def test_a_block_that_leaves_no_answer_says_what_would(chat_model, long_examples, fix):
    """The fix offered fits the cause: under truncation (the default) only a
    longer block helps; dropping can also give way to truncation."""
    from datasets import Dataset, DatasetDict

    from finetune.errors import UsageError

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    tokenizer.chat_template = CHATML
    raw = DatasetDict({"train": Dataset.from_dict({"messages": [CONVERSATION] * 3})})
    with pytest.raises(UsageError, match=re.escape(fix)):
        build_sft_splits(raw, tokenizer, "chat", 8, False, True, long_examples)


@pytest.mark.parametrize("text, words", [
    (b"{% for m in messages %}{{ m['content'] }}\xff{% endfor %}", "is not UTF-8 text (byte "),
    ("{% for m in messages %}\n{{ m['content'] }", ": line 2: "),
    ("{{ 1/0 }}", "fails to render a conversation (ZeroDivisionError"),
    ("{% for m in messages %}{{ m['role'] + 1 }}{% endfor %}", "fails to render a conversation (TypeError"),
    ("These are my notes, not a template.\n", "does not write the messages' content"),
], ids=["not-utf8", "syntax", "division", "str-plus-int", "not-a-template"])
def test_a_template_file_is_checked_when_it_is_read(chat_model, tmp_path, text, words):
    """One line naming the file, before any example is rendered (and blamed)."""
    from finetune.data.chat import load_chat_template
    from finetune.errors import UsageError

    path = tmp_path / "template.jinja"
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    with pytest.raises(UsageError, match=r"^--chat_template " + re.escape(str(path)) + ".*" + re.escape(words)):
        load_chat_template(tokenizer, str(path), "chat", str(chat_model))


def test_generate_chat_with_a_template_that_fails_is_one_line(chat_model, tmp_path):
    from e2e.test_errors import one_error_line

    model_dir = tmp_path / "model"
    shutil.copytree(chat_model, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}"
    tokenizer.save_pretrained(model_dir)
    proc = run_in_process("generate", model_dir, "--chat", "--prompt", "What does sorted do?")
    assert proc.returncode == 2
    line = one_error_line(proc.stderr)
    assert f"the chat template of {model_dir} fails to render a conversation (TypeError" in line


def test_instruction_and_prompt_completion_rows(chat_model):
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    instruction = ChatEncoder(tokenizer, "instruction", False).encode(
        {"instruction": "Sort the lines.", "input": "b\na", "output": "a\nb"}, 0)
    as_chat = ChatEncoder(tokenizer, "chat", False).encode(
        {"messages": [{"role": "user", "content": "Sort the lines.\n\nb\na"}, {"role": "assistant", "content": "a\nb"}]}, 0)
    assert instruction == as_chat

    encoded = ChatEncoder(tokenizer, "prompt_completion", False).encode({"prompt": "the model reads",
                                                                         "completion": " a file"}, 0)
    prompt_ids = tokenizer("the model reads", add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(" a file", add_special_tokens=False)["input_ids"]
    assert encoded.input_ids == prompt_ids + completion_ids + [tokenizer.eos_token_id]
    assert encoded.labels == [IGNORE] * len(prompt_ids) + completion_ids + [tokenizer.eos_token_id]


def test_long_examples_are_truncated_or_dropped_and_counted(chat_model):
    from datasets import Dataset

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    encoder = ChatEncoder(tokenizer, "chat", False)
    rows = Dataset.from_list(conversations(12))
    lengths = [len(encoder.encode(r, i).input_ids) for i, r in enumerate(rows)]
    block = sorted(lengths)[len(lengths) // 2]
    longer = sum(n > block for n in lengths)
    kept, stats = encode_split(rows, encoder, block, "drop", "test")
    assert stats.dropped_long == longer and len(kept) == len(rows) - longer
    kept, stats = encode_split(rows, encoder, block, "truncate", "test")
    assert stats.truncated + stats.dropped_no_target == longer and max(len(ids) for ids in kept["input_ids"]) == block


def packed_and_single(tokenizer, rows):
    """The examples, all of them packed into one block, and each alone."""
    from datasets import Dataset

    examples, _ = encode_split(Dataset.from_list(rows), ChatEncoder(tokenizer, "chat", False), 10_000, "drop", "t")
    packed = pack(examples, sum(len(ids) for ids in examples["input_ids"]))
    return examples, packed, unpacked(examples)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packing_gives_each_example_the_loss_and_gradients_it_has_alone(chat_model, attn):
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    model = AutoModelForCausalLM.from_pretrained(chat_model, attn_implementation=attn, dtype=torch.float32)
    task = CausalLM(TrainConfig(model=str(chat_model)))
    collate = PadCollator(tokenizer.pad_token_id)
    examples, packed, single = packed_and_single(tokenizer, conversations(6, seed=1))
    assert len(packed) == 1 and len(packed[0]["input_ids"]) == sum(len(ids) for ids in examples["input_ids"])

    model.zero_grad()
    nll, total, _, _ = task._forward(model, collate([packed[0]]))
    total.backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    starts = [i for i, p in enumerate(packed[0]["position_ids"]) if p == 0] + [len(packed[0]["position_ids"])]
    packed_losses = sorted(float(nll[0, a:b].detach().sum()) for a, b in zip(starts, starts[1:]))

    model.zero_grad()
    alone = []
    for row in single:
        nll, total, _, _ = task._forward(model, collate([row]))
        total.backward()
        alone.append(float(nll.detach().sum()))
    torch.testing.assert_close(packed_losses, sorted(alone), rtol=1e-5, atol=1e-5)
    for packed_grad, p in zip(packed_grads, model.parameters()):
        torch.testing.assert_close(packed_grad, p.grad, rtol=1e-5, atol=1e-5)


def test_changing_one_packed_example_leaves_the_others_logits_unchanged(chat_model):
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    model = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32)
    task_inputs = PadCollator(tokenizer.pad_token_id)
    _, packed, _ = packed_and_single(tokenizer, conversations(4, seed=2))
    batch = task_inputs([packed[0]])
    first_end = [i for i, p in enumerate(packed[0]["position_ids"]) if p == 0][1]
    changed = {k: v.clone() for k, v in batch.items()}
    changed["input_ids"][0, 1:first_end] = (changed["input_ids"][0, 1:first_end] + 7) % 300

    from finetune.tasks.causal_lm import attention_inputs

    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], **attention_inputs(batch, "sdpa")).logits
        logits_changed = model(input_ids=changed["input_ids"], **attention_inputs(changed, "sdpa")).logits
    assert not torch.allclose(logits[0, :first_end], logits_changed[0, :first_end])
    torch.testing.assert_close(logits[0, first_end:], logits_changed[0, first_end:], rtol=0, atol=1e-6)


# --- real runs ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ragged_chat(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "chat.jsonl", conversations(64, seed=3))


def sft_args(model, data, *extra):
    return ["--model", str(model), "--dataset", str(data), "--block_size", "128", "--learning_rate", "1e-3",
            "--sample_prompt", "", "--max_eval_batches", "2", "--validation_split", "0.1", *extra]


@pytest.mark.slow
def test_loss_is_normalised_over_the_global_batch(tmp_path, env, chat_model, ragged_chat):
    """Ragged examples, no packing, fp32: one process with 1 x 4 micro-batches,
    one process with one batch of 4, and 2 FSDP ranks with batches of 2 give the
    same losses and weights."""
    runs = {"1x4": (None, ["--per_device_batch_size", "1", "--gradient_accumulation_steps", "4"]),
            "4x1": (None, ["--per_device_batch_size", "4"]),
            "fsdp-2x2": (2, ["--per_device_batch_size", "2"])}
    losses, weights = {}, {}
    for name, (nproc, batch) in runs.items():
        run_dir = tmp_path / name
        check_ok(run_cli(["train", *sft_args(chat_model, ragged_chat, "--no_packing", "--max_steps", "3", *batch,
                                             "--output_dir", str(run_dir))], env, nproc=nproc, mixed_precision="no", warm=True))
        losses[name] = [r["loss"] for r in train_rows(run_dir)]
        weights[name] = load_file(run_dir / "final" / "model.safetensors")
    for name in ("4x1", "fsdp-2x2"):
        assert losses[name] == pytest.approx(losses["1x4"], rel=1e-5, abs=1e-5)
        for key, tensor in weights["1x4"].items():
            torch.testing.assert_close(weights[name][key], tensor, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_sft_end_to_end_under_fsdp_with_exact_resume_export_and_chat(tmp_path, env, ragged_chat):
    """Qwen2-style model, packed chat data, 2 FSDP ranks in fp32: sharded,
    checkpointed, resumed exactly, exported, and answering with its template."""
    from conftest import dcp_elements_per_file

    model = save_chat_model(tmp_path / "qwen2-chat", "qwen2")
    run_dir = tmp_path / "run"
    args = sft_args(model, ragged_chat, "--per_device_batch_size", "2", "--max_steps", "6", "--checkpoint_every", "3")
    check_ok(run_cli(["train", *args, "--output_dir", str(run_dir)], env, mixed_precision="no", warm=True))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["distributed_type"] == "FSDP" and summary["data_format"] == "chat"
    local = summary["local_params_per_rank"]
    assert len(local) == 2 and sum(local) == summary["total_params"] and max(local) - min(local) < 0.02 * sum(local)
    shard_dir = run_dir / "checkpoints" / "step_000006" / "pytorch_model_fsdp_0"
    assert sorted(dcp_elements_per_file(shard_dir, skip=set()).values()) == sorted(local)
    rows = train_rows(run_dir)
    assert len(rows) == 6 and all(r["tokens_per_sec"] > 0 for r in rows)

    # Stopped right after the checkpoint at step 3, then resumed.
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(run_dir / "run_config.yaml", resumed)
    shutil.copytree(run_dir / "checkpoints" / "step_000003", resumed / "checkpoints" / "step_000003")
    check_ok(run_cli(["resume", str(resumed)], env, mixed_precision="no", warm=True))
    after = train_rows(resumed)
    assert [r["step"] for r in after] == [4, 5, 6]
    assert [r["loss"] for r in after] == pytest.approx([r["loss"] for r in rows[3:]], rel=1e-6, abs=1e-6)
    final, final_resumed = load_file(run_dir / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    for key, tensor in final.items():
        torch.testing.assert_close(final_resumed[key], tensor, rtol=1e-6, atol=1e-6)

    export = tmp_path / "export"
    assert run_in_process("export", run_dir, "--output", export).returncode == 0
    assert AutoTokenizer.from_pretrained(export).chat_template == CHATML
    answer = run_in_process("generate", export, "--chat", "--prompt", "What does sorted do?", "--max_new_tokens", "8")
    assert answer.returncode == 0 and answer.stdout.strip(), answer.stderr
    assert "<|im_start|>" not in answer.stdout and "What does sorted do?" not in answer.stdout


@pytest.mark.slow
def test_a_preset_learns_chat_data_with_a_template_file(tmp_path, env, ragged_chat):
    """A preset trains its tokenizer on every string of the examples; the
    template comes from --chat_template and is saved with the model."""
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<|endoftext|>' }}{% endfor %}"
                        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    run_dir = tmp_path / "run"
    check_ok(run_cli(["train", "--model", "tiny-gpt2", "--dataset", str(ragged_chat), "--chat_template", str(template),
                      "--max_steps", "2", "--block_size", "128", "--sample_prompt", "", "--output_dir", str(run_dir)],
                     env, nproc=None, warm=True))
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    assert tokenizer.chat_template == template.read_text()
    assert tokenizer.tokenize("assistant") == ["assistant"]  # learnt from the roles and turns, not from a text column
