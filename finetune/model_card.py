"""The model card (`README.md`) of every model dir a run writes (`final/`) and
`finetune export` writes: what the model is, how it was trained, how it
scored, and how to run it, from the run's own record (run_config.yaml,
summary.json, loss.png) and any lm-evaluation-harness results in the dir.

Its YAML header follows the Hub's model-card metadata: `base_model` (a Hub id
only: a local path means nothing elsewhere), `library_name`, `pipeline_tag`,
`tags`, `datasets` (Hub ids), and `license` when the base states one (its own
card, or a GGUF base's `general.license`).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from finetune import json_text
from finetune.gguf_families import FAMILIES
from finetune.model_dir import is_own_file, read_json_object, replace_file
from finetune.objectives import recorded_objective
from finetune.presets import CNN_MODEL_TYPE, CNN_PRESETS, GPT2_PRESETS

CARD = "README.md"
CARD_RECORD = "finetune_card.json"  # the run record the card was written from, to write it again with new scores
LM_EVAL_RESULTS = "lm_eval_results.json"  # written into a model dir by `finetune evaluate --tasks`
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(name: str) -> bool:
    return bool(HUB_ID.match(name)) and not Path(name).exists()


def sources(cfg: dict) -> list[str]:
    """A run's --dataset: one source, or a mixture's."""
    dataset = cfg.get("dataset") or []
    return [str(d) for d in dataset] if isinstance(dataset, list) else [str(dataset)]


def data_line(cfg: dict) -> str:
    """The data, and a mixture's weights and a stream, for the card's table."""
    names = sources(cfg)
    weights = cfg.get("dataset_weights") or [1.0] * len(names)
    line = (" + ".join(f"`{n}` ({w / sum(weights):.0%})" for n, w in zip(names, weights)) if len(names) > 1
            else f"`{names[0]}`")
    return line + (", streamed" if cfg.get("streaming") else "")


def base_license(model: str) -> str | None:
    """The license a local base states: its card's header, or a GGUF file's metadata."""
    path = Path(model)
    try:
        if path.suffix.lower() == ".gguf" and path.is_file():
            import gguf

            field = gguf.GGUFReader(str(path)).fields.get("general.license")
            return str(field.contents()) if field is not None else None
        if (path / CARD).is_file():
            from huggingface_hub import ModelCard

            return ModelCard.load(path / CARD).data.get("license")
    except Exception:  # noqa: BLE001  (someone else's file: no license read is no license stated)
        return None
    return None


@dataclass
class RunRecord:
    """What the card tells of the run that made the model: its options
    (run_config.yaml), its facts at the model's step (summary.json's keys, as
    far as known) and its loss plot (None where the plot shows other steps)."""
    config: dict
    facts: dict
    loss_plot: Path | None = None


def checkpoint_record(checkpoint_dir: Path) -> RunRecord | None:
    """The record of the run that wrote a checkpoint, at the checkpoint's step:
    the run's summary where the run ended there, else what its metrics knew then."""
    from finetune.checkpoint import read_progress
    from finetune.run_dir import saved_config

    config = saved_config(checkpoint_dir)
    if not config:
        return None
    run_dir = checkpoint_dir.parent.parent
    progress = read_progress(checkpoint_dir)
    summary = read_json_object(run_dir / "summary.json")
    if summary.get("steps") == progress.step:
        return RunRecord(config, summary, run_dir / "loss.png" if (run_dir / "loss.png").is_file() else None)
    evaluations = {row["step"]: row for row in json_text.read_jsonl(run_dir / "metrics.jsonl") if "eval_loss" in row}
    metric = next((name for name in ("perplexity", "accuracy") for row in evaluations.values() if name in row), None)
    facts = {"steps": progress.step, "world_size": progress.world_size, "metric": metric,
             "first_eval": evaluations.get(0), "last_eval": evaluations.get(progress.step)}
    return RunRecord(config, facts)


def fine_tuning_line(cfg: dict, adapters_only: bool) -> str:
    peft = cfg.get("peft", "none")
    if peft == "none":
        return "full fine-tune (every weight trained)"
    return (f"{'QLoRA (4-bit base)' if peft == 'qlora' else 'LoRA'} r={cfg.get('lora_r')}, "
            f"alpha={cfg.get('lora_alpha')}, dropout={cfg.get('lora_dropout')}, on {cfg.get('lora_target_modules')}; "
            + ("this dir holds the adapters alone" if adapters_only else
               "the adapters are merged into the weights here"))


