#!/bin/bash
# One node's part of a Slurm job (run by finetune.sbatch through srun, one task
# per node): `accelerate launch` for this node, with the values Slurm gives it.
#   SLURM_NNODES, SLURM_NODEID   number of nodes, this node's rank (from srun)
#   MAIN_ADDR, MAIN_PORT         node 0's address and a free port on it (from finetune.sbatch)
#   PROCS_PER_NODE               processes on each node (default: its GPUs, else 1)
#   CONFIG                       the accelerate config (default: the shipped hsdp config, a
#                                replica per node sharded over its processes; fsdp with one
#                                process per node, where a node has nothing to shard over)
#   OUTPUT_DIR                   the run dir, on storage every node shares
# Extra arguments go to `finetune train`.
set -euo pipefail
gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU" || true)
procs_per_node="${PROCS_PER_NODE:-$(( gpus > 0 ? gpus : 1 ))}"
mesh=()
if [[ -z "${CONFIG:-}" && "$procs_per_node" -gt 1 ]]; then
    config="$(python -m finetune configs --path hsdp)"
    mesh=(--parallelism_config_dp_replicate_size "$SLURM_NNODES" --parallelism_config_dp_shard_size "$procs_per_node")
else
    config="${CONFIG:-$(python -m finetune configs --path fsdp)}"
fi
exec python -m accelerate.commands.launch --config_file "$config" "${mesh[@]}" \
    --num_machines "$SLURM_NNODES" --machine_rank "$SLURM_NODEID" \
    --num_processes $(( SLURM_NNODES * procs_per_node )) \
    --main_process_ip "$MAIN_ADDR" --main_process_port "$MAIN_PORT" \
    --rdzv_backend static --same_network \
    -m finetune train --resume_from_checkpoint auto --output_dir "$OUTPUT_DIR" "$@"
