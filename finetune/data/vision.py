"""Image and text conversations for vision-language models, in TRL's formats:
`messages` whose turns hold `{"type": "image"}` parts beside an `images`
column, or an `image` (or `images`) with `prompt`/`completion`.

Rows are checked when the data loads (every image is found and its header
read), but decoded only when a batch is made, in the data workers. The
model's own processor renders each conversation with its chat template,
resizes the images and expands each image part into the family's image
tokens. Labels fall on the answers only (found as for text chat, chat.py) and
never on a token of an expanded image or one that marks images (Qwen-VL's
`<|vision_start|>`), whatever --train_on_prompt says.
"""

from __future__ import annotations

import io
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from finetune.data.chat import EXAMPLE_NUMBER, IGNORE, ROLES, ChatEncoder
from finetune.errors import UsageError

IMAGE_COLUMNS = ("images", "image")
# The per-token tensors a processor returns (the rest are per image: pixels, grids, patch masks).
TOKEN_KEYS = ("input_ids", "attention_mask", "labels", "token_type_ids", "mm_token_type_ids")


def image_refs(row: dict) -> list:
    """The row's images, as stored: paths, {bytes, path} dicts (datasets'
    Image storage) or PIL images (a decoded Image column)."""
    value = next((row[c] for c in IMAGE_COLUMNS if row.get(c) is not None), None)
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


IMAGE_WORDS = ("image", "video", "vision", "boi", "eoi")  # in the names of a processor's image-token attributes
MARKER_WORDS = ("image", "vision", "video", "img")        # in the text of the tokens that mark images


def image_token_ids(processor) -> tuple[int, ...]:
    """The ids of the tokens that stand for or mark images: those the
    processor names (`image_token_id`, Gemma 3's `boi_token`, Idefics3's
    `fake_image_token_id`, ...) and the added tokens named for images
    (Qwen-VL's `<|vision_start|>`, which its chat template writes)."""
    ids = {i for token, i in processor.tokenizer.get_added_vocab().items()
           if any(word in token.lower() for word in MARKER_WORDS)}
    for name, value in vars(processor).items():
        if not any(word in name for word in IMAGE_WORDS):
            continue
        if name.endswith("_token_id") and isinstance(value, int):
            ids.add(value)
        elif name.endswith("_token") and isinstance(value, str):
            token = processor.tokenizer.convert_tokens_to_ids(value)
            if isinstance(token, int) and token != processor.tokenizer.unk_token_id:
                ids.add(token)
    return tuple(sorted(ids))


def _inside(path: Path, root: Path | None, where: str) -> Path:
    """A relative path read from the data names a file inside the data's dir,
    as a dataset card's files must (locations.py)."""
    if root is None or path.is_absolute() or path.parts[:1] == ("~",):
        raise UsageError(f"{where}: the image path {str(path)[:120]!r} is not relative to the data file's dir; "
                         "write image paths relative to the data file, and keep the images beside it")
    full = (root / path).resolve()
    if not full.is_relative_to(root.resolve()):
        raise UsageError(f"{where}: the image path {str(path)[:120]!r} leads outside the data's dir {root}; "
                         "copy the image into that dir and name it from there")
    return full


def open_image(ref: Any, root: Path | None, where: str, decode: bool = True):
    """A PIL image of one reference (RGB when `decode`; otherwise its header
    alone is read, which says whether it is an image at all)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(ref, Image.Image):
        return ref.convert("RGB") if decode else ref
    source, named = None, ref
    if isinstance(ref, dict):
        if ref.get("bytes"):
            source, named = io.BytesIO(ref["bytes"]), "its image bytes"
        else:
            ref = named = ref.get("path")
    if source is None:
        if not isinstance(ref, str) or not ref:
            raise UsageError(f"{where}: an image is {str(named)[:80]!r}, not a path, image bytes or an image; "
                             "give each image as a path relative to the data file")
        source = _inside(Path(ref), root, where)
        if not source.is_file():
            raise UsageError(f"{where}: the image {ref!r} does not exist ({source}); fix the path, relative to "
                             "the data file's dir")
    try:
        image = Image.open(source)
        return image.convert("RGB") if decode else image
    except (UnidentifiedImageError, OSError) as e:  # PIL's message names the file again
        raise UsageError(f"{where}: {named!r} is not an image PIL can read ({type(e).__name__}); replace it or drop "
                         "the row") from None


# --- rows -> conversations with image parts ------------------------------------------------------

def _parts(content: Any, where: str) -> list[dict]:
    """A message's content as parts: [{"type": "text", "text": ...}, {"type": "image"}]."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise UsageError(f"{where}: a message's content must be a string or a list of parts such as "
                         f"{{\"type\": \"image\"}} and {{\"type\": \"text\", \"text\": ...}}, got {str(content)[:80]}")
    parts = []
    for part in content:
        kind = part.get("type")
        if kind == "image" or (kind is None and part.get("image") is not None):
            parts.append({"type": "image"})
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise UsageError(f"{where}: a content part is {str(part)[:80]}; parts are {{\"type\": \"image\"}} or "
                             "{\"type\": \"text\", \"text\": ...}")
    return parts


