#!/usr/bin/env python
"""Measure the CPU constants of the `cpu` ClusterSpec and write them as a cost-model profile JSON.

    .venv/bin/python tools/profile_cpu.py [--model gpt-tiny] [--json OUT] [--repeats 2]

A CPU run is gloo ranks of one process and one intra-op thread each, running TinyGPT in fp32
with this project's CP attention. The tool starts two such ranks and times the same work on
both at once (as in a real step: both cores busy), all inside the model:

- gemm_flops: forward+backward of the model with a trivial core attention on packed 64-token
  documents -> linear FLOPs per token (ModelShape.linear_flops_per_token) x tokens / second,
  the end-to-end rate of the linear part (norms, activations and the loss included).
- attn_rate_points: forward+backward of the model on one document of length L with the real
  CP attention (cp 1), minus the linear part -> causal attention FLOPs / second
  (ModelShape.attn_flops_per_len2 x L^2). Short documents run far below the long-document rate.
- attention_times (profile only): the same per rank at cp 2 (the document zig-zag sharded over
  both ranks, K/V all-gathered) and cp 1: [length, cp, seconds per rank], which CostModel uses
  in place of the rate estimate when the profile is passed to it.
- microbatch_overhead_s: forward+backward of a 2-token micro-batch (fixed Python cost).
- recompute_cost_factor: a 2048-token document at cp 1 with full recompute of every layer vs none:
  measured extra time / (modelled forward share = (none - overhead) / 3). Torch checkpointing on
  CPU re-allocates every activation and replays the Python of the block, so it costs more than
  the forward FLOPs.
- intra_node_bw, collective_latency_s: all_gather_into_tensor of 4..16 MiB (bytes received per
  second) and of 8 bytes (latency) between the two ranks.

Then it checks the calibration: a set of micro-batch kinds the bench plans use (long documents
at cp 2 with recompute, packed short documents at cp 1 and cp 2, ...) is timed on both ranks
(median of the repeats, cp 1 kinds on both ranks at once) and printed next to the CostModel
prediction made with the freshly measured profile.

The output has exactly the keys cost.load_profile accepts; dcp_megatron/planner/costmodel/cluster_cpu.py
holds the numbers this tool printed on the reference machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dcp_megatron.planner.costmodel import CostModel, cpu_cluster, model_preset  # noqa: E402
pass  # noqa: E402
from dcp_megatron.planner.costmodel.cost_profile import check_profile  # noqa: E402
pass  # noqa: E402
from dcp_megatron.planner.plan import Recompute  # noqa: E402
from dcp_megatron.runtime.cp_attention import cp_attention  # noqa: E402
from dcp_megatron.runtime.sharding import shard_microbatch  # noqa: E402
from tests.support.reference.recompute import apply_recompute  # noqa: E402
from tests.support.reference.tiny_gpt import TinyGPT, TinyGPTConfig  # noqa: E402
from local_ranks import run_local_ranks  # noqa: E402

ATTN_LENGTHS = (256, 1024, 2048, 4096)
GLOO_SIZES = (1 << 22, 1 << 24)
RECOMPUTE_LENGTH = 2048
SHORT_MIX = [700, 400, 300, 200, 150, 120, 100, 64, 40, 20]      # 2094 tokens of short documents
CHECK_KINDS = (  # (lengths, cp size, recompute): what bench_runtime's static and dcp plans run
    ([4096], 2, Recompute("full", 3)), ([2048, 1024, 512, 256, 128, 64], 2, Recompute("full", 3)),
    (SHORT_MIX + SHORT_MIX, 2, Recompute("full", 3)), (SHORT_MIX + SHORT_MIX, 2, Recompute("none")),
    ([2048], 2, Recompute("none")), (SHORT_MIX, 1, Recompute("none")), ([1024], 1, Recompute("none")),
    ([2048], 1, Recompute("full", 2)), ([2048], 1, Recompute("full", 4)), ([3000], 1, Recompute("full", 4)),
)


def best_time(fn, repeats: int, clock) -> float:
    """Fastest of `repeats` runs after a warm-up; both ranks start each run together.

    Model timings use process CPU time by default (--clock): on a machine shared with other jobs a
    rank gets a varying fraction of a core and wall time mostly measures the other jobs, while CPU
    time is what the same work takes on a dedicated core. Collectives (bandwidth, latency) always
    use wall time: a rank blocked in gloo uses no CPU.
    """
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times)


def median_time(fn, repeats: int, clock) -> tuple[float, float]:
    """Median (clock seconds, wall seconds) of `repeats` runs after a warm-up."""
    fn()
    times, walls = [], []
    for _ in range(repeats):
        dist.barrier()
        start, wall = clock(), time.perf_counter()
        fn()
        times.append(clock() - start)
        walls.append(time.perf_counter() - wall)
    return statistics.median(times), statistics.median(walls)


def model_step(model: TinyGPT, lengths: list[int], cp_size: int, attention: str,
               recompute: Recompute = Recompute("none")) -> None:
    apply_recompute(model, recompute)
    shard = shard_microbatch(lengths, cp_size, dist.get_rank() % cp_size)
    tokens = torch.randint(model.config.vocab_size, (shard.num_local_tokens,))
    if attention == "trivial":
        attn = lambda q, k, v: q + 0.0 * (k.sum() + v.sum())  # noqa: E731
    else:
        attn = partial(cp_attention, shard=shard, group=dist.group.WORLD if cp_size > 1 else None)
    logits = model(tokens, shard.position_ids, attn)
    torch.nn.functional.cross_entropy(logits, tokens).backward()
    model.zero_grad(set_to_none=True)


def _rank(rank: int, world_size: int, model_name: str, repeats: int, clock_name: str) -> tuple[dict, list]:
    clock = time.process_time if clock_name == "cpu" else time.perf_counter
    torch.manual_seed(rank)
    shape = model_preset(model_name)
    model = TinyGPT(TinyGPTConfig.from_shape(shape))
    out: dict = {}
    linear_s = best_time(lambda: model_step(model, [64] * 64, 1, "trivial"), repeats, clock)
    out["gemm_flops"] = shape.linear_flops_per_token * 64 * 64 / linear_s
    out["microbatch_overhead_s"] = best_time(lambda: model_step(model, [2], 1, "real"), 5 * repeats, clock)
    plain = median_time(lambda: model_step(model, [RECOMPUTE_LENGTH], 1, "real"), repeats + 1, clock)[0]
    full = median_time(lambda: model_step(model, [RECOMPUTE_LENGTH], 1, "real", Recompute("full", shape.num_layers)),
                       repeats + 1, clock)[0]
    out["recompute_cost_factor"] = max(full - plain, 0.0) / ((plain - out["microbatch_overhead_s"]) / 3.0)
    out["attention_times"] = []
    for cp_size in (1, 2):
        for length in ATTN_LENGTHS:
            local = length // cp_size
            full = best_time(lambda: model_step(model, [length], cp_size, "real"), repeats, clock)
            linear = best_time(lambda: model_step(model, [local], 1, "trivial"), repeats, clock)
            out["attention_times"].append([length, cp_size, max(full - linear, 1e-6)])
    gloo = {}
    for nbytes in (8,) + GLOO_SIZES:
        local = torch.zeros(nbytes // 4)
        gathered = torch.empty(2 * local.numel())
        gloo[nbytes] = best_time(lambda: dist.all_gather_into_tensor(gathered, local), 3 * repeats, time.perf_counter)
    out["collective_latency_s"] = gloo[8]
    out["intra_node_bw"] = statistics.median(n / max(gloo[n] - gloo[8], 1e-9) for n in GLOO_SIZES)
    measured = []
    for lengths, cp_size, recompute in CHECK_KINDS:
        measured.append(median_time(lambda: model_step(model, lengths, cp_size, "real", recompute), repeats + 1, clock))
    return out, measured


def print_check(shape, profile: dict, measured: list[float]) -> None:
    """Predicted (preset, fresh profile) vs measured seconds per micro-batch kind."""
    preset = CostModel(shape, cpu_cluster(2))
    try:
        fresh = CostModel(shape, cpu_cluster(2), profile=check_profile(profile))
    except ValueError as err:   # a cost.py without recompute_cost_factor in its profile keys
        print(f"(profile not loadable by this cost.py: {err}; scoring without recompute_cost_factor)")
        fresh = CostModel(shape, cpu_cluster(2), profile={k: v for k, v in profile.items()
                                                          if k != "recompute_cost_factor"})
    print(f"{'micro-batch kind':44s} {'measured':>9s} {'preset':>9s} {'profile':>9s}   (wall, same runs)")
    for (lengths, cp_size, recompute), (sec, wall) in zip(CHECK_KINDS, measured):
        name = f"{len(lengths)} docs/{sum(lengths)} tok (max {max(lengths)}) cp{cp_size} {recompute}"
        p0 = preset.microbatch_time(lengths, cp_size, recompute=recompute)
        p1 = fresh.microbatch_time(lengths, cp_size, recompute=recompute)
        print(f"{name:44s} {sec:8.3f}s {p0:8.3f}s {p1:8.3f}s  (profile/measured {p1 / sec:.2f})  {wall:8.3f}s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="write the profile JSON here")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="model timings in process CPU time (default; robust on a shared machine) or wall time")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    shape = model_preset(args.model)
    out, measured = run_local_ranks(_rank, 2, args.model, args.repeats, args.clock)[0]
    rates = [[length, shape.attn_flops_per_len2 * length * length / sec]
             for length, cp, sec in out["attention_times"] if cp == 1]
    profile = {
        "gemm_flops": out["gemm_flops"],
        "attn_rate_points": rates,
        "attention_times": out["attention_times"],
        "intra_node_bw": out["intra_node_bw"],
        "inter_node_bw": out["intra_node_bw"],
        "microbatch_overhead_s": out["microbatch_overhead_s"],
        "collective_latency_s": out["collective_latency_s"],
        "recompute_cost_factor": out["recompute_cost_factor"],
        "meta": {"model": args.model, "clock": args.clock, "ranks": 2, "threads_per_rank": 1, "dtype": "float32",
                 "torch": torch.__version__, "machine": platform.machine(), "cpu_count": os.cpu_count(),
                 "load_average": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M:%S")},
    }
    print(f"gemm_flops            {profile['gemm_flops'] / 1e9:8.2f} GFLOP/s (linear part, fwd+bwd, per rank)")
    for length, rate in rates:
        print(f"attn_rate L={length:<6}   {rate / 1e9:8.2f} GFLOP/s")
    for length, cp, sec in out["attention_times"]:
        print(f"attention L={length:<6} cp={cp}  {sec * 1e3:8.1f} ms per rank")
    print(f"microbatch_overhead_s {profile['microbatch_overhead_s'] * 1e3:8.2f} ms")
    print(f"intra_node_bw         {profile['intra_node_bw'] / 1e9:8.3f} GB/s (gloo all-gather, 2 processes)")
    print(f"collective_latency_s  {profile['collective_latency_s'] * 1e6:8.1f} us")
    print(f"recompute_cost_factor {profile['recompute_cost_factor']:8.2f} (x forward share, full recompute "
          f"at L={RECOMPUTE_LENGTH})")
    print(f"load average during the run: {os.getloadavg()}")
    print_check(shape, profile, measured)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(profile, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
