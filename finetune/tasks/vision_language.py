"""Vision-language models (`--task image-text-to-text`): conversations with
images, rendered and tokenized by the model's own processor as each batch is
made (data/vision.py); next-token cross-entropy on the answers, perplexity.
The model is transformers' AutoModelForImageTextToText class of the family
(LLaVA, Qwen2.5-VL, Idefics3/SmolVLM, Gemma 3, ...): its vision tower's
blocks and its language model's layers are the FSDP units it names."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs
from datasets import Dataset, DatasetDict
from transformers import AutoProcessor, PreTrainedModel

from finetune.backends.base import Backend
from finetune.collectives import main_process_first
from finetune.data.chat import EXAMPLE_NUMBER
from finetune.data.mixture import RowStream
from finetune.data.shapes import build_shapes
from finetune.data.sources import limit_samples
from finetune.data.text import load_raw_data, load_sources
from finetune.data.vision import CheckedRows, VisionChatEncoder, VisionCollator, check_rows
from finetune.errors import UsageError
from finetune.models.vision import PROJECTORS, VISION_TOWERS, part_named
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


def resize_images(processor, cfg) -> None:
    """--max_pixels/--min_pixels (processors that resize by pixel count:
    Qwen-VL's) and --image_size (those that resize by the longest side:
    Idefics3's, SmolVLM's) set on the image processor, which is saved with
    the model so that it is used as trained."""
    images = processor.image_processor
    kind, size = type(images).__name__, images.size
    by_pixels = hasattr(images, "patch_size") and hasattr(images, "merge_size")
    if cfg.max_pixels or cfg.min_pixels:
        named = "--max_pixels" if cfg.max_pixels else "--min_pixels"
        if not by_pixels:
            fix = "pass --image_size" if getattr(size, "longest_edge", None) else "drop it"
            raise UsageError(f"{named} resizes images by their pixel count, which the processor of --model {cfg.model} "
                             f"({kind}) does not; {fix}")
        factor = images.patch_size * images.merge_size  # one image token's square of pixels
        for name in ("max_pixels", "min_pixels"):
            if 0 < getattr(cfg, name) < factor**2:
                raise UsageError(f"--{name} {getattr(cfg, name)} is below the family's minimum of {factor**2} pixels "
                                 f"(one image token covers {factor}x{factor}); pass {factor**2} or more")
        if cfg.max_pixels:
            size.longest_edge = cfg.max_pixels
        if cfg.min_pixels:
            size.shortest_edge = cfg.min_pixels
    if cfg.image_size:
        if by_pixels or not getattr(size, "longest_edge", None):
            fix = "pass --max_pixels" if by_pixels else "its vision tower takes one size; drop it"
            raise UsageError(f"--image_size sets the longest side for processors that resize by it (Idefics3's, "
                             f"SmolVLM's), not the processor of --model {cfg.model} ({kind}); {fix}")
        size.longest_edge = cfg.image_size


def freeze_parts(model: PreTrainedModel, cfg) -> list[str]:
    """--freeze_vision_tower and --freeze_projector: those parts keep their
    loaded weights (no gradients, no optimizer state, no LoRA adapters). The
    names of the parts frozen."""
    frozen = []
    for asked, names, option in ((cfg.freeze_vision_tower, VISION_TOWERS, "--freeze_vision_tower false"),
                                 (cfg.freeze_projector, PROJECTORS, "--freeze_projector false")):
        if not asked:
            continue
        name, module = part_named(model, names)
        if module is None:
            raise UsageError(f"{type(model).__name__} has no module named {' or '.join(names)} to freeze; pass "
                             f"{option}")
        module.requires_grad_(False)
        frozen.append(name)
    return frozen


class VisionLanguageLM(CausalLM):
    name = "image-text-to-text"
    batch_size_options = "--per_device_batch_size"
    formats: tuple[str, ...] = IMAGE_FORMATS  # the data formats it trains on
    collator = VisionCollator                 # what makes its batches of rows
    rows_are = "conversations"                # what a row is, in the data's description
    builtin = "shapes.jsonl"                  # the embedded default's file, in this format (data/shapes.py)
    processor = None                          # the model's (load_processor), once built
    image_root: Path | None = None            # where the rows' image paths start

    def build(self, accelerator: Accelerator, backend: Backend, run_dir: Path) -> tuple[PreTrainedModel, TaskData]:
        cfg = self.cfg
        if cfg.streaming:
            splits, root, description, data_format, stream = main_process_first(
                accelerator, lambda: self._streamed(accelerator.process_index, accelerator.num_processes))
        else:
            (splits, root, description, data_format), stream = main_process_first(accelerator, self._rows), None
        if accelerator.is_main_process:
            run_dir.mkdir(parents=True, exist_ok=True)
        from_main = self._loading_plan(accelerator, backend)
        self.rows_hold_examples = False  # one conversation a row, padded
        # A tower trained whole has layers the language model never reads (CLIP's pooling norm when the
        # features come from a hidden layer): DDP must not wait for their gradients.
        if accelerator.ddp_handler is None:
            accelerator.ddp_handler = DistributedDataParallelKwargs(find_unused_parameters=True)
        self.processor, self.image_root = self._processor(), root
        model = self._pretrained_weights(accelerator, from_main)
        self._check_block_size(model)
        frozen = freeze_parts(model, cfg)
        model = self._made_trainable(model, accelerator, from_main)
        self._loaded(accelerator, backend, model, from_main)
        if frozen:
            description += f"; frozen: {', '.join(frozen)}"
        tokenizer = self.processor.tokenizer
        return model, TaskData(splits["train"], splits["validation"], tokenizer, description,
                               collate=self._collate(data_format, tokenizer), data_format=data_format,
                               processor=self.processor, stream=stream)

    def _processor(self):
        processor = load_processor(self.model_source, self.cfg.model, self.cfg.trust_remote_code)
        resize_images(processor, self.cfg)
        return processor

    def _collate(self, data_format: str, tokenizer) -> VisionCollator:
        return self.collator(VisionChatEncoder(self.processor, self.cfg.train_on_prompt), self.cfg.block_size,
                             self.image_root)

    def _dataset(self) -> str:
        return str(build_shapes().with_name(self.builtin)) if self.cfg.dataset == "builtin" else self.cfg.dataset

    def _streamed(self, rank: int, world_size: int) -> tuple[dict, Path | None, str, str, RowStream]:
        """--streaming: the held-out rows (read first, checked), and this
        rank's training rows as a stream, each row checked as it is read."""
        cfg = self.cfg
        dataset = self._dataset()
        loaded = load_sources(replace(cfg, dataset=dataset), rank, world_size)
        data_format = self._checked_format(loaded.sources[0].data_format)
        root, name = data_root(dataset), f"--dataset {cfg.dataset}"
        validation = Dataset.from_list([{**row, EXAMPLE_NUMBER: i + 1} for i, row in enumerate(loaded.validation[0])])
        images = check_rows(validation, root, name, self.collator.talks)
        stream = RowStream(loaded.sources, CheckedRows(root, name, self.collator.talks), "rows", cfg.block_size,
                           cfg.mixture_stop, cfg.seed, rank, workers=cfg.dataloader_num_workers)
        description = (f"{self.rows_are} streamed from {cfg.dataset}, each checked as it is read; "
                       f"{len(validation)} held-out {self.rows_are} with {images} images")
        return {"train": None, "validation": validation}, root, description, data_format, stream

    def _rows(self) -> tuple[DatasetDict, Path | None, str, str]:
        """The splits (rows as stored, images not decoded), the dir image paths
        start from, what they hold, and their format; every row and image checked."""
        cfg = self.cfg
        dataset = self._dataset()
        raw, data_format = load_raw_data(dataset, cfg.data_format, cfg.text_column, cfg.validation_split, cfg.seed,
                                         config=cfg.dataset_config, split=cfg.dataset_split, eval_split=cfg.eval_split,
                                         objective=cfg.objective)
        self._checked_format(data_format)
        raw = limit_samples(raw, cfg.max_train_samples, cfg.max_eval_samples)
        root = data_root(dataset)
        images = {name: check_rows(split, root, f"--dataset {cfg.dataset}", self.collator.talks)
                  for name, split in raw.items()}
        description = (f"{len(raw['train'])} train / {len(raw['validation'])} validation {self.rows_are} with "
                       f"{images['train']} / {images['validation']} images")
        return raw, root, description, data_format

    def _checked_format(self, data_format: str) -> str:
        if data_format not in self.formats:
            raise UsageError(f"--task {self.name} trains on conversations (messages, with an images column) or "
                             f"prompt/completion rows with an image column, and --dataset {self.cfg.dataset} holds "
                             f"{data_format} rows; give it those columns")
        return data_format

    def targets(self, batch: dict) -> int:
        return int((next_token_targets(batch["labels"]) != IGNORE).sum())

    def inputs(self, model, batch: dict) -> dict:
        """The whole batch the processor made (pixels, image grids, token
        types: every family takes its own), but the labels."""
        return {**{key: value for key, value in batch.items() if key != "labels"}, "use_cache": False}

    def _forward(self, model, batch: dict) -> Scores:
        targets = next_token_targets(batch["labels"])
        nll = full_logits_nll(model(**self.inputs(model, batch)).logits, targets)
        return Scores(nll, nll.sum(), targets != IGNORE, batch["attention_mask"].sum())

    def held_out(self, model: PreTrainedModel, tokenizer) -> Scored:
        if self.cfg.streaming:
            splits, self.image_root, _, data_format, stream = self._streamed(rank=0, world_size=1)
            stream.close()
        else:
            splits, self.image_root, _, data_format = self._rows()
        self.processor = self._processor()
        return Scored(splits["validation"], self._collate(data_format, tokenizer), len(splits["validation"]))
