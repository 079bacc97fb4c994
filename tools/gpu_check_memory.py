"""gpu_check's memory step (tools/gpu_check.py runs `python tools/gpu_check_memory.py DIR` on a GPU; it writes
DIR/memory.json; exit 0 when every relief ran and stayed inside the planner's count plus its safety margin).

The planner's memory count on the TE spec is read from Transformer Engine's sources (planner/costmodel/memory_spec.py
TRANSFORMER_ENGINE) and checked against megatron-core's real tensors only on the local spec (tools/memcheck.py, on
the `meta` device). This step measures it where it runs: one process on one GPU, the small TE-spec GPT of the
offload step (tools/gpu_check_offload.py, bf16), one micro-batch of THD-packed documents per relief of the menu
(none, each recompute_modules set, full recompute of 1, 2 and 4 layers, offload of core_attn+attn_proj) through
DCP's own step path, warmed up once; per relief, the peak allocated device memory above the step's start
(weights, gradients and optimizer-free state already allocated: what the activation count stands for) against
the planner's count for the same shape and tokens. The table (counted, measured, measured / counted) goes to
memory.json; `within_margin` per relief: measured <= counted / (1 - the cluster's safety margin).
Each row's `probe` is the same micro-batch as the memory probe before step 1 reads it (runtime/measured_memory.py:
on GPU the allocator's peak above what was allocated at its forward, on CPU the bytes saved for backward) against
the count of that quantity, and the factor the probe would set (costmodel/memory_correction.py: measured / counted
plus the margin, raised only); `probe_factors` lists them and the step prints the table.
The step also reads the device as a --dcp run does at start (runtime/device_memory.py: name, total and free memory,
what the process holds once the model and its gradients are built) and reports the preset and the default budget a
run would choose from it (planner/costmodel/device_budget.py): memory.json's `device`, and its line in the log.
FP8 is not measured here (the train_fp8 step trains under a budget; its peak per relief is not read yet).
`--cpu-smoke DIR` runs the plumbing on CPU with the local spec (the peak is not measured on a CPU; the probe's
saved bytes are).
"""
from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ((6000, 1200, 900),)                     # one micro-batch: 8,100 tokens in three documents
SMOKE_DOCS = ((30, 12, 9),)
RELIEFS = ("none", "mlp", "core_attn", "core_attn+mlp", "full1", "full2", "full4", "offload")


def relief_of(name: str):
    from dcp_megatron.planner.plan import NO_RECOMPUTE, Recompute

    if name == "none":
        return NO_RECOMPUTE
    if name.startswith("full"):
        return Recompute("full", int(name[4:]))
    if name == "offload":
        return Recompute("none", offload=frozenset({"core_attn", "attn_proj"}))
    return Recompute("selective", modules=frozenset(name.split("+")))


def counted_model(shape: dict, *, cuda: bool):
    """The planner's cost model for the probe's GPT (one rank, the device's preset; the TE spec's entries on a GPU)."""
    import dataclasses

    from dcp_megatron.planner.costmodel import CostModel, ModelShape, cluster_preset
    from dcp_megatron.planner.costmodel.memory_spec import LOCAL_BF16, TRANSFORMER_ENGINE

    model = ModelShape(num_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
                       num_heads=shape["num_heads"], num_kv_heads=shape["num_heads"],
                       head_dim=shape["hidden_size"] // shape["num_heads"], ffn_hidden_size=shape["ffn_hidden_size"],
                       vocab_size=shape["vocab"], transformer_impl="transformer_engine" if cuda else "local",
                       sequence_parallel=False, activations=TRANSFORMER_ENGINE if cuda else LOCAL_BF16)
    preset = "h200"
    if cuda:
        import torch

        from dcp_megatron.planner.costmodel.device_budget import preset_for_device

        preset = preset_for_device(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory)[0]
    cluster = dataclasses.replace(cluster_preset(preset, domain_size=1), host_link_bw=64e9)
    return CostModel(model, cluster, allowed_recompute=("none", "selective", "full", "mlp", "core_attn", "offload"))