def training_rows(cfg: dict, facts: dict, adapters_only: bool = False) -> list[tuple[str, str]]:
    launch = cfg.get("launch") or {}
    accelerate_config = launch.get("accelerate_config") or {}
    world = facts.get("world_size") or launch.get("num_processes") or 1
    batch = cfg.get("per_device_batch_size", 0) * cfg.get("gradient_accumulation_steps", 1) * world
    per_step = (f"{batch:,} {{}} ({cfg.get('per_device_batch_size')} per process x "
                f"{cfg.get('gradient_accumulation_steps', 1)} accumulated x {world} processes)")
    steps = facts.get("steps")
    if cfg.get("task") == "image-classification":
        rows = [("Method", "supervised training (cross-entropy over the classes)"),
                ("Data", f"`{cfg.get('dataset')}` (images)")]
        if steps:
            rows.append(("Steps", f"{steps:,} of {per_step.format('images')}"))
    else:
        data_format = facts.get("data_format") or cfg.get("data_format")
        rows = [("Method", {"sft": "supervised fine-tuning (next-token loss)"}.get(recorded_objective(cfg),
                                                                                  recorded_objective(cfg).upper())),
                ("Fine-tuning", fine_tuning_line(cfg, adapters_only)),
                ("Data", data_line(cfg) + (f" ({data_format})" if data_format not in (None, "auto") else "")
                         + f", blocks of {cfg.get('block_size')} tokens, "
                         + f"packing {'on' if cfg.get('packing') else 'off'}")]
        if steps:
            tokens = steps * batch * cfg.get("block_size", 0)
            exact = cfg.get("packing") and data_format == "text"  # packed text fills every block
            rows.append(("Steps", f"{steps:,} of {per_step.format('sequences')}: "
                                  f"{'' if exact else 'at most '}{tokens:,} tokens"))
    rows.append(("Optimizer", f"{cfg.get('optimizer')}, learning rate {cfg.get('learning_rate')}, "
                              f"{cfg.get('lr_scheduler_type')} schedule, weight decay {cfg.get('weight_decay')}, "
                              f"seed {cfg.get('seed')}"))
    fsdp_version = facts.get("fsdp_version") or (accelerate_config.get("fsdp_config") or {}).get("fsdp_version")
    layout = (f"FSDP{fsdp_version}" if fsdp_version else f"DeepSpeed ZeRO-{facts['zero_stage']}"
              if facts.get("zero_stage") is not None
              else facts.get("distributed_type") or launch.get("distributed_type"))
    precision = facts.get("mixed_precision") or accelerate_config.get("mixed_precision")
    precision = "none (fp32)" if precision == "no" else precision
    rows.append(("Hardware", f"{world} process(es)"
                 + (f" on {facts['device_name']}" if facts.get("device_name") else "")
                 + (f", {layout}" if layout else "") + (f", mixed precision {precision}" if precision else "")))
    if facts.get("train_time_s") is not None:
        rows.append(("Train time", f"{facts['train_time_s']:.1f} s"))
    return rows


def score_line(scores: dict) -> str:
    """lm-eval's scores of one task, as `acc 0.4444, acc_norm 0.5694` (their `metric,filter` keys, no stderr)."""
    return ", ".join(f"{name.split(',')[0]} {value:.4f}" for name, value in scores.items()
                     if "," in name and "stderr" not in name)


def evaluation_lines(model_dir: Path, facts: dict, lm_eval: dict) -> list[str]:
    lines = []
    metric, first, last = facts.get("metric"), facts.get("first_eval"), facts.get("last_eval")
    if metric and first:
        lines.append(f"- Held-out {metric} before training: {first[metric]:.4f} (loss {first['eval_loss']:.4f})")
    if metric and last and last is not first:
        lines.append(f"- Held-out {metric} of this model: {last[metric]:.4f} (loss {last['eval_loss']:.4f}), "
                     "on the run's validation data")
    elif metric:
        lines.append(f"- Not evaluated at step {facts.get('steps')}: `finetune evaluate {model_dir}` scores it "
                     "on the run's validation data")
    for task, scores in sorted((lm_eval.get("results") or {}).items()):
        lines.append(f"- lm-evaluation-harness `{task}`: {score_line(scores)}")
    return lines or ["- No evaluation recorded."]


def has_chat_template(model_dir: Path) -> bool:
    return (model_dir / "chat_template.jinja").is_file() or bool(
        read_json_object(model_dir / "tokenizer_config.json").get("chat_template"))


def adapter_usage(model_dir: Path, base: str) -> list[str]:
    return ["```python", "from peft import PeftModel", "from transformers import AutoModelForCausalLM", "",
            f'base = AutoModelForCausalLM.from_pretrained("{base}")',
            f'model = PeftModel.from_pretrained(base, "{model_dir}")  # or .merge_and_unload() for one model', "```",
            "", "A merged model dir, or a GGUF file: `finetune export RUN --output DIR` "
                "(`--format gguf --output NAME.gguf`)."]


