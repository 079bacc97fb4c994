"""The `cpu` ClusterSpec's constants (`cluster.cpu_cluster` builds it): CPU physics for plans that run on CPU ranks (tests, benchmarks, demo).

Each rank is one process with one intra-op thread running TinyGPT / gpt-tiny in fp32 with the
project's CP attention over gloo. How the constants below were measured (reference machine:
2-core AMD EPYC VM, torch 2.13 CPU, shared with other jobs):

- `tools/profile_cpu.py --json cpu_profile.json` (default --clock cpu) runs two ranks at once
  (what a real step sees) and times, inside the model: the linear part (TinyGPT forward +
  backward with a trivial core attention on packed 64-token documents), the CP attention per
  (length, cp) as the model time minus its linear part, a 2-token micro-batch (fixed overhead),
  full recompute of every layer vs none on a 2048-token document (recompute_cost_factor), and
  gloo all-gather between the two ranks (bandwidth, latency; wall clock). Model timings use
  process CPU time: the machine is shared (load average 4-6 on 2 cores while these were taken),
  so wall time mostly measured the other jobs (1.4-4x the CPU time, varying run to run), while
  CPU time is what the same work takes on a dedicated core and repeats within ~10%.
- Attention runs torch's fused CPU flash-attention kernel (see runtime/attention_blocks.py);
  the rates below are for it (the earlier plain-matmul tiles ran 2-3x slower).
- Check (same tool, CPU time, predicted / measured per micro-batch): 4096 tokens cp2 full3
  1.10, 2048 cp1 full2 1.02, 2048 cp1 full4 1.06, 3000 cp1 full4 0.98, 1024 cp1 none 1.02,
  2048 cp2 none 1.05, 20 short documents (<= 700) cp2 1.37-1.49 and cp1 1.26 (short-document
  attention is overestimated: conservative for the micro-batches dcp moves to CP=1).
- Bandwidth is the earlier quiet-machine reading (1.08 GB/s; 0.4 under load).
- Re-checked on a quiet machine (load < 1): preset/measured 0.97-1.13 per kind above (CP=2 kinds
  1.07-1.13); that run's own profile put recompute_cost_factor at 0.46 (the recomputed forward
  leaves the backward's inputs in cache) but misjudged short documents 1.3-2x, so these stay.

Memory is a modelling choice, not the machine's RAM: a CPU rank gets a budget small enough that
gpt-tiny documents of a few thousand tokens need CP=2 or recompute, as 100K+ token documents do
on an H200. With 40 MiB per rank (36 MiB after the 10% margin, 11 MB of it static state), one
rank holds at most ~1.4K local tokens without recompute and ~3.6K with full recompute of all 4
layers, so a 4096-token document needs two ranks. Problems stay CPU-sized (seconds per step).
"""
from __future__ import annotations

MiB = 1024 ** 2

# CPU-time measurements (see the module docstring), 1 thread per rank, fp32, gpt-tiny; rounded.
CPU_GEMM_FLOPS = 56e9                    # TinyGPT linear part, forward+backward, end to end (56.5, 57.3)
CPU_ATTN_RATE_POINTS = (                 # cp_attention forward+backward, causal FLOPs per second
    (64, 2.1e9), (256, 11e9), (1024, 25e9), (2048, 31e9), (4096, 33e9),
)
CPU_RECOMPUTE_COST_FACTOR = 1.2          # full recompute extra / forward FLOP share (1.19 CPU time)
CPU_GLOO_BW = 1.08e9                     # bytes/s received, gloo all-gather between 2 local processes
CPU_COLLECTIVE_LATENCY_S = 200e-6        # one small gloo all-gather between 2 local processes
CPU_MICROBATCH_OVERHEAD_S = 8.0e-3       # forward+backward of a 2-token micro-batch (Python, 4 layers)
CPU_MEM_BYTES_PER_RANK = 40 * MiB        # modelling budget, see the module docstring
CPU_RANKS_PER_MACHINE = 64               # every rank of a CPU run is a local process: one "node"