def _messages(value: Any, where: str, roles_start: str = "user") -> list[dict]:
    if isinstance(value, str):
        return [{"role": roles_start, "content": [{"type": "text", "text": value}]}]
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) for m in value):
        raise UsageError(f"{where}: expected a string or a list of {{\"role\": ..., \"content\": ...}} messages, got "
                         f"{str(value)[:80]}; fix that row of the data")
    messages = []
    for m in value:
        if m.get("role") not in ROLES:
            raise UsageError(f"{where}: unknown role {m.get('role')!r} in messages; use {', '.join(ROLES)}")
        messages.append({"role": m["role"], "content": _parts(m.get("content"), where)})
    return messages


@dataclass
class Conversation:
    messages: list[dict]   # each with "content" as parts (what templates render) and "text" (its text parts)
    images: list           # references, in the order of the image parts
    where: str


def conversation(row: dict, where: str) -> Conversation:
    """The row as one conversation whose image parts match its images, with an answer to learn."""
    if "messages" in row:
        messages = _messages(row["messages"], where)
    else:
        messages = _messages(row.get("prompt"), where) + _messages(row.get("completion"), where, "assistant")
    talk = _with_images(messages, image_refs(row), where)
    if not any(m["role"] == "assistant" and m["text"].strip() for m in messages):
        raise UsageError(f"{where}: the conversation has no assistant answer, so there is nothing to learn; add "
                         "the answer or drop the row")
    return talk


def _with_images(messages: list[dict], images: list, where: str) -> Conversation:
    """The messages with image parts matching the row's images. Messages
    whose text names no image part get the images at the start of the first
    user turn, as TRL places them."""
    parts = sum(p["type"] == "image" for m in messages for p in m["content"])
    if parts == 0 and images:
        first_user = next((m for m in messages if m["role"] == "user"), None)
        if first_user is None:
            raise UsageError(f"{where}: the row has images but no user turn to show them in; add one")
        first_user["content"] = [{"type": "image"} for _ in images] + first_user["content"]
    elif parts != len(images):
        raise UsageError(f"{where}: its messages hold {parts} image part(s) but the row gives {len(images)} "
                         "image(s); give one image per {\"type\": \"image\"} part, in order")
    for m in messages:
        m["text"] = "".join(p["text"] for p in m["content"] if p["type"] == "text")
        if m["role"] == "assistant" and any(p["type"] == "image" for p in m["content"]):
            raise UsageError(f"{where}: an assistant turn holds an image, which a model does not write; move the "
                             "image into a user turn")
    return Conversation(messages, images, where)


def prompt_conversation(row: dict, where: str) -> list[Conversation]:
    """A prompt-only row (GRPO's: a string or messages, with images) as the
    conversation the model answers next."""
    talk = _with_images(_messages(row.get("prompt"), where), image_refs(row), where)
    if talk.messages[-1]["role"] == "assistant":
        raise UsageError(f"{where}: the prompt ends with an assistant turn, and the model writes the next one; end "
                         "it with a user turn, or drop the row")
    return [talk]