def probe(out_dir: str, *, cuda: bool = True) -> int:
    import dataclasses

    import torch

    from dcp_megatron.core.microbatch_facts import MICROBATCH_KEY
    from dcp_megatron.planner.costmodel.memory_correction import MemoryCorrection, MemoryReading
    from dcp_megatron.runtime.measured_memory import PEAK, SAVED, counted_bytes

    sys.path.insert(0, os.path.join(REPO, "tools"))
    import gpu_check_offload as harness

    os.makedirs(out_dir, exist_ok=True)
    registry = harness._setup(cuda)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    shape, docs = (harness.MODEL, DOCS) if cuda else (harness.SMOKE_MODEL, SMOKE_DOCS)
    cost = counted_model(shape, cuda=cuda)
    tokens = sum(n + n % 2 for n in docs[0])
    result: dict = {"model": shape, "docs": [list(d) for d in docs], "tokens": tokens,
                    "safety_frac": cost.cluster.mem_safety_frac, "reliefs": {}}
    try:
        model = harness._model(cuda, shape)
        warm = harness._batches(((frozenset(), 0),), device, relief=False, docs=docs, vocab=shape["vocab"])
        harness._run_step(model, warm, cuda=cuda)   # gradients allocated, kernels warm
        if cuda:   # what a --dcp run reads at start, and the preset and budget it would choose
            from dcp_megatron.runtime.device_memory import read_device

            result["device"] = device_section(read_device(0), cost)
            print("\n".join(result["device"]["lines"]), flush=True)
        for name in RELIEFS:
            relief = relief_of(name)
            if (name == "offload" and not cuda) or relief.full_layers > shape["num_layers"]:
                continue   # megatron-core's offload needs CUDA streams; the smoke model has 2 layers
            counted = cost.bytes_per_local_token(relief) * tokens
            batches = harness._batches(((relief.offload, relief.full_layers if relief.kind == "full" else 0),),
                                       device, relief=True, docs=docs, vocab=shape["vocab"])
            if relief.modules:   # a recompute_modules relief: the facts carry it as the plan would
                batches[0][MICROBATCH_KEY] = dataclasses.replace(batches[0][MICROBATCH_KEY], recompute=relief)
            readings: list = []
            _, _, peak = harness._run_step(model, batches, cuda=cuda, readings=readings)
            row = {"relief": str(relief), "counted_bytes": int(counted)}
            kind = PEAK if cuda else SAVED
            probe_counted = counted_bytes(cost, docs[0], 1, relief, kind)
            row["probe"] = {"kind": kind, "counted_bytes": int(probe_counted), "measured_bytes": int(readings[0]),
                            "measured_over_counted": readings[0] / probe_counted}
            if cuda:
                row.update(measured_bytes=int(peak), measured_over_counted=peak / counted,
                           within_margin=peak <= counted / (1 - cost.cluster.mem_safety_frac))
            result["reliefs"][name] = row
        rows = result["reliefs"]
        correction = MemoryCorrection()
        buckets = sorted(row["relief"] for row in rows.values())
        readings = [MemoryReading(r["relief"], r["probe"]["counted_bytes"], r["probe"]["measured_bytes"])
                    for r in rows.values()]
        scale = correction.update(correction.bucket_ratios(readings, buckets), buckets)
        for row in rows.values():
            row["probe"]["factor"] = scale.of(row["relief"])
        result["probe_factors"] = {"margin": correction.margin, **{r: scale.of(r) for r in buckets}}
        print(probe_table(rows), flush=True)
        result["passed"] = bool(result["reliefs"]) and all(r.get("within_margin", True)
                                                           for r in result["reliefs"].values())
    finally:
        harness.teardown(registry)
    return harness.write_report(out_dir, "memory.json", result)


def device_section(reading, cost) -> dict:
    """memory.json's `device`: the reading, and the preset and default budget a run with `cost`'s static bytes
    chooses from it (planner/costmodel/device_budget.py), with the line the run's start prints."""
    import dataclasses

    from dcp_megatron.planner.costmodel.device_budget import choose_device_budget

    choice = choose_device_budget(reading, static_bytes=cost.static_bytes, memory_budget_gb=None,
                                  device_memory_gb=None, safety_frac=cost.cluster.mem_safety_frac)
    return {**dataclasses.asdict(reading), "preset": choice.preset, "budget_bytes": choice.mem_bytes_per_gpu,
            "static_bytes": int(cost.static_bytes), "lines": list(choice.lines)}


def probe_table(rows: dict) -> str:
    """The memory probe's counted vs measured bytes per relief, one line each."""
    lines = [f"{'relief':<16} {'probe reads':<12} {'counted MiB':>12} {'measured MiB':>13} {'ratio':>6} {'factor':>7}"]
    for name, row in rows.items():
        probe_row = row["probe"]
        lines.append(f"{name:<16} {probe_row['kind']:<12} {probe_row['counted_bytes'] / 2 ** 20:>12.2f} "
                     f"{probe_row['measured_bytes'] / 2 ** 20:>13.2f} {probe_row['measured_over_counted']:>6.2f} "
                     f"{probe_row['factor']:>7.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import gpu_check_offload

    gpu_check_offload.main(probe)
