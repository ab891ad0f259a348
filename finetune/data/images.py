"""Images for classification through `datasets`: load, split, convert.

Sources: a Hub dataset id shaped like MNIST (an image column and a label
column), a local .parquet file or dir of them, an image folder (one
sub-directory per class, `datasets`' imagefolder), or `builtin` (scikit-learn's
handwritten digits made MNIST-shaped, see digits.py). Every image is converted
once to grayscale `image_size` x `image_size` uint8 pixels; `pixel_values`
turns a batch of them into the model's float input.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from datasets import Array2D, ClassLabel, DatasetDict, Features, Image, Value, load_dataset

from finetune.data.digits import build_digits
from finetune.errors import UsageError

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


def _load_local(path: Path) -> DatasetDict:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    parquet = [p for p in files if p.suffix == ".parquet"]
    images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
    if not parquet and not images:
        raise UsageError(f"--dataset {path} holds no .parquet files or images; point it at a parquet file, "
                         "a dir of them, or an image folder with one sub-directory per class")
    if empty := next((p for p in parquet or images if p.stat().st_size == 0), None):
        raise UsageError(f"--dataset {path}: {empty} is empty; remove it or write the data again")
    try:
        if parquet:
            if path.is_dir():  # train*/test* file names keep their splits (datasets' own naming rules)
                return load_dataset("parquet", data_dir=str(path))
            return load_dataset("parquet", data_files=str(path))
        return load_dataset("imagefolder", data_dir=str(path))
    except Exception as e:  # datasets raises many types for unreadable files
        raise UsageError(f"could not read --dataset {path} ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
                         "check the files") from None


def load_raw_images(dataset: str) -> DatasetDict:
    if dataset == "builtin":
        return build_digits()
    if Path(dataset).exists():
        return _load_local(Path(dataset))
    if dataset.startswith((".", "/", "~")) or dataset.endswith(".parquet"):
        raise UsageError(f"--dataset {dataset} does not exist; pass an existing file or dir, a Hub id, or 'builtin'")
    try:
        return load_dataset(dataset)
    except Exception as e:
        raise UsageError(f"could not load Hub dataset {dataset!r} ({type(e).__name__}); "
                         "check the id and the network, or pass a local parquet file, image folder or 'builtin'") from None


def load_images(dataset: str, image_column: str, label_column: str, image_size: int, validation_split: float,
                seed: int) -> tuple[DatasetDict, list[str] | None]:
    """`train` and `validation` splits with `pixels` (uint8, image_size^2) and
    `label` (int), and the class names when the data has them."""
    raw = load_raw_images(dataset)
    train = raw["train"] if "train" in raw else raw[next(iter(raw))]
    for column, option in ((image_column, "--image_column"), (label_column, "--label_column")):
        if column not in train.column_names:
            raise UsageError(f"--dataset {dataset} has no column {column!r} (columns: {', '.join(train.column_names)}); "
                             f"pass {option} with the right name")
    if len(train) == 0:
        raise UsageError(f"--dataset {dataset} holds no images; give it some")

    held_out = [name for name in ("test", "validation") if name in raw and len(raw[name]) > 0]
    if held_out:
        raw = DatasetDict(train=train, validation=raw[held_out[0]])
    elif len(train) < 2:
        raise UsageError(f"--dataset {dataset} holds one image; give it enough to hold some out for evaluation")
    else:
        split = train.train_test_split(test_size=validation_split, seed=seed)
        raw = DatasetDict(train=split["train"], validation=split["test"])

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