def pair_conversations(row: dict, where: str) -> list[Conversation]:
    """A preference pair as two conversations (TRL's prompt, chosen and
    rejected, with images): the prompt answered by each."""
    return [conversation({"prompt": row.get("prompt"), "completion": row.get(side),
                          **{c: row[c] for c in IMAGE_COLUMNS if c in row}}, f"{where} ({side})")
            for side in ("chosen", "rejected")]


def one_conversation(row: dict, where: str) -> list[Conversation]:
    """An SFT row is one conversation."""
    return [conversation(row, where)]


def check_rows(split, root: Path | None, name: str, talks=one_conversation) -> int:
    """Every row's conversations (`talks` of it) and images, without decoding an image; the number of images."""
    count = 0
    for index, row in enumerate(split):
        where = f"{name} example {row.get(EXAMPLE_NUMBER, index + 1)}"
        shown = talks(row, where)[0].images  # a row's conversations show the same images
        for ref in shown:
            open_image(ref, root, where, decode=False)
        count += len(shown)
    return count


class CheckedRows:
    """A stream's rows, each checked as it is read (its conversations and its
    images' headers, as `check_rows`) and handed on as stored: the collator
    decodes the images when it makes a batch."""

    def __init__(self, root: Path | None, name: str, talks=one_conversation):
        self.root, self.name, self.talks = root, name, talks

    def __call__(self, raw: list[tuple[int, int, dict]]) -> list[dict]:
        """(source, example number, row) -> the row, numbered."""
        rows = [{**row, EXAMPLE_NUMBER: number} for _, number, row in raw]
        check_rows(rows, self.root, self.name, self.talks)
        return rows


def processed(processor, texts: list[str], images: list[list], where: str, **options) -> dict:
    """The processor's batch of rendered texts and their images, padded; its
    own refusal (image sizes, token counts) as one line naming the rows."""
    try:
        return dict(processor(text=texts, images=images if any(images) else None, padding=True,
                              add_special_tokens=False, return_tensors="pt", **options))
    except ValueError as e:
        raise UsageError(f"{where} (or another row of its batch): the processor refused it "
                         f"({str(e).splitlines()[0][:160]}); fix the row or its images") from None


# --- conversations -> batches --------------------------------------------------------------------

class VisionChatEncoder(ChatEncoder):
    """ChatEncoder's answer spans, with the processor's template rendering the image parts."""

    def __init__(self, processor, train_on_prompt: bool):
        super().__init__(processor.tokenizer, "chat", train_on_prompt)
        self.processor = processor

    def _template(self, messages: list[dict], generation_prompt: bool) -> str:
        rendered = [{"role": m["role"], "content": m["parts"]} for m in messages]
        return self.processor.apply_chat_template(rendered, tokenize=False, add_generation_prompt=generation_prompt)

    @staticmethod
    def text_view(messages: list[dict]) -> list[dict]:
        """What ChatEncoder locates answers by: each turn's text as its content (its parts are rendered)."""
        return [{"role": m["role"], "content": m["text"], "parts": m["content"]} for m in messages]


def image_token_mask(offsets: list, replacements: list[dict]) -> list[bool]:
    """Which tokens belong to an expanded image (the processor's replacement of its placeholder)."""
    spans = [r["new_span"] for r in replacements]
    return [stop > begin and any(begin < end and stop > start for start, end in spans) for begin, stop in offsets]


def answer_mask(offsets: list, spans: list[tuple[int, int]], replacements: list[dict]) -> list[bool]:
    """Which tokens fall in an answer's characters. The spans were found in the
    text before the processor expanded the image placeholders: each is shifted
    by what the expansions before it added (transformers' own assistant-mask rule)."""
    ends = [r["span"][1] for r in replacements]
    gained = [0] + [r["new_span"][1] - r["span"][1] for r in replacements]  # through each placeholder, in all
    shifted = [tuple(c + gained[bisect_right(ends, c)] for c in span) for span in spans]
    return [stop > begin and any(begin < end and stop > start for start, end in shifted) for begin, stop in offsets]


