"""Option sections: small dataclasses whose fields are the options of a run
(`--name` on the command line, `name:` in YAML), each field with its help,
its choices and what a resume may do with it.

The run config (config.py) is the union of the sections: its own (model,
data, training, ...), those of the PEFT methods (peft/__init__.py) and those
of the objectives (objectives/). From them come the groups of `train --help`
(a section's docstring is its title), which options a run refuses because its
objective or PEFT method does not read them, and which a resume may change.
Light on purpose: the command line reads it before any heavy library loads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Iterable


def option(default: Any, help: str, *, choices: Iterable[str] | None = None, nargs: str | None = None,
           on_resume: str = "") -> Any:
    """A section's field. `on_resume`: what changing it on a resume does (empty:
    a resume may not change it, the checkpoint was made with it)."""
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None, "nargs": nargs,
                "on_resume": on_resume}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def title(section: type) -> str:
    """A section's heading in `--help`: the first paragraph of its docstring."""
    return " ".join((section.__doc__ or section.__name__).strip().split("\n\n")[0].split())


def names(section: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(section))


def defaults(section: type) -> dict[str, Any]:
    return {f.name: getattr(section(), f.name) for f in dataclasses.fields(section)}


def readers(sections_of: dict[str, tuple[type, ...]]) -> dict[str, tuple[str, ...]]:
    """Each option of the given sections -> who reads it (objectives, PEFT
    methods: `sections_of` maps each to the sections it reads)."""
    found: dict[str, tuple[str, ...]] = {}
    for reader, sections in sections_of.items():
        for section in sections:
            for name in names(section):
                found[name] = (*found.get(name, ()), reader)
    return found
