"""The device mesh a launch asks for, read from the environment `accelerate
launch` sets from the config's `parallelism_config_*` keys. Light on purpose:
every rank checks the mesh against the world size before the libraries load
(finetune/preflight.py); backends/mesh.py checks the rest against the backend."""

from __future__ import annotations

import os

from finetune.errors import UsageError

ENV_PREFIX = "PARALLELISM_CONFIG_"  # what `accelerate launch` sets from the config's parallelism_config keys


def requested_mesh() -> dict[str, int] | None:
    """The sizes the launch asks for (accelerate's names without the prefix:
    dp_replicate_size, dp_shard_size, tp_size, cp_size, sp_size); None when it
    sets no parallelism_config."""
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return None
    sizes = {}
    for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"):
        value = os.environ.get(ENV_PREFIX + name.upper(), "1")
        if not value.isdigit() or int(value) < 1:
            raise UsageError(f"parallelism_config_{name}: {value!r} is not a positive number of ranks; "
                             "set it in the accelerate config or with --parallelism_config_" + name)
        sizes[name] = int(value)
    return sizes


def check_mesh_size(world_size: int) -> None:
    """A mesh whose sizes do not multiply to the number of ranks launched."""
    sizes = requested_mesh()
    if sizes is None:
        return
    product = sizes["dp_replicate_size"] * sizes["dp_shard_size"] * sizes["tp_size"]
    if product != world_size:
        raise UsageError(f"the parallelism_config mesh is dp_replicate {sizes['dp_replicate_size']} x dp_shard "
                         f"{sizes['dp_shard_size']} x tp {sizes['tp_size']} = {product} ranks, but {world_size} "
                         f"were launched; make the sizes multiply to --num_processes (or launch {product})")
