#!/usr/bin/env python
"""Measure the CPU constants of the `cpu` ClusterSpec and write them as a cost-model profile JSON.

    .venv/bin/python tools/profile_cpu.py [--model gpt-tiny] [--json OUT] [--repeats 3]

Each rank of a CPU run is one process with one intra-op thread (what tests and benchmarks use),
running TinyGPT in fp32 with this project's CP attention, so that is what is timed:

- gemm_flops: TinyGPT forward+backward with a trivial core attention on packed 64-token
  documents -> linear FLOPs per token (ModelShape.linear_flops_per_token) x tokens / second.
  It is the end-to-end rate of the linear part (norms, activations and the loss included).
- attn_rate_points: forward+backward of cp_attention (group None) on documents of length L
  packed into ~4K-token micro-batches -> causal attention FLOPs (6 heads d_head L^2 per layer)
  / second. Short documents run far below the long-document rate (tile overheads).
- microbatch_overhead_s: forward+backward of a 2-token micro-batch (fixed Python/launch cost).
- intra_node_bw, collective_latency_s: two gloo processes on this machine, all_gather_into_tensor
  of 1 MiB .. 16 MiB (bytes received per second) and of 8 bytes (latency).

The output has exactly the keys cost.load_profile accepts; dcp_megatron/planner/cluster_cpu.py
holds the numbers this tool printed on the reference machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from dcp_megatron.planner.model import model_preset  # noqa: E402
from dcp_megatron.runtime.cp_attention import cp_attention  # noqa: E402
from dcp_megatron.runtime.reference_model import TinyGPT, TinyGPTConfig  # noqa: E402
from dcp_megatron.runtime.sharding import shard_microbatch  # noqa: E402

ATTN_LENGTHS = (64, 256, 1024, 4096)
GLOO_SIZES = (1 << 20, 1 << 22, 1 << 24)


def tiny_config(shape) -> TinyGPTConfig:
    if shape.num_heads * shape.head_dim != shape.hidden_size:
        raise ValueError(f"TinyGPT needs hidden = heads x head_dim, got {shape}")
    return TinyGPTConfig(vocab_size=shape.vocab_size, num_layers=shape.num_layers, hidden_size=shape.hidden_size,
                         num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                         ffn_hidden_size=shape.ffn_hidden_size)


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def model_step(model: TinyGPT, lengths: list[int], attention) -> None:
    shard = shard_microbatch(lengths, 1, 0)
    tokens = torch.randint(model.config.vocab_size, (shard.num_local_tokens,))
    logits = model(tokens, shard.position_ids, attention(shard))
    torch.nn.functional.cross_entropy(logits, tokens).backward()


def measure_linear(shape, repeats: int) -> float:
    model = TinyGPT(tiny_config(shape))
    lengths = [64] * 64
    trivial = lambda shard: (lambda q, k, v: q + 0.0 * (k.sum() + v.sum()))  # noqa: E731
    seconds = best_time(lambda: model_step(model, lengths, trivial), repeats)
    return shape.linear_flops_per_token * sum(lengths) / seconds


def measure_overhead(shape, repeats: int) -> float:
    model = TinyGPT(tiny_config(shape))
    local = lambda shard: partial(cp_attention, shard=shard, group=None)  # noqa: E731
    return best_time(lambda: model_step(model, [2], local), repeats * 5)


def measure_attention(shape, repeats: int) -> list[list[float]]:
    points = []
    heads, kv_heads, head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
    for length in ATTN_LENGTHS:
        lengths = [length] * max(1, 4096 // length)
        shard = shard_microbatch(lengths, 1, 0)
        rows = shard.num_local_tokens
        q = torch.randn(rows, heads, head_dim, requires_grad=True)
        k = torch.randn(rows, kv_heads, head_dim, requires_grad=True)
        v = torch.randn(rows, kv_heads, head_dim, requires_grad=True)

        def run():
            cp_attention(q, k, v, shard, None).sum().backward()
        seconds = best_time(run, repeats)
        flops = 6.0 * heads * head_dim * length * length * len(lengths)  # one layer, forward + backward
        points.append([length, flops / seconds])
    return points


def _gloo_worker(rank: int, port: int, repeats: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = {}
    for nbytes in (8,) + GLOO_SIZES:
        local = torch.zeros(nbytes // 4)
        gathered = torch.empty(2 * local.numel())
        out[nbytes] = best_time(lambda: dist.all_gather_into_tensor(gathered, local), repeats * 3)
    if rank == 0:
        results.put(out)
    dist.barrier()
    dist.destroy_process_group()


def measure_gloo(repeats: int) -> tuple[float, float]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_gloo_worker, args=(r, port, repeats, results)) for r in range(2)]
    for p in procs:
        p.start()
    out = results.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    latency = out[8]
    # Each rank receives the other's buffer: nbytes per all-gather, beyond the fixed latency.
    bandwidth = statistics.median(n / max(out[n] - latency, 1e-9) for n in GLOO_SIZES)
    return bandwidth, latency


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the profile JSON here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = model_preset(args.model)
    gemm = measure_linear(shape, args.repeats)
    overhead = measure_overhead(shape, args.repeats)
    attn = measure_attention(shape, args.repeats)
    bandwidth, latency = measure_gloo(args.repeats)
    profile = {
        "gemm_flops": gemm,
        "attn_rate_points": attn,
        "intra_node_bw": bandwidth,
        "inter_node_bw": bandwidth,
        "microbatch_overhead_s": overhead,
        "collective_latency_s": latency,
        "meta": {"model": args.model, "threads_per_rank": 1, "dtype": "float32", "torch": torch.__version__,
                 "machine": platform.machine(), "processor": platform.processor() or platform.platform(),
                 "cpu_count": os.cpu_count()},
    }
    print(f"gemm_flops            {gemm / 1e9:8.2f} GFLOP/s (TinyGPT linear part, fwd+bwd, 1 thread)")
    for length, rate in attn:
        print(f"attn_rate L={length:<6}   {rate / 1e9:8.2f} GFLOP/s")
    print(f"microbatch_overhead_s {overhead * 1e3:8.2f} ms")
    print(f"intra_node_bw         {bandwidth / 1e9:8.3f} GB/s (gloo all-gather, 2 processes)")
    print(f"collective_latency_s  {latency * 1e6:8.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(profile, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
