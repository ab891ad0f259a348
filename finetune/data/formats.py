"""The data formats (`--data_format`) a causal LM's rows come in: the columns
that name each (auto detection tries them in this order; an objective's Task
asks for its own), and how messages speak of them. Light on purpose: the config reads it before any library loads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataFormat:
    name: str
    columns: tuple[str, ...]   # the columns that name it
    words: str                 # its rows, as messages speak of them
    example: str               # one row, for messages
    builtin: str               # the data/builtin.py function that writes the embedded default's rows in it
    sft: bool = False          # SFT learns from it: it holds the text to predict (and to score perplexity on)


FORMATS = {entry.name: entry for entry in (
    DataFormat("preference", ("chosen", "rejected"), "preference pairs (chosen/rejected)",
               '{"prompt": ..., "chosen": ..., "rejected": ...}', "build_stdlib_preferences"),
    DataFormat("chat", ("messages",), "conversations (a messages column)", '{"messages": [...]}',
               "build_stdlib_questions", sft=True),
    DataFormat("instruction", ("instruction", "output"), "instructions (instruction/input/output)",
               '{"instruction": ..., "input": ..., "output": ...}', "build_stdlib_questions", sft=True),
    DataFormat("prompt_completion", ("prompt", "completion"), "prompts with completions (prompt/completion)",
               '{"prompt": ..., "completion": ...}', "build_stdlib_questions", sft=True),
    DataFormat("unpaired", ("prompt", "completion", "label"),
               "unpaired completions labelled desirable or not (prompt/completion/label)",
               '{"prompt": ..., "completion": ..., "label": true}', "build_stdlib_unpaired"),
    DataFormat("prompt", ("prompt",), "prompts alone (a prompt column)", '{"prompt": ...} (a string, or messages)',
               "build_stdlib_module_questions"),
)}
SFT_FORMATS = tuple(name for name, entry in FORMATS.items() if entry.sft)
DATA_FORMATS = ("auto", "text", *FORMATS)
