"""The accelerate configs shipped inside the package, so that an installed
`finetune` has them too: `accelerate launch --config_file $(finetune configs
--path fsdp)` works from any directory. The repo's top-level
`accelerate_configs/` holds the same files (a test keeps them equal)."""

from __future__ import annotations

from pathlib import Path

from finetune.errors import UsageError

CONFIG_DIR = Path(__file__).resolve().parent / "accelerate_configs"


def shipped() -> dict[str, Path]:
    """Name (file name without .yaml) -> path."""
    return {path.stem: path for path in sorted(CONFIG_DIR.glob("*.yaml"))}


def summary(path: Path) -> str:
    """The first sentence of the config's opening comment."""
    opening = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        opening.append(line.lstrip("#").strip())
    return " ".join(opening).split(". ")[0].rstrip(".")


def config_path(name: str) -> Path:
    configs = shipped()
    path = configs.get(name.removesuffix(".yaml"))
    if path is None:
        raise UsageError(f"no shipped accelerate config named {name!r}; pass one of {', '.join(configs)}")
    return path


def listing() -> str:
    configs = shipped()
    width = max(map(len, configs))
    return "\n".join(f"{name:<{width}}  {summary(path)}\n{'':<{width}}  {path}" for name, path in configs.items())
