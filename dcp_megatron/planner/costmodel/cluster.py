"""The hardware a plan runs on: size of the DCP domain, memory, rates, bandwidths."""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace

from dcp_megatron.planner.costmodel.cluster_cpu import (CPU_ATTN_RATE_POINTS, CPU_COLLECTIVE_LATENCY_S, CPU_GEMM_FLOPS,
                                                        CPU_GLOO_BW, CPU_MEM_BYTES_PER_RANK, CPU_MICROBATCH_OVERHEAD_S,
                                                        CPU_RANKS_PER_MACHINE, CPU_RECOMPUTE_COST_FACTOR)
from dcp_megatron.planner.costmodel.cluster_gpu import GPU_DATASHEETS, H200_BF16_FLOPS, H200_GEMM_RATIO, LAYER_SHARE

GiB = 1024 ** 3


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """One DCP domain (the DP×CP ranks of one TP/PP coordinate) and its physics.

    Rates are *achieved* rates, not datasheet peaks. `attn_rate_points` is a table of
    (document length, achieved causal-attention FLOP/s), interpolated linearly in log(L)
    and clamped at both ends: attention kernels are slow on short documents.
    """

    name: str = "custom"
    domain_size: int
    gpus_per_node: int = 8
    mem_bytes_per_gpu: int
    mem_safety_frac: float = 0.10          # headroom kept free (fragmentation, NCCL buffers)
    distributed_optimizer: bool = True     # optimizer states sharded over DP (ZeRO-1)
    gemm_flops: float
    attn_rate_points: tuple[tuple[int, float], ...]
    intra_node_bw: float                   # bytes/s per GPU, one direction
    inter_node_bw: float                   # bytes/s per GPU, one direction
    microbatch_overhead_s: float = 0.0     # launch/sync cost paid by every micro-batch
    collective_latency_s: float = 0.0      # per CP collective (per layer) latency
    document_overhead_s: float = 0.0       # per document and rank: work launched per document (RoPE, attention)
    max_cp_size: int = 0                   # 0: up to domain_size
    # Measured / modelled cost of recomputing a forward pass: 1.0 means recompute costs exactly
    # the forward FLOPs (1/3 of fwd+bwd); CPU runs measure more (allocation, Python overhead).
    recompute_cost_factor: float = 1.0
    fp8_gemm_flops: float = 0.0            # achieved FP8 GEMM rate; 0: none known (FP8 runs are charged gemm_flops)
    communicator_bytes: int = 0            # device memory one NCCL communicator holds (gpu_costs.py)
    host_link_bw: float = 0.0              # bytes/s per GPU to host memory, one way; 0: no activation offload
    # 0: the domain is the whole DCP domain. Else this spec plans a part of a domain of this many ranks
    # (planner/dcp/split.py): state sharded over the domain and the communicators a rank holds count all of them.
    whole_domain_size: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.domain_size, int) or self.domain_size <= 0:
            raise ValueError(f"ClusterSpec.domain_size must be a positive int, got {self.domain_size!r}")
        if self.gpus_per_node <= 0:
            raise ValueError(f"ClusterSpec.gpus_per_node must be positive, got {self.gpus_per_node}")
        if self.mem_bytes_per_gpu <= 0:
            raise ValueError(f"ClusterSpec.mem_bytes_per_gpu must be positive, got {self.mem_bytes_per_gpu}")
        if not 0.0 <= self.mem_safety_frac < 1.0:
            raise ValueError(f"ClusterSpec.mem_safety_frac must be in [0, 1), got {self.mem_safety_frac}")
        for name in ("gemm_flops", "intra_node_bw", "inter_node_bw"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ClusterSpec.{name} must be positive, got {getattr(self, name)}")
        if not self.attn_rate_points or any(L <= 0 or r <= 0 for L, r in self.attn_rate_points):
            raise ValueError(f"ClusterSpec.attn_rate_points must be non-empty (length, rate>0) pairs, "
                             f"got {self.attn_rate_points!r}")
        if list(self.attn_rate_points) != sorted(self.attn_rate_points):
            raise ValueError("ClusterSpec.attn_rate_points must be sorted by length")
        if self.recompute_cost_factor <= 0:
            raise ValueError(f"ClusterSpec.recompute_cost_factor must be positive, got {self.recompute_cost_factor}")
        for name in ("microbatch_overhead_s", "collective_latency_s", "document_overhead_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"ClusterSpec.{name} must be >= 0 seconds, got {getattr(self, name)}")
        if self.fp8_gemm_flops < 0 or self.communicator_bytes < 0:
            raise ValueError(f"ClusterSpec.fp8_gemm_flops and communicator_bytes must be >= 0, got "
                             f"{self.fp8_gemm_flops}, {self.communicator_bytes}")
        if self.host_link_bw < 0:
            raise ValueError(f"ClusterSpec.host_link_bw must be >= 0, got {self.host_link_bw}")
        if self.max_cp_size < 0:
            raise ValueError(f"ClusterSpec.max_cp_size must be >= 0, got {self.max_cp_size}")
        if self.whole_domain_size and self.whole_domain_size < self.domain_size:
            raise ValueError(f"ClusterSpec.whole_domain_size must be 0 or at least domain_size "
                             f"({self.domain_size}), got {self.whole_domain_size}")

    @property
    def sharding_domain_size(self) -> int:
        """The ranks ZeRO shards state over and the group pool makes communicators for: the whole DCP domain."""
        return self.whole_domain_size or self.domain_size

    @property
    def cp_size_limit(self) -> int:
        return min(self.max_cp_size or self.domain_size, self.domain_size)

    @property
    def mem_budget_bytes(self) -> int:
        return int(self.mem_bytes_per_gpu * (1.0 - self.mem_safety_frac))

    def budget_words(self, given: str | None = None) -> str:
        """The budget plans fill, as a message says it: what was given (`given`, e.g. the flag and its value;
        else the memory per rank), what the safety margin takes, and what is left."""
        total, usable = self.mem_bytes_per_gpu / GiB, self.mem_budget_bytes / GiB
        source = given or f"{total:.4g} GiB"
        return (f"{usable:.4g} GiB per rank ({source} less the {self.mem_safety_frac:.0%} safety margin, "
                f"{total - usable:.2g} GiB)")

    def attn_rate(self, length: int) -> float:
        """Achieved causal-attention FLOP/s for a document of `length` tokens."""
        pts = self.attn_rate_points
        if length <= pts[0][0]:
            return pts[0][1]
        if length >= pts[-1][0]:
            return pts[-1][1]
        i = bisect.bisect_right([p[0] for p in pts], length)
        (l0, r0), (l1, r1) = pts[i - 1], pts[i]
        t = (math.log(length) - math.log(l0)) / (math.log(l1) - math.log(l0))
        return r0 + t * (r1 - r0)

    def same_node(self, first_rank: int, size: int) -> bool:
        return first_rank // self.gpus_per_node == (first_rank + size - 1) // self.gpus_per_node

    def with_domain(self, domain_size: int, *, gpus_per_node: int | None = None) -> "ClusterSpec":
        return replace(self, domain_size=domain_size,
                       gpus_per_node=self.gpus_per_node if gpus_per_node is None else gpus_per_node)


def _h200(domain_size: int = 8) -> ClusterSpec:
    return ClusterSpec(
        name="h200",
        domain_size=domain_size,
        gpus_per_node=8,                     # HGX H200: 8 GPUs per node
        mem_bytes_per_gpu=141 * 10 ** 9,     # HBM3e 141 GB (datasheet)
        mem_safety_frac=0.10,
        # ~790 TFLOP/s measured on a large bf16 GEMM (989 datasheet dense); end-to-end
        # layers reach less (norms, activations, small GEMMs): ~75% of that measured rate.
        gemm_flops=0.75 * 790e12,
        # Attention achieved rate by document length: H100 profile (docs/cost_model.md) scaled by
        # the H200/H100 GEMM ratio (~1.0 at equal clocks; the HBM gain matters little here).
        attn_rate_points=((512, 120e12), (1024, 230e12), (4096, 450e12), (32768, 590e12)),
        intra_node_bw=900e9 / 2,             # NVLink 900 GB/s per GPU, bidirectional -> one way
        inter_node_bw=400e9 / 8,             # 400 Gb/s InfiniBand per GPU = 50 GB/s
        microbatch_overhead_s=2e-3,          # kernel launches, optimizer-free per-mb work
        collective_latency_s=15e-6,          # one NCCL p2p/all-gather launch
        # FP8 dense 1979 TFLOP/s datasheet (2x bf16); estimated at bf16's measured/datasheet ratio (790/989)
        # and the same 75% end-to-end share: not measured yet (tools/gpu_check.sh measures it into a profile).
        fp8_gemm_flops=0.75 * 0.8 * 1979e12,
        # Estimate, not measured: NCCL_BUFFSIZE 4 MiB x (send + receive) x up to 16 p2p channels to the
        # ring's two neighbours = 128 MiB per CP communicator (NVLS buffers are not set up for p2p-only use).
        communicator_bytes=128 * 2 ** 20,
        # PCIe Gen5 x16 to the host: 64 GB/s a direction datasheet, ~50 GB/s achieved (estimate, not measured
        # here); what fine-grained activation offloading moves (planner/costmodel/relief.py)
        host_link_bw=50e9,
    )


def _datasheet_gpu(name: str):
    """A preset from a GPU's datasheet (cluster_gpu.py: the H200's measured ratios applied, nothing measured)."""
    bf16, fp8, memory, nvlink, inter, host = GPU_DATASHEETS[name]

    def build(domain_size: int = 8) -> ClusterSpec:
        h200 = _h200(domain_size)
        scale = bf16 / H200_BF16_FLOPS
        return replace(h200, name=name, mem_bytes_per_gpu=memory,
                       gemm_flops=LAYER_SHARE * H200_GEMM_RATIO * bf16,
                       attn_rate_points=tuple((length, rate * scale) for length, rate in h200.attn_rate_points),
                       intra_node_bw=nvlink / 2, inter_node_bw=inter,
                       fp8_gemm_flops=LAYER_SHARE * H200_GEMM_RATIO * fp8, host_link_bw=host)
    return build


def cpu_cluster(domain_size: int) -> ClusterSpec:
    """A DCP domain of `domain_size` single-thread CPU ranks on one machine."""
    if not isinstance(domain_size, int) or domain_size <= 0:
        raise ValueError(f"cpu_cluster domain_size must be a positive int, got {domain_size!r}")
    # Constants measured on the 2-core CI machine class; see cluster_cpu.py for how.
    return ClusterSpec(
        name="cpu",
        domain_size=domain_size,
        gpus_per_node=max(CPU_RANKS_PER_MACHINE, domain_size),
        mem_bytes_per_gpu=CPU_MEM_BYTES_PER_RANK,
        mem_safety_frac=0.10,
        distributed_optimizer=True,
        gemm_flops=CPU_GEMM_FLOPS,
        attn_rate_points=CPU_ATTN_RATE_POINTS,
        intra_node_bw=CPU_GLOO_BW,
        inter_node_bw=CPU_GLOO_BW,       # loopback either way: there is no second machine
        microbatch_overhead_s=CPU_MICROBATCH_OVERHEAD_S,
        collective_latency_s=CPU_COLLECTIVE_LATENCY_S,
        recompute_cost_factor=CPU_RECOMPUTE_COST_FACTOR,
    )


def _cpu(domain_size: int = 2) -> ClusterSpec:
    return cpu_cluster(domain_size)


CLUSTER_PRESETS = {"h200": _h200, "cpu": _cpu, **{name: _datasheet_gpu(name) for name in GPU_DATASHEETS}}


def cluster_preset(name: str, *, domain_size: int, gpus_per_node: int | None = None) -> ClusterSpec:
    if name not in CLUSTER_PRESETS:
        raise ValueError(f"unknown cluster preset {name!r}; choose one of {sorted(CLUSTER_PRESETS)}")
    if not isinstance(domain_size, int) or domain_size <= 0:
        raise ValueError(f"domain_size (number of GPUs in the DCP domain) must be a positive int, got {domain_size!r}")
    return CLUSTER_PRESETS[name]().with_domain(domain_size, gpus_per_node=gpus_per_node)