def usage(model_dir: Path, gguf_family: bool) -> list[str]:
    if has_chat_template(model_dir):
        ask = ['messages = [{"role": "user", "content": "What does json.dumps do?"}]',
               "ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors=\"pt\", "
               "return_dict=True)"]
    else:
        ask = ['ids = tokenizer("The", return_tensors="pt")']
    lines = ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
             f'model = AutoModelForCausalLM.from_pretrained("{model_dir}")',
             f'tokenizer = AutoTokenizer.from_pretrained("{model_dir}")', *ask,
             "print(tokenizer.decode(model.generate(**ids, max_new_tokens=60)[0]))", "```"]
    if gguf_family:
        lines += ["", "For llama.cpp / Ollama, as one GGUF file:", "", "```sh",
                  f"finetune export {model_dir} --format gguf --gguf_type q8_0 --output model-q8_0.gguf",
                  "llama-cli -m model-q8_0.gguf -cnv" + ("" if has_chat_template(model_dir) else " -p \"The\""),
                  "```"]
    return lines


def model_card(model_dir: Path, config, record: RunRecord | None) -> str:
    cfg, summary = (record.config, record.facts) if record else ({}, {})
    lm_eval = read_json_object(model_dir / LM_EVAL_RESULTS)
    base = str(cfg.get("model") or getattr(config, "_name_or_path", "") or "")
    from_scratch = base in GPT2_PRESETS or base in CNN_PRESETS
    causal = getattr(config, "model_type", "") != CNN_MODEL_TYPE
    adapters_only = (model_dir / "adapter_config.json").is_file()
    header = {"library_name": "peft" if adapters_only else "transformers",
              "pipeline_tag": "text-generation" if causal else "image-classification",
              "tags": ["finetune", recorded_objective(cfg) if causal else "image-classification"]
              + ([str(cfg["peft"])] if cfg.get("peft", "none") != "none" else [])}
    if base and is_hub_id(base):
        header["base_model"] = base
    if hub_datasets := [d for d in sources(cfg) if is_hub_id(d)]:
        header["datasets"] = hub_datasets
    if base and (license_name := base_license(base)):
        header["license"] = license_name

    title = model_dir.name if model_dir.name != "final" else f"{model_dir.parent.name}"
    origin = (f"trained from scratch (the `{base}` preset)" if from_scratch else
              f"fine-tuned from `{base}`" if base else "fine-tuned")
    lines = ["---", yaml.safe_dump(header, sort_keys=False).strip(), "---", "", f"# {title}", "",
             f"A {getattr(config, 'model_type', 'model')} model {origin} with finetune"
             + (f" ({recorded_objective(cfg).upper()})." if cfg and causal else "."), ""]
    if cfg:
        lines += ["## Training", "", "| | |", "| --- | --- |"]
        lines += [f"| {name} | {value} |" for name, value in training_rows(cfg, summary, adapters_only)]
        lines.append("")
    lines += ["## Evaluation", "", *evaluation_lines(model_dir, summary, lm_eval), ""]
    if (model_dir / "loss.png").is_file():
        lines += ["## Loss", "", "![training and validation loss](loss.png)", ""]
    if causal:
        lines += ["## Usage", "", *(adapter_usage(model_dir, base) if adapters_only else
                                    usage(model_dir, getattr(config, "model_type", "") in FAMILIES)), ""]
    return "\n".join(lines)


def write_model_card(model_dir: Path, config, record: RunRecord | None) -> Path:
    """README.md (and the run's loss.png beside it) in a model dir this tool wrote."""
    if record is not None and record.loss_plot is not None:
        replace_file(model_dir / "loss.png", record.loss_plot.read_bytes())
    card = model_card(model_dir, config, record)
    if record is not None:  # with the card's hash: a later refresh rewrites this card, never one its user wrote
        replace_file(model_dir / CARD_RECORD, json.dumps({"config": record.config, "facts": record.facts,
                                                          "card_sha256": sha256(card)}, indent=2))
    replace_file(model_dir / CARD, card)
    return model_dir / CARD


def refresh_model_card(model_dir: Path) -> bool:
    """The card again, with the scores the dir holds now: only where README.md
    is still the card this tool wrote (False: left as it is)."""
    saved = read_json_object(model_dir / CARD_RECORD) if is_own_file(model_dir / CARD_RECORD) else {}
    card = model_dir / CARD
    if (not is_own_file(card) or not isinstance(saved.get("config"), dict)
            or saved.get("card_sha256") != sha256(card.read_text(encoding="utf-8", errors="replace"))):
        return False
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    write_model_card(model_dir, config, RunRecord(saved["config"], saved.get("facts") or {}))
    return True


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
