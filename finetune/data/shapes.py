"""The embedded default for vision-language models: pictures the tool draws
itself (a shape in a colour, on a plain ground, at a random place and size)
with a question about each and its one-word answer, in TRL's formats, each
row with an `images` column of PNG files beside them:

- `shapes.jsonl`: chat rows (SFT), the question and its answer;
- `pairs.jsonl`: preference rows (DPO), the right answer chosen over a wrong
  one of the same kind (another colour, another shape): only the pixels tell;
- `prompts.jsonl`: prompt rows with an `answer` column (GRPO's exact_match).

Drawn with PIL, deterministic, built at run time into the cache and never
committed. The answers can be learnt from the pixels alone, by a tiny model on
two cores: the colour in a few dozen steps, the shape in a few hundred.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

from finetune.data.builtin import cache_root

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "yellow": (235, 200, 20)}
SHAPES = ("square", "circle", "triangle")
QUESTIONS = {"colour": "What colour is the shape?", "shape": "What shape is drawn?"}
SIDE = 32      # pixels; every processor resizes to its own size
COUNT = 480    # rows: the held-out split (--validation_split) comes from these
VERSION = 2    # bump when the drawing changes: the cache is keyed by it


def draw(shape: str, colour: str, rng: random.Random):
    from PIL import Image, ImageDraw

    ground = rng.choice([(255, 255, 255), (0, 0, 0), (128, 128, 128)])
    image = Image.new("RGB", (SIDE, SIDE), ground)
    size = rng.randint(SIDE // 2, SIDE - 4)
    left, top = rng.randint(0, SIDE - size), rng.randint(0, SIDE - size)
    box = (left, top, left + size - 1, top + size - 1)
    pen = ImageDraw.Draw(image)
    fill = COLOURS[colour]
    if shape == "square":
        pen.rectangle(box, fill=fill)
    elif shape == "circle":
        pen.ellipse(box, fill=fill)
    else:
        pen.polygon([(left + size / 2, top), (left, top + size - 1), (left + size - 1, top + size - 1)], fill=fill)
    return image


def said(answer: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": answer}]}


def build_shapes(count: int = COUNT, seed: int = 0, cache: Path | None = None) -> Path:
    """The chat rows' .jsonl file (images/ and the other formats' files beside it), built once per cache."""
    root = (cache or cache_root()) / f"shapes-v{VERSION}-{count}-{seed}"
    data = root / "shapes.jsonl"
    if data.is_file():
        return data
    rng, wrongs = random.Random(seed), random.Random(seed + 1)  # the pairs' draws leave the drawings' alone
    building = root.with_name(f"{root.name}.building-{os.getpid()}")  # runs started together each build their own
    (building / "images").mkdir(parents=True, exist_ok=True)
    files = {"shapes.jsonl": [], "pairs.jsonl": [], "prompts.jsonl": []}
    for i in range(count):
        shape, colour, asked = rng.choice(SHAPES), rng.choice(list(COLOURS)), rng.choice(list(QUESTIONS))
        name = f"images/{i:05d}.png"
        draw(shape, colour, rng).save(building / name)
        answer, kind = (colour, list(COLOURS)) if asked == "colour" else (shape, SHAPES)
        question = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[asked]}]}]
        files["shapes.jsonl"].append({"messages": [*question, said(answer)], "images": [name]})
        wrong = wrongs.choice([word for word in kind if word != answer])
        files["pairs.jsonl"].append({"prompt": question, "chosen": [said(answer)], "rejected": [said(wrong)],
                                     "images": [name]})
        files["prompts.jsonl"].append({"prompt": question, "answer": answer, "images": [name]})
    for file, rows in files.items():
        (building / file).write_text("".join(json.dumps(row) + "\n" for row in rows))
    try:
        building.rename(root)  # whole or not at all
    except OSError:  # another process finished first: its rows are these
        shutil.rmtree(building, ignore_errors=True)
    return data
