"""The `launch:` record of a run_config.yaml, checked before `finetune resume`
replays it. A run dir may come from someone else, and the record becomes an
`accelerate launch` command line: only accelerate's own settings, with typed
and range-checked values, are replayed; never a program, a script, a module or
a path that the launcher would run, read or write.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from finetune.errors import UsageError

# A value that names a setting, never a path or a command.
WORD = re.compile(r"^[A-Za-z0-9_.,:-]{1,200}$")
HOST = re.compile(r"^[A-Za-z0-9_.:-]{1,253}$")


def _int_in(low: int, high: int) -> Callable[[Any], bool]:
    return lambda v: (isinstance(v, int) and not isinstance(v, bool) and low <= v <= high) or (
        isinstance(v, str) and v.isdigit() and low <= int(v) <= high)


def _one_of(*choices: str) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, str) and v in choices


def _word(v: Any) -> bool:
    return isinstance(v, (bool, int, float)) or (isinstance(v, str) and bool(WORD.match(v)))


def _host(v: Any) -> bool:
    return isinstance(v, str) and bool(HOST.match(v))


def _number(v: Any) -> bool:
    try:
        return not isinstance(v, bool) and float(v) >= 0
    except (TypeError, ValueError):
        return False


BOOL_TEXT = ("true", "false", "True", "False")
MIXED_PRECISION = _one_of("no", "fp16", "bf16", "fp8")
PROCESSES = _int_in(1, 65536)

# `accelerate launch` options a resume replays, with the check of their value
# (None: a flag without one). Anything else in a record is refused.
REPLAYED_OPTIONS: dict[str, Callable[[Any], bool] | None] = {
    "--num_processes": PROCESSES, "--num_machines": PROCESSES, "--machine_rank": _int_in(0, 65535),
    "--mixed_precision": MIXED_PRECISION, "--num_cpu_threads_per_process": _int_in(1, 4096),
    "--gpu_ids": lambda v: isinstance(v, str) and bool(re.match(r"^(all|\d+(,\d+)*)$", v)),
    "--main_process_ip": _host, "--rdzv_backend": _one_of("static", "c10d", "etcd", "etcd-v2"),
    "--dynamo_backend": _one_of("no", "eager", "aot_eager", "inductor"),
    "--monitor_interval": _number, "--max_restarts": _int_in(0, 100),
    "--zero_stage": _int_in(0, 3), "--offload_optimizer_device": _one_of("none", "cpu", "nvme"),
    "--offload_param_device": _one_of("none", "cpu", "nvme"), "--gradient_accumulation_steps": _int_in(1, 1 << 20),
    "--gradient_clipping": _number, "--zero3_init_flag": _one_of(*BOOL_TEXT),
    "--zero3_save_16bit_model": _one_of(*BOOL_TEXT),
    "--cpu": None, "--multi_gpu": None, "--use_fsdp": None, "--use_deepspeed": None, "--debug": None,
    "--quiet": None, "-q": None, "--same_network": None, "--enable_cpu_affinity": None,
}
# accelerate's FSDP and parallelism options all take a setting's name or number.
REPLAYED_PREFIXES = ("--fsdp_", "--parallelism_config_")

# accelerate config keys a resume writes back into the config it launches with.
CONFIG_KEYS: dict[str, Callable[[Any], bool]] = {
    "compute_environment": _one_of("LOCAL_MACHINE"), "distributed_type": _word, "num_processes": PROCESSES,
    "num_machines": PROCESSES, "machine_rank": _int_in(0, 65535), "main_training_function": _word,
    "use_cpu": lambda v: isinstance(v, bool), "same_network": lambda v: isinstance(v, bool),
    "rdzv_backend": _one_of("static", "c10d", "etcd", "etcd-v2"), "mixed_precision": MIXED_PRECISION,
    "main_process_ip": _host, "main_process_port": _int_in(1, 65535), "gpu_ids": _word,
    "downcast_bf16": _word, "debug": lambda v: isinstance(v, bool), "enable_cpu_affinity": lambda v: isinstance(v, bool),
    # What `accelerate config` writes on every machine; a TPU setting other than off is refused.
    "tpu_use_cluster": lambda v: v is False, "tpu_use_sudo": lambda v: v is False, "tpu_env": lambda v: v == [],
}
# Sections of settings by name; a DeepSpeed JSON named by path is replaced by its recorded content.
CONFIG_SECTIONS = {
    "fsdp_config": re.compile(r"^fsdp_[a-z0-9_]+$"),
    "dynamo_config": re.compile(r"^dynamo_[a-z0-9_]+$"),
    "parallelism_config": re.compile(r"^parallelism_config_[a-z0-9_]+$"),
    "deepspeed_config": re.compile(r"^(zero_stage|offload_optimizer_device|offload_param_device|zero3_init_flag|"
                                   r"zero3_save_16bit_model|gradient_accumulation_steps|gradient_clipping|"
                                   r"deepspeed_config_file|deepspeed_moe_layer_cls_names)$"),
}
# DeepSpeed settings that make its engine write files of its own, where the record says.
DEEPSPEED_WRITERS = {"tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler", "nvme_path", "output_path",
                     "output_file", "checkpoint_dir", "autotuning"}
RECORD_KEYS = {"distributed_type", "num_processes", "num_machines", "launcher_options", "accelerate_config",
               "deepspeed_config"}


def _refuse(run_dir: Path, what: str) -> UsageError:
    return UsageError(f"{run_dir}/run_config.yaml: its launch record {what}; finetune resume replays only "
                      "accelerate launch's own settings. Launch the run yourself under the config it was trained "
                      f"with, e.g. accelerate launch --config_file $(finetune configs --path fsdp) -m finetune resume "
                      f"{run_dir}")


def checked_launcher_options(options: Any, run_dir: Path) -> list[str]:
    """The recorded launcher options, each one allowed and its value checked."""
    if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
        raise _refuse(run_dir, "has launcher_options that are not a list of options")
    checked, i = [], 0
    while i < len(options):
        name, has_value, value = options[i].partition("=")
        known = name in REPLAYED_OPTIONS or (name.startswith(REPLAYED_PREFIXES) and re.match(r"^--[a-z0-9_]+$", name))
        if not known:
            what = "a program or script to run" if not name.startswith("-") else f"the option {name[:60]}"
            raise _refuse(run_dir, f"holds {what}")
        check = REPLAYED_OPTIONS.get(name, _word)
        if check is None:
            if has_value:
                raise _refuse(run_dir, f"gives the flag {name} a value")
            checked.append(name)
            i += 1
            continue
        if not has_value:
            if i + 1 >= len(options):
                raise _refuse(run_dir, f"gives {name} no value")
            value, i = options[i + 1], i + 1
        if not check(value):
            raise _refuse(run_dir, f"gives {name} the value {value[:60]!r}, which it does not take")
        checked += [name, value]
        i += 1
    return checked


def checked_accelerate_config(config: Any, run_dir: Path) -> dict | None:
    if config is None:
        return None
    if not isinstance(config, dict):
        raise _refuse(run_dir, "has an accelerate_config that is not a mapping")
    for key, value in config.items():
        if key in CONFIG_SECTIONS:
            if not isinstance(value, dict):
                raise _refuse(run_dir, f"has an accelerate_config {key} that is not a mapping")
            for name, setting in value.items():
                if not (isinstance(name, str) and CONFIG_SECTIONS[key].match(name)):
                    raise _refuse(run_dir, f"has the accelerate_config setting {key}.{str(name)[:60]}")
                if name != "deepspeed_config_file" and not (_word(setting) or setting is None):
                    raise _refuse(run_dir, f"gives {key}.{name} a value it does not take")
        elif key not in CONFIG_KEYS:
            raise _refuse(run_dir, f"has the accelerate_config setting {str(key)[:60]}")
        elif not CONFIG_KEYS[key](value):
            raise _refuse(run_dir, f"gives accelerate_config {key} the value {str(value)[:60]!r}, which it does not take")
    return config


def _deepspeed_writers(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [k for k, v in value.items() if k in DEEPSPEED_WRITERS] + [
            k for v in value.values() for k in _deepspeed_writers(v)]
    if isinstance(value, list):
        return [k for v in value for k in _deepspeed_writers(v)]
    return []


def checked_record(launch: Any, run_dir: Path) -> dict:
    """The record, or one line naming what `finetune resume` will not replay."""
    if launch is None:
        return {}
    if not isinstance(launch, dict):
        raise _refuse(run_dir, "is not a mapping")
    unknown = sorted(str(k) for k in launch if k not in RECORD_KEYS)
    if unknown:
        raise _refuse(run_dir, f"has the unknown key(s) {', '.join(u[:60] for u in unknown[:3])}")
    for key in ("num_processes", "num_machines"):
        if key in launch and not PROCESSES(launch[key]):
            raise _refuse(run_dir, f"gives {key} the value {str(launch[key])[:60]!r}, not a process count")
    if "distributed_type" in launch and not _word(launch["distributed_type"]):
        raise _refuse(run_dir, "has a distributed_type that is not a name")
    checked = dict(launch)
    if "launcher_options" in launch:
        checked["launcher_options"] = checked_launcher_options(launch["launcher_options"], run_dir)
    checked["accelerate_config"] = checked_accelerate_config(launch.get("accelerate_config"), run_dir)
    deepspeed = launch.get("deepspeed_config")
    if deepspeed is not None:
        if not isinstance(deepspeed, dict):
            raise _refuse(run_dir, "has a deepspeed_config that is not a mapping")
        if writers := _deepspeed_writers(deepspeed):
            raise _refuse(run_dir, f"has a DeepSpeed config that writes files of its own ({', '.join(writers[:3])})")
    named = ((checked["accelerate_config"] or {}).get("deepspeed_config") or {}).get("deepspeed_config_file")
    if named not in (None, "none") and deepspeed is None:
        # Only a JSON the record holds (checked above) is replayed; a file it names is read as it is now.
        raise _refuse(run_dir, f"names a DeepSpeed config file ({str(named)[:80]}) without holding its content")
    return checked
