"""Images for classification: the image and label columns of any source (see
sources.py), converted to pixels.

Sources shaped like MNIST (an image column and a label column): a Hub dataset
id, a local .parquet file or dir of them, an image folder (one sub-directory
per class, `datasets`' imagefolder), or `builtin` (scikit-learn's handwritten
digits made MNIST-shaped, see digits.py). Every image is converted
once to grayscale `image_size` x `image_size` uint8 pixels; `pixel_values`
turns a batch of them into the model's float input.
"""

from __future__ import annotations

import numpy as np
import torch
from datasets import Array2D, ClassLabel, DatasetDict, Features, Image, Value

from finetune.data.digits import build_digits
from finetune.data.locations import IMAGE_FILES
from finetune.data.sources import load_source, train_and_held_out, train_split
from finetune.errors import UsageError


def load_images(dataset: str, image_column: str, label_column: str, image_size: int, validation_split: float,
                seed: int, *, config: str = "", split: str = "",
                eval_split: str = "") -> tuple[DatasetDict, list[str] | None]:
    """`train` and `validation` splits with `pixels` (uint8, image_size^2) and
    `label` (int), and the class names when the data has them."""
    raw = load_source(dataset, build_digits, IMAGE_FILES,
                      ".parquet files or images (an image folder has one sub-directory per class)", config)
    columns = train_split(raw, split).column_names
    for column, option in ((image_column, "--image_column"), (label_column, "--label_column")):
        if column not in columns:
            raise UsageError(f"--dataset {dataset} has no column {column!r} (columns: {', '.join(columns)}); "
                             f"pass {option} with the right name")
    if len(train_split(raw, split)) == 0:
        raise UsageError(f"--dataset {dataset} holds no images; give it some")
    raw = train_and_held_out(raw, validation_split, seed, split, eval_split)

    label_feature = raw["train"].features[label_column]
    names = list(label_feature.names) if isinstance(label_feature, ClassLabel) else None
    if not isinstance(raw["train"].features[image_column], Image):  # e.g. raw bytes in a parquet column
        raw = raw.cast_column(image_column, Image())

    def to_pixels(batch):
        pixels = [np.asarray(img.convert("L").resize((image_size, image_size))) for img in batch[image_column]]
        return {"pixels": pixels, "label": [int(label) for label in batch[label_column]]}

    features = Features({"pixels": Array2D((image_size, image_size), "uint8"), "label": Value("int64")})
    try:
        converted = raw.map(to_pixels, batched=True, remove_columns=raw["train"].column_names, features=features,
                            desc="converting images")
    except (OSError, ValueError, TypeError) as e:
        raise UsageError(f"could not convert the images of --dataset {dataset} ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:120]}); check --image_column and --label_column") from None
    return converted.with_format("torch"), names


def check_labels(splits: DatasetDict, num_labels: int, dataset: str) -> None:
    for name, split in splits.items():
        labels = list(split.with_format(None)["label"])
        if labels and (min(labels) < 0 or max(labels) >= num_labels):
            raise UsageError(f"--dataset {dataset} has {name} labels {min(labels)}..{max(labels)} but the "
                             f"model predicts {num_labels} classes (0..{num_labels - 1}); use a model with that many labels")


def pixel_values(batch: dict) -> torch.Tensor:
    """uint8 [B, H, W] -> float [B, 1, H, W] in [0, 1]."""
    return batch["pixels"].unsqueeze(1).float() / 255.0
