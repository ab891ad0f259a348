"""The embedded default images: real handwritten digits that ship with
scikit-learn (1,797 scans, 8x8, 16 grey levels, from the UCI optical
recognition of handwritten digits set), made MNIST-shaped at run time.

Each scan is upsampled to 20x20 and centred in a 28x28 frame, as MNIST centres
its 20x20 digits, and the result is a `datasets` DatasetDict with an `image`
column (PIL images) and a `label` ClassLabel: the same shape as the MNIST and
Fashion-MNIST Hub datasets, so it goes through the same loading code.
The test split is fixed (seed 0, stratified by digit), whatever the run seed.
"""

from __future__ import annotations

import numpy as np
import torch
from datasets import ClassLabel, Dataset, DatasetDict, Features, Image

TEST_FRACTION = 0.2
DIGIT_SIZE, FRAME_SIZE = 20, 28


def mnist_shaped(scans: np.ndarray) -> np.ndarray:
    """[N, 8, 8] scans with values 0..16 -> [N, 28, 28] uint8 images, digit centred."""
    x = torch.from_numpy(scans.astype(np.float32) / 16.0).unsqueeze(1)
    x = torch.nn.functional.interpolate(x, size=(DIGIT_SIZE, DIGIT_SIZE), mode="bilinear", align_corners=False)
    pad = (FRAME_SIZE - DIGIT_SIZE) // 2
    x = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    return (x.squeeze(1).clamp(0, 1) * 255).round().to(torch.uint8).numpy()


def build_digits() -> DatasetDict:
    from sklearn.datasets import load_digits  # the data file is part of the scikit-learn wheel

    digits = load_digits()
    features = Features({"image": Image(), "label": ClassLabel(names=[str(d) for d in range(10)])})
    data = Dataset.from_dict({"image": list(mnist_shaped(digits.images)), "label": digits.target.tolist()},
                             features=features)
    split = data.train_test_split(test_size=TEST_FRACTION, seed=0, stratify_by_column="label")
    return DatasetDict(train=split["train"], test=split["test"])
