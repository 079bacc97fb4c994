"""The `cpu` ClusterSpec: CPU physics for plans that run on CPU ranks (tests, benchmarks, demo).

Each rank is one process with one intra-op thread running TinyGPT / gpt-tiny in fp32 with the
project's CP attention over gloo. How the constants below were measured (reference machine:
2-core AMD EPYC VM, torch 2.13 CPU, shared with other jobs):

- on a quiet machine (load average < 2), in one process: the linear part as TinyGPT forward +
  backward with a trivial core attention on packed 64-token documents; cp_attention alone
  (forward + backward, no group) on documents of length L packed into 4K-token micro-batches;
  a 2-token micro-batch for the fixed overhead; gloo all-gather between two processes for
  bandwidth and latency. Two runs agreed within ~10%.
- `tools/profile_cpu.py --json cpu_profile.json` now measures the same quantities inside the
  model on two ranks running at once (what a real step sees), and adds per-(length, cp)
  attention times. Under load from other jobs it read 2-4x slower (12-27 GFLOP/s linear), so
  those readings were not folded in; rerun it on a quiet machine and pass the JSON to
  CostModel(..., profile=load_profile(path)) (or tools/bench_runtime.py --profile) to score
  plans with this machine's own numbers.

Memory is a modelling choice, not the machine's RAM: a CPU rank gets a budget small enough that
gpt-tiny documents of a few thousand tokens need CP=2 or recompute, as 100K+ token documents do
on an H200. With 40 MiB per rank (36 MiB after the 10% margin, 11 MB of it static state), one
rank holds at most ~1.4K local tokens without recompute and ~3.6K with full recompute of all 4
layers, so a 4096-token document needs two ranks. Problems stay CPU-sized (seconds per step).
"""
from __future__ import annotations

from dcp_megatron.planner.cluster import ClusterSpec

MiB = 1024 ** 2

# Quiet-machine measurements (see the module docstring), 1 thread per rank, fp32, gpt-tiny; rounded.
CPU_GEMM_FLOPS = 60e9                    # TinyGPT linear part, forward+backward, end to end (58-62)
CPU_ATTN_RATE_POINTS = (                 # cp_attention forward+backward, causal FLOPs per second
    (64, 1.0e9), (256, 4.4e9), (1024, 13.5e9), (4096, 17.5e9),
)
CPU_GLOO_BW = 1.08e9                     # bytes/s received, gloo all-gather between 2 local processes
CPU_COLLECTIVE_LATENCY_S = 200e-6        # one small gloo all-gather between 2 local processes
CPU_MICROBATCH_OVERHEAD_S = 7.7e-3       # forward+backward of a 2-token micro-batch (Python, 4 layers)
CPU_MEM_BYTES_PER_RANK = 40 * MiB        # modelling budget, see the module docstring
CPU_RANKS_PER_MACHINE = 64               # every rank of a CPU run is a local process: one "node"


def cpu_cluster(domain_size: int) -> ClusterSpec:
    """A DCP domain of `domain_size` single-thread CPU ranks on one machine."""
    if not isinstance(domain_size, int) or domain_size <= 0:
        raise ValueError(f"cpu_cluster domain_size must be a positive int, got {domain_size!r}")
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
    )
