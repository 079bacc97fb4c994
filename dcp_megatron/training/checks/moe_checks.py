"""MoE token dispatchers (megatron-core 0.19.2's `--moe-token-dispatcher-type`) and what each needs, every run.

- alltoall: exchanges the ranks' token counts before the tokens, so EP peers' micro-batches may differ in rows.
  Under --dcp at EP > 1 the plan pairs the peers' micro-batches (lockstep, layout_checks.py).
- allgather: all-gathers hidden states, probabilities and routing map over the TP x EP group, which needs equal
  rows on every peer (at EP 1, TP peers route shares of the same micro-batch). Under --dcp at EP > 1 the EP
  peers' micro-batches differ (unequal rows: gloo aborts, NCCL would hang or corrupt), so each lockstep wave's
  micro-batches are padded to the wave's most rows with masked filler documents (`needs_equal_rows`,
  microbatches.rank_batches).
- flex: DeepEP, HybridEP or NCCL EP kernels, CUDA only: refused without a GPU (model build would stop on a
  missing library or device). On a GPU under --dcp at EP > 1 it is padded as allgather is (harmless for an
  exchange that does not need it); not run in this repository's tests.
"""
from __future__ import annotations

import argparse

_EQUAL_ROWS_DISPATCHERS = ("allgather", "flex")


def _dispatcher(args: argparse.Namespace) -> str | None:
    return getattr(args, "moe_token_dispatcher_type", None) if getattr(args, "num_experts", None) else None


def check_moe_dispatcher(args: argparse.Namespace, *, has_gpu: bool | None = None) -> None:
    """Refuse (DcpUsageError) a dispatcher this machine cannot run, naming the flag."""
    from dcp_megatron.config import DcpUsageError

    if _dispatcher(args) != "flex":
        return
    if has_gpu is None:
        import torch

        has_gpu = torch.cuda.is_available()
    if not has_gpu:
        backend = getattr(args, "moe_flex_dispatcher_backend", None) or "deepep"
        raise DcpUsageError(f"--moe-token-dispatcher-type flex (--moe-flex-dispatcher-backend {backend}) needs a "
                            "GPU with DeepEP, HybridEP or NCCL EP; without one use --moe-token-dispatcher-type "
                            "alltoall or allgather")


def needs_equal_rows(args: argparse.Namespace) -> bool:
    """Whether every EP peer's micro-batch of a wave must have the same rows (module docstring)."""
    return _dispatcher(args) in _EQUAL_ROWS_DISPATCHERS and (getattr(args, "expert_model_parallel_size", 1) or 1) > 1
