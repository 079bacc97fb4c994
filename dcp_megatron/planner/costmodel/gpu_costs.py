"""What the GPU path adds to the cost model (docs/gpu.md): FP8 GEMMs, TE's p2p ring, NCCL communicators.

- FP8 (`fp8=True`): the linear layers' GEMMs run at the cluster's `fp8_gemm_flops` (attention stays bf16);
  Transformer Engine keeps an FP8 copy of every linear weight and its transpose (1 byte each per
  parameter, rowwise and columnwise usage) next to the bf16 weights: 2 bytes per linear parameter.
- CP attention on GPU (`cp_ring=True`) is Transformer Engine's p2p ring (megatron-core passes no comm type
  for a static CP size of 1, TE's default is "p2p"; THD + all_gather is refused by TE 2.17). The ring has
  c - 1 steps per pass; each step's K/V transfer overlaps the attention of the block already held, so only
  (c - 1)/c of the attention hides communication (the last block has nothing left to receive), and each
  step is its own send/receive launch. Bandwidth: the group's slowest link (the ring steps are in lock-step).
- NCCL communicators: every block a plan uses becomes a communicator with its own buffers, outside
  torch's allocator. `communicator_bytes` per communicator (cluster constant) times the most this rank
  can hold is static memory, reserved up front so a long run cannot grow into an OOM. The most: one
  aligned power-of-two block per size (created at start, runtime/group_pool.py), the whole domain, and
  the group pool's cap of other blocks (MAX_ODD_COMMUNICATORS, least recently used ones destroyed).
Pure Python: the planner imports nothing heavier than numpy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcp_megatron.planner.costmodel.cluster import ClusterSpec
from dcp_megatron.planner.costmodel.model import ModelShape

FP8_WEIGHT_COPY_BYTES = 2.0   # per linear parameter: TE's FP8 weight (1 B) and its transpose (1 B)
# Non-aligned blocks (odd sizes, odd offsets) the group pool keeps at once (least recently used ones beyond it
# are destroyed); a plan uses at most a few (dcp/odd_groups.py: MAX_ODD documents on odd groups).
MAX_ODD_COMMUNICATORS = 8


@dataclass(frozen=True, kw_only=True)
class GpuCosts:
    """How the run uses the GPU (all off: the CPU path and the pre-issue-19 model)."""

    fp8: bool = False        # linear GEMMs in FP8 (--fp8-format)
    cp_ring: bool = False    # CP attention is TE's p2p ring (TE attention on GPU)
    communicators: bool = False   # count NCCL communicator buffers (a GPU run)

    def gemm_rate(self, cluster: ClusterSpec) -> float:
        """FLOP/s of the linear layers' GEMMs: the FP8 rate when the run uses FP8 and the cluster has one."""
        return cluster.fp8_gemm_flops if self.fp8 and cluster.fp8_gemm_flops > 0 else cluster.gemm_flops

    def static_bytes(self, model: ModelShape, cluster: ClusterSpec) -> int:
        """Bytes per rank beyond weights, gradients and optimizer states: FP8 weight copies, NCCL buffers."""
        extra = 0.0
        if self.fp8:
            extra += FP8_WEIGHT_COPY_BYTES * model.params_per_rank(model.linear_params)   # experts / ep
        if self.communicators:
            extra += cluster.communicator_bytes * communicators_per_rank(*_pool_of(cluster))
        return int(extra)

    def overlapped_share(self, cp_sizes):
        """The share of a micro-batch's attention that hides CP communication (scalar or array of CP sizes)."""
        if not self.cp_ring:
            return 1.0
        sizes = np.asarray(cp_sizes, dtype=np.float64)
        return (sizes - 1.0) / np.maximum(sizes, 1.0)

    def collectives_per_pass(self, cp_sizes):
        """Communication launches per layer and pass: one all-gather, or the ring's c - 1 steps."""
        if not self.cp_ring:
            return 1.0
        return np.maximum(np.asarray(cp_sizes, dtype=np.float64) - 1.0, 1.0)


def _pool_of(cluster: ClusterSpec) -> tuple[int, int]:
    """(domain size, CP size limit) of the group pool a rank holds: the whole domain's, also when planning a part."""
    whole = cluster.sharding_domain_size
    return whole, min(cluster.max_cp_size or whole, whole)


def communicators_per_rank(domain_size: int, max_cp_size: int, *, max_odd_blocks: int = MAX_ODD_COMMUNICATORS) -> int:
    """The most CP communicators one rank of the domain holds at once: one aligned power-of-two block per size
    up to max_cp_size, the whole domain (gradient reduction) when it is not one of them, and the pool's cap of
    other blocks (none on a domain of 2, whose only block is the whole domain)."""
    if domain_size < 1 or max_cp_size < 1:
        raise ValueError(f"domain_size and max_cp_size must be >= 1, got {domain_size}, {max_cp_size}")
    largest = min(max_cp_size, domain_size)
    aligned = [c for c in (2 ** k for k in range(1, domain_size.bit_length())) if c <= largest]
    whole = 1 if domain_size > 1 and domain_size not in aligned else 0
    odd_possible = domain_size > 2 and largest >= 2   # a domain of 2 has one block only
    return len(aligned) + whole + (max_odd_blocks if odd_possible else 0)
