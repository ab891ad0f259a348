#!/bin/bash
# One node's part of a Slurm job (run by finetune.sbatch through srun, one task
# per node): `accelerate launch` for this node, with the values Slurm gives it.
#   SLURM_NNODES, SLURM_NODEID   number of nodes, this node's rank (from srun)
#   MAIN_ADDR, MAIN_PORT         node 0's address and a free port on it (from finetune.sbatch)
#   PROCS_PER_NODE               processes on each node (default: its GPUs, else 1)
#   CONFIG                       the accelerate config (default: the shipped fsdp config)
#   OUTPUT_DIR                   the run dir, on storage every node shares
# Extra arguments go to `finetune train`.
set -euo pipefail
gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU" || true)
procs_per_node="${PROCS_PER_NODE:-$(( gpus > 0 ? gpus : 1 ))}"
config="${CONFIG:-$(python -m finetune configs --path fsdp)}"
exec python -m accelerate.commands.launch --config_file "$config" \
    --num_machines "$SLURM_NNODES" --machine_rank "$SLURM_NODEID" \
    --num_processes $(( SLURM_NNODES * procs_per_node )) \
    --main_process_ip "$MAIN_ADDR" --main_process_port "$MAIN_PORT" \
    --rdzv_backend static --same_network \
    -m finetune train --resume_from_checkpoint auto --output_dir "$OUTPUT_DIR" "$@"
