"""Fast, single-process tests of the image pieces: the built-in digits, local
image data, the lectures' CNN, the recipe defaults and the data order."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader
from transformers import AutoModelForImageClassification

from finetune.config import load_config
from finetune.data.digits import build_digits
from finetune.data.images import check_labels, load_images
from finetune.backends.accelerator import build_accelerator
from finetune.errors import UsageError
from finetune.models.cnn import LectureCNN, LectureCNNConfig


@pytest.fixture(scope="module")
def digits():
    return build_digits()


@pytest.fixture(scope="module")
def builtin_pixels():
    splits, names = load_images("builtin", "image", "label", 28, 0.1, 0)
    return splits, names


def test_builtin_digits_are_mnist_shaped_and_fixed(digits):
    assert (len(digits["train"]), len(digits["test"])) == (1437, 360)
    assert digits["train"].features["label"].num_classes == 10
    image = np.asarray(digits["train"][0]["image"])
    assert image.shape == (28, 28) and image.dtype == np.uint8 and image.max() > 200
    # The 20x20 digit sits in the middle of a blank 28x28 frame, as in MNIST.
    assert image[:4].max() == 0 and image[-4:].max() == 0 and image[:, :4].max() == 0 and image[:, -4:].max() == 0
    again = build_digits()
    assert again["test"]["label"][:] == digits["test"]["label"][:]
    assert np.array_equal(np.asarray(again["test"][5]["image"]), np.asarray(digits["test"][5]["image"]))


def test_parquet_and_image_folder_load_like_the_builtin(digits, builtin_pixels, tmp_path):
    expected, names = builtin_pixels
    assert names == [str(d) for d in range(10)]
    digits["train"].to_parquet(str(tmp_path / "parquet" / "train.parquet"))
    digits["test"].to_parquet(str(tmp_path / "parquet" / "test.parquet"))
    folder = tmp_path / "folder"
    for split in ("train", "test"):
        for i, row in enumerate(digits[split].select(range(40))):
            (folder / split / str(row["label"])).mkdir(parents=True, exist_ok=True)
            row["image"].save(folder / split / str(row["label"]) / f"{i}.png")

    from_parquet, _ = load_images(str(tmp_path / "parquet"), "image", "label", 28, 0.1, 0)
    assert torch.equal(from_parquet["validation"]["pixels"][:], expected["validation"]["pixels"][:])
    assert torch.equal(from_parquet["train"]["label"][:], expected["train"]["label"][:])

    from_folder, _ = load_images(str(folder), "image", "label", 28, 0.1, 0)
    assert len(from_folder["train"]) == 40 and len(from_folder["validation"]) == 40
    # imagefolder numbers the classes by sorted folder name; here those are the digits themselves
    pixels = {tuple(p.flatten().tolist()): int(label) for p, label in
              zip(from_folder["train"]["pixels"][:], from_folder["train"]["label"][:])}
    for p, label in zip(expected["train"]["pixels"][:40], expected["train"]["label"][:40]):
        assert pixels[tuple(p.flatten().tolist())] == int(label)


def test_missing_columns_and_foreign_labels_are_clear_errors(digits, builtin_pixels, tmp_path):
    digits["train"].rename_column("label", "digit").to_parquet(str(tmp_path / "d.parquet"))
    with pytest.raises(UsageError, match="no column 'label'.*columns: image, digit.*--label_column"):
        load_images(str(tmp_path / "d.parquet"), "image", "label", 28, 0.1, 0)
    splits, _ = load_images(str(tmp_path / "d.parquet"), "image", "digit", 28, 0.1, 0)
    assert len(splits["train"]) + len(splits["validation"]) == 1437
    with pytest.raises(UsageError, match="labels 0..9 but the model predicts 5 classes"):
        check_labels(builtin_pixels[0], 5, "builtin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="holds no .parquet files or images"):
        load_images(str(tmp_path / "empty"), "image", "label", 28, 0.1, 0)


def test_cnn_sums_two_branches_and_returns_logits():
    model = LectureCNN(LectureCNNConfig()).eval()
    x = torch.rand(5, 1, 28, 28)
    branches = model.linear_stack1(model.cnn_stack1(x)) + model.linear_stack2(model.cnn_stack2(x))
    logits = model(x).logits
    assert logits.shape == (5, 10)
    assert torch.equal(logits, model.softmax_stack(branches))
    assert not torch.allclose(logits.sum(-1), torch.ones(5))  # logits, not probabilities
    assert torch.allclose(model.predict_proba(x), logits.softmax(-1))


def test_cnn_saves_and_loads_through_the_auto_classes(tmp_path):
    model = LectureCNN(LectureCNNConfig(hidden_size=32))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForImageClassification.from_pretrained(tmp_path)
    assert isinstance(loaded, LectureCNN) and loaded.config.hidden_size == 32
    x = torch.rand(2, 1, 28, 28)
    assert torch.equal(loaded(x).logits, model(x).logits)


def test_image_task_defaults_are_the_lecture_recipe_and_overridable(tmp_path):
    cfg = load_config(None, {"task": "image-classification"})
    assert (cfg.model, cfg.optimizer, cfg.learning_rate, cfg.adam_beta2, cfg.weight_decay) == \
        ("lecture-cnn", "adam", 1e-2, 0.999, 1e-4)
    assert (cfg.lr_scheduler_type, cfg.lr_gamma, cfg.max_grad_norm, cfg.gradient_accumulation_steps,
            cfg.per_device_batch_size, cfg.checkpoint_every_epochs) == ("step", 0.5, 0.1, 4, 64, 5)
    path = tmp_path / "run.yaml"
    path.write_text("task: image-classification\nlearning_rate: 0.003\n")
    cfg = load_config(path, {"per_device_batch_size": "16"})
    assert (cfg.learning_rate, cfg.per_device_batch_size, cfg.optimizer) == (0.003, 16, "adam")
    assert load_config(None, {}).optimizer == "adamw"  # causal-lm keeps its own


def test_epoch_order_is_shared_by_the_ranks_and_changes_by_epoch():
    """The sampler settings the training Accelerator uses, applied as rank 0 and
    rank 1 of 2: both cut the same permutation, which differs by epoch."""
    settings = build_accelerator(1, seed=7).dataloader_config
    assert settings.use_seedable_sampler

    def epoch_order(rank: int, epoch: int) -> list[int]:
        loader = prepare_data_loader(DataLoader(list(range(48)), batch_size=4, shuffle=True, drop_last=True),
                                     num_processes=2, process_index=rank, use_seedable_sampler=True,
                                     data_seed=settings.data_seed)
        loader.set_epoch(epoch)
        return [int(i) for batch in loader for i in batch]

    for epoch in (0, 1):
        rank0, rank1 = epoch_order(0, epoch), epoch_order(1, epoch)
        assert sorted(rank0 + rank1) == list(range(48))  # disjoint halves of one permutation
        assert epoch_order(0, epoch) == rank0  # the same again, e.g. after a resume
    assert epoch_order(0, 0) != epoch_order(0, 1)
    assert epoch_order(0, 0) != sorted(epoch_order(0, 0))  # shuffled at all
