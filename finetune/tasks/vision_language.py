"""Vision-language models (`--task image-text-to-text`): conversations with
images, rendered and tokenized by the model's own processor as each batch is
made (data/vision.py); next-token cross-entropy on the answers, perplexity.
The model is transformers' AutoModelForImageTextToText class of the family
(LLaVA, Qwen2.5-VL, Idefics3/SmolVLM, Gemma 3, ...): its vision tower's
blocks and its language model's layers are the FSDP units it names."""

from __future__ import annotations

from pathlib import Path

from accelerate import Accelerator
from datasets import DatasetDict
from transformers import AutoProcessor, PreTrainedModel

from finetune.backends.base import Backend
from finetune.collectives import main_process_first
from finetune.data.shapes import build_shapes
from finetune.data.sources import limit_samples
from finetune.data.text import load_raw_data
from finetune.data.vision import VisionChatEncoder, VisionCollator, check_rows
from finetune.errors import UsageError
from finetune.tasks.base import Scored, TaskData
from finetune.tasks.causal_lm import CausalLM, Scores
from finetune.tasks.lm_loss import IGNORE, full_logits_nll, next_token_targets

IMAGE_FORMATS = ("chat", "prompt_completion")


def data_root(dataset: str) -> Path | None:
    """Where the data's relative image paths start: the data file's dir (a
    dir or a glob: the dir named); none for a Hub dataset."""
    path = Path(dataset)
    if path.is_file():
        return path.parent
    if path.is_dir():
        return path
    return path.parent if any(c in dataset for c in "*?[") and path.parent.is_dir() else None


def load_processor(source: str, model: str, trust_remote_code: bool):
    """The model's own processor: its chat template, image tokens and resizing."""
    try:
        processor = AutoProcessor.from_pretrained(source, trust_remote_code=trust_remote_code)
    except ImportError as e:  # Qwen-VL's processors need torchvision (video frames)
        raise UsageError(f"the processor of --model {model} needs a package that is not installed "
                         f"({str(e).strip().splitlines()[0][:160]}); install it (torchvision built for your torch)"
                         ) from None
    except (OSError, ValueError, TypeError) as e:
        raise UsageError(f"--model {model} has no usable processor ({str(e).strip().splitlines()[0][:160]}); save "
                         "the model's processor next to it with processor.save_pretrained") from None
    if getattr(processor, "image_processor", None) is None or getattr(processor, "tokenizer", None) is None:
        raise UsageError(f"--model {model} has no image processor: it reads text alone; pass a vision-language model "
                         "(LLaVA, Qwen2.5-VL, Gemma 3, SmolVLM, ...), or train this one with --task causal-lm")
    if not processor.chat_template:
        raise UsageError(f"the processor of --model {model} has no chat template to render conversations with "
                         "images; save the family's template with its processor")
    return processor


class VisionLanguageLM(CausalLM):
    name = "image-text-to-text"
    throughput_key = "tokens_per_sec"
    batch_size_options = "--per_device_batch_size"

    def build(self, accelerator: Accelerator, backend: Backend, run_dir: Path) -> tuple[PreTrainedModel, TaskData]:
        cfg = self.cfg
        (splits, root, description), data_format = main_process_first(accelerator, self._rows)
        if accelerator.is_main_process:
            run_dir.mkdir(parents=True, exist_ok=True)
        from_main = self._loading_plan(accelerator, backend)
        self.rows_hold_examples = False  # one conversation a row, padded
        processor = load_processor(self.model_source, cfg.model, cfg.trust_remote_code)
        model = self._pretrained_weights(accelerator, from_main)
        self._check_block_size(model)
        model = self._made_trainable(model, accelerator, from_main)
        self._loaded(accelerator, backend, model, from_main)
        collate = VisionCollator(VisionChatEncoder(processor, cfg.train_on_prompt), cfg.block_size, root)
        self.routers = None
        return model, TaskData(splits["train"], splits["validation"], processor.tokenizer, description,
                               collate=collate, data_format=data_format, processor=processor)

    def _rows(self) -> tuple[tuple[DatasetDict, Path | None, str], str]:
        """The splits (rows as stored, images not decoded), the dir image paths
        start from, and what they hold; every row and image checked."""
        cfg = self.cfg
        dataset = str(build_shapes()) if cfg.dataset == "builtin" else cfg.dataset
        raw, data_format = load_raw_data(dataset, cfg.data_format, cfg.text_column, cfg.validation_split, cfg.seed,
                                         config=cfg.dataset_config, split=cfg.dataset_split, eval_split=cfg.eval_split,
                                         objective=cfg.objective)
        if data_format not in IMAGE_FORMATS:
            raise UsageError(f"--task {self.name} trains on conversations (messages, with an images column) or "
                             f"prompt/completion rows with an image column, and --dataset {cfg.dataset} holds "
                             f"{data_format} rows; give it those columns")
        raw = limit_samples(raw, cfg.max_train_samples, cfg.max_eval_samples)
        root = data_root(dataset)
        images = {name: check_rows(split, root, f"--dataset {cfg.dataset}") for name, split in raw.items()}
        description = (f"{len(raw['train'])} train / {len(raw['validation'])} validation conversations with "
                       f"{images['train']} / {images['validation']} images")
        return (raw, root, description), data_format

    def targets(self, batch: dict) -> int:
        return int((next_token_targets(batch["labels"]) != IGNORE).sum())

    def _forward(self, model, batch: dict) -> Scores:
        """The whole batch the processor made goes in (pixels, image grids,
        token types): every family takes its own."""
        targets = next_token_targets(batch["labels"])
        inputs = {key: value for key, value in batch.items() if key != "labels"}
        nll = full_logits_nll(model(**inputs, use_cache=False).logits, targets)
        return Scores(nll, nll.sum(), targets != IGNORE, batch["attention_mask"].sum())

    def held_out(self, model: PreTrainedModel, tokenizer) -> Scored:
        cfg = self.cfg
        (splits, root, _), _ = self._rows()
        processor = load_processor(self.model_source, cfg.model, cfg.trust_remote_code)
        collate = VisionCollator(VisionChatEncoder(processor, cfg.train_on_prompt), cfg.block_size, root)
        return Scored(splits["validation"], collate, len(splits["validation"]))
