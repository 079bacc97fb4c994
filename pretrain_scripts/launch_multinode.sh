#!/usr/bin/env bash
# Multi-node --dcp training with torchrun's rendezvous: run this once on every node.
#
#   NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=node0 GPUS_PER_NODE=8 \
#       pretrain_scripts/launch_multinode.sh path/to/pretrain_gpt.py <Megatron flags> --dcp [--dcp-*]
#
# The script runs unchanged through `-m dcp_megatron.launch` (drop it for a script that calls
# dcp_megatron.enable() itself). --dcp-gpus-per-node tells the planner which CP groups stay inside a node
# (NVLink) and which cross nodes (InfiniBand); it defaults to torchrun's LOCAL_WORLD_SIZE.
set -euo pipefail
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_PORT=${MASTER_PORT:-29500}
PYTHON=${PYTHON:-python}
SCRIPT=$1; shift
exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --nproc-per-node "$GPUS_PER_NODE" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    -m dcp_megatron.launch "$SCRIPT" "$@" --dcp-gpus-per-node "$GPUS_PER_NODE"