class VisionCollator:
    """Rows -> a padded batch the model takes (input ids, attention mask,
    labels, and the processor's image tensors), made in the data workers."""

    def __init__(self, encoder: VisionChatEncoder, block_size: int, root: Path | None):
        self.encoder, self.block_size, self.root = encoder, block_size, root
        self.markers = torch.tensor(image_token_ids(encoder.processor), dtype=torch.long)

    talks = staticmethod(one_conversation)  # the conversations one row puts in a batch

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        talks = [self.talks(row, f"example {row.get(EXAMPLE_NUMBER, i + 1)}") for i, row in enumerate(rows)]
        return self.encode([talk for sides in zip(*talks) for talk in sides])  # each row's first, then second, ...

    def encode(self, talks: list[Conversation]) -> dict[str, torch.Tensor]:
        encoder, processor = self.encoder, self.encoder.processor
        rendered = [encoder.render(encoder.text_view(t.messages), t.where) for t in talks]
        images = [[open_image(ref, self.root, t.where) for ref in t.images] for t in talks]
        out = processed(processor, [text for text, _ in rendered], images, talks[0].where, padding_side="right",
                        return_offsets_mapping=True, return_text_replacement_offsets=True)
        offsets = out.pop("offset_mapping").tolist()
        replacements = out.pop("text_replacement_offsets", None) or [[] for _ in talks]
        ids, real = out["input_ids"], out["attention_mask"].bool()
        labels = torch.full_like(ids, IGNORE)
        for i, (talk, (_, spans)) in enumerate(zip(talks, rendered)):
            image = torch.tensor(image_token_mask(offsets[i], replacements[i])) | torch.isin(ids[i], self.markers)
            learn = real[i] & ~image
            if not encoder.train_on_prompt:
                learn &= torch.tensor(answer_mask(offsets[i], spans, replacements[i]))
            labels[i][learn] = ids[i][learn]
            self._check_length(talk, int(real[i].sum()), image)
        out["labels"] = labels
        if ids.size(1) > self.block_size:  # the answers' tail is cut; the images were checked to fit
            for key in TOKEN_KEYS:
                if key in out:
                    out[key] = out[key][:, : self.block_size]
        return out

    def _check_length(self, talk: Conversation, length: int, image: torch.Tensor) -> None:
        """A row longer than --block_size loses its tail; one whose images do not fit is refused."""
        if length > self.block_size and image[self.block_size:].any():
            raise UsageError(f"{talk.where}: its images end past --block_size {self.block_size} (the row is {length} "
                             "tokens with them); raise --block_size, or shrink the images (--max_pixels)")


class VisionPromptCollator:
    """Prompts (with their images) -> a left-padded batch that generation
    appends to: prompt ids and mask, the rows' numbers, and the processor's
    image tensors; each prompt `copies` times in a row (a rollout's group)."""

    talks = staticmethod(prompt_conversation)

    def __init__(self, processor, room: int, root: Path | None, copies: int = 1):
        self.processor, self.room, self.root, self.copies = processor, room, root, copies

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        talks = [self.talks(row, f"example {row.get(EXAMPLE_NUMBER, i + 1)}")[0] for i, row in enumerate(rows)]
        texts = [self.processor.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in t.messages],
                                                    tokenize=False, add_generation_prompt=True) for t in talks]
        images = [[open_image(ref, self.root, t.where) for ref in t.images] for t in talks]
        # Each prompt rendered and decoded once, then processed `copies` times: the processor lays out
        # every family's image tensors (per image, per row, per patch) for the repeated rows.
        rows, talks, texts, images = ([item for item in items for _ in range(self.copies)]
                                      for items in (rows, talks, texts, images))
        out = processed(self.processor, texts, images, talks[0].where, padding_side="left")
        ids, mask = out.pop("input_ids"), out.pop("attention_mask")
        for talk, length in zip(talks, mask.sum(1).tolist()):
            if length > self.room:
                raise UsageError(f"{talk.where}: its prompt is {length} tokens with its images, more than the "
                                 f"{self.room} that --block_size leaves beside --max_completion_length; raise "
                                 "--block_size, or shrink the images (--max_pixels)")
        return {"prompt_ids": ids, "prompt_mask": mask, "row": torch.tensor([row["row"] for row in rows]), **out}


class VisionPairCollator(VisionCollator):
    """A batch of B preference pairs as 2B conversations, the chosen sides
    first (as pairs.py stacks them), each showing its pair's images."""
    talks = staticmethod(pair_conversations)
