#!/bin/bash
# One machine, N ranks started by torchrun: the code path of the SLURM recipes (`train --launcher env`) without SLURM.
#
#   launch/local.sh [-c CONFIG] [section.key=value ...]
#   NPROC=8 launch/local.sh -c configs/my-8gpu.yaml
#
# NPROC defaults to the number of ranks the config's executors need (trainer + generator, or the larger of the two
# when colocated). `megatron-rl train` without this script starts the same ranks itself (--launcher local).
set -euo pipefail

PYTHON=${PYTHON:-python}
MASTER_PORT=${MASTER_PORT:-0}                             # 0: torchrun --standalone picks a free port
TORCHRUN_EXTRA_ARGS=${TORCHRUN_EXTRA_ARGS:-}
NPROC=${NPROC:-$("$PYTHON" -m megatron_rl.cli world-size "$@")}

export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
CPUS=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CPUS / NPROC > 0 ? CPUS / NPROC : 1 ))}

read -r -a torchrun_extra <<< "$TORCHRUN_EXTRA_ARGS"
if [[ "$MASTER_PORT" == 0 ]]; then
    rdzv=(--standalone)
else
    rdzv=(--rdzv-backend c10d --rdzv-endpoint "localhost:$MASTER_PORT" --rdzv-id megatron-rl-local)
fi
exec "$PYTHON" -m torch.distributed.run "${rdzv[@]}" --nnodes 1 --nproc-per-node "$NPROC" \
    ${torchrun_extra[@]+"${torchrun_extra[@]}"} -m megatron_rl.cli train --launcher env "$@"
