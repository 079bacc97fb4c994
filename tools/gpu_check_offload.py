"""gpu_check's offload step (tools/gpu_check.py runs `python tools/gpu_check_offload.py DIR` on a GPU; it writes
DIR/offload.json; exit 0 when both checks pass).

One process on one GPU, megatron-core 0.19.2 with DCP's megatron patch set applied: a small GPT on the TE spec,
built as `--dcp --dcp-recompute ...,offload` builds it (fine_grained_activation_offloading, offload_modules
core_attn attn_proj), trained through DCP's own step path: `_MegatronStep.run_batches` (the offload manager put in
DCP's every-step warm-up) around megatron-core's `forward_backward_no_pipelining`, with `DcpForwardStep`
switching each micro-batch's recompute and offload. Micro-batches carry hand-made plan reliefs:
1. parity: two steps whose micro-batches offload on some and not others (none, core_attn, core_attn+attn_proj,
   full recompute of one layer), each against the same micro-batches with no relief: the loss and every
   gradient agree (max error relative to the largest |reference| <= TOLERANCE; offload copies bytes, only kernel
   order may differ);
2. memory: the peak allocated device memory above the step's start (torch.cuda.max_memory_allocated) of a step
   whose micro-batches all offload core_attn+attn_proj is below the same step's with none.
`--cpu-smoke DIR` runs the same harness on CPU without offload (local spec, parity only): it checks the probe's
own plumbing where no GPU is lent; it proves nothing about offload.
"""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 1e-2
MODEL = dict(num_layers=4, hidden_size=1024, num_heads=8, ffn_hidden_size=2816, vocab=4096)
DOCS = ((6000, 1200), (3000, 2000, 500), (8190,), (100, 900, 4000))   # token lengths of each micro-batch's docs
SMOKE_MODEL = dict(num_layers=2, hidden_size=64, num_heads=4, ffn_hidden_size=128, vocab=128)   # --cpu-smoke
SMOKE_DOCS = ((30, 12), (20, 7, 5), (41,), (3, 9, 16))
ON = frozenset({"core_attn", "attn_proj"})
# (offload set, full-recompute layers) per micro-batch, for two steps: offload on some, not others
STEPS = (((frozenset(), 0), (frozenset({"core_attn"}), 0), (ON, 0), (frozenset(), 1)),
         ((ON, 0), (frozenset(), 0), (frozenset(), 1), (frozenset({"core_attn"}), 0)))


def _setup(cuda: bool):
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29556")
    if cuda:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from patches.megatron_set import megatron_patch_registry

    registry = megatron_patch_registry().apply()
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1)
    return registry


def _model(cuda: bool, shape: dict):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.transformer.transformer_config import TransformerConfig

    from dcp_megatron.core.offload import offload_modules_for

    offload = dict(fine_grained_activation_offloading=True, offload_modules=offload_modules_for(is_moe=False))
    config = TransformerConfig(num_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
                               num_attention_heads=shape["num_heads"], ffn_hidden_size=shape["ffn_hidden_size"],
                               hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
                               normalization="RMSNorm", gated_linear_unit=True, bf16=cuda,
                               params_dtype=torch.bfloat16 if cuda else torch.float32,
                               use_cpu_initialization=not cuda, **(offload if cuda else {}))
    spec = get_gpt_layer_with_transformer_engine_spec() if cuda else get_gpt_layer_local_spec()
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=shape["vocab"],
                     max_sequence_length=16384, position_embedding_type="rope")
    return model.cuda() if cuda else model


def _batches(step, device, *, relief: bool, docs, vocab: int):
    import torch

    from dcp_megatron.core.microbatch_facts import MICROBATCH_KEY, MicroBatchFacts
    from dcp_megatron.planner.plan import NO_RECOMPUTE, Recompute

    generator = torch.Generator().manual_seed(7)
    batches = []
    for index, ((offload, full), lengths) in enumerate(zip(step, docs)):
        padded = [n + n % 2 for n in lengths]
        total = sum(padded)
        tokens = torch.randint(0, vocab, (1, total + 1), generator=generator)
        bounds = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
        position_ids = torch.cat([torch.arange(n) for n in padded]).unsqueeze(0)
        if not relief:
            recompute = NO_RECOMPUTE
        elif full:
            recompute = Recompute("full", full)
        else:
            recompute = Recompute("none", offload=offload)
        facts = MicroBatchFacts(wave_index=0, cp_size=1, cp_rank=0, group=None, recompute=recompute,
                                microbatch_index=index)
        batches.append({MICROBATCH_KEY: facts, "tokens": tokens[:, :-1].to(device),
                        "labels": tokens[:, 1:].to(device), "position_ids": position_ids.to(device),
                        "bounds": bounds.to(device), "max_seqlen": max(padded)})
    return batches


def _forward_step(data_iterator, model):
    from megatron.core.packed_seq_params import PackedSeqParams

    batch = next(data_iterator)
    bounds = batch["bounds"]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, cu_seqlens_q_padded=bounds,
                             cu_seqlens_kv_padded=bounds, max_seqlen_q=batch["max_seqlen"],
                             max_seqlen_kv=batch["max_seqlen"])
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=params)

    def loss_func(output):
        loss = output.float().sum() / 1e4
        return loss, {"loss": loss.detach()}

    return losses, loss_func


def _run_step(model, batches, *, cuda: bool, readings: list | None = None) -> tuple[float, dict, int]:
    """One DCP step (the run's own path, _MegatronStep.run_batches): the loss, the gradients, the peak bytes;
    `readings`: each micro-batch's bytes as the memory probe reads them (runtime/measured_memory.py) appended."""
    import torch
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from dcp_megatron.training.schedule import _MegatronStep

    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()
    owner = SimpleNamespace(inner=forward_backward_no_pipelining, has_gpu=cuda, model_shape=SimpleNamespace(pp=1),
                            loop=SimpleNamespace(measures_memory=lambda: readings is not None),
                            config=SimpleNamespace(dump_saved_bytes=None))
    step = _MegatronStep(owner, forward_step_func=_forward_step, data_iterator=None, model=model,
                         seq_length=16384, schedule_kwargs={})
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    ran = step.run_batches(batches, share=None)
    if readings is not None:
        readings.extend(ran.memory_bytes)
    peak = 0
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start
    loss = float(sum(float(r["loss"]) for r in ran.result))
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss, grads, peak


def _rel(x, ref) -> float:
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def probe(out_dir: str, *, cuda: bool = True) -> int:
    import torch

    os.makedirs(out_dir, exist_ok=True)
    os.environ.setdefault("NVTE_CPU_OFFLOAD_V1", "1")
    registry = _setup(cuda)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    shape, docs = (MODEL, DOCS) if cuda else (SMOKE_MODEL, SMOKE_DOCS)
    model = _model(cuda, shape)

    def batches(step, relief: bool):
        return _batches(step, device, relief=relief, docs=docs, vocab=shape["vocab"])

    result: dict = {"model": shape, "docs": [list(d) for d in docs], "tolerance": TOLERANCE, "steps": []}
    try:
        _run_step(model, batches(STEPS[0], relief=False), cuda=cuda)   # grads allocated, kernels warm
        for step in STEPS:
            plan = [[sorted(o), full] for o, full in step]
            steps = step if cuda else tuple((frozenset(), full) for _, full in step)   # CPU: no offload
            ref_loss, ref_grads, _ = _run_step(model, batches(steps, relief=False), cuda=cuda)
            loss, grads, _ = _run_step(model, batches(steps, relief=True), cuda=cuda)
            errors = {n: _rel(grads[n], ref_grads[n]) for n in ref_grads}
            worst = max(errors, key=errors.get)
            result["steps"].append({"plan (offload, full layers) per micro-batch": plan, "loss": loss,
                                    "reference_loss": ref_loss, "loss_rel_error": abs(loss - ref_loss) / abs(ref_loss),
                                    "max_grad_rel_error": errors[worst], "worst_param": worst,
                                    "grads_compared": len(errors) == len(grads) and len(errors)})
        parity = all(s["grads_compared"] and s["max_grad_rel_error"] <= TOLERANCE
                     and s["loss_rel_error"] <= TOLERANCE for s in result["steps"])
        result["parity_passed"] = bool(parity)
        if cuda:
            all_on = tuple((ON, 0) for _ in DOCS)
            _, _, peak_none = _run_step(model, batches(all_on, relief=False), cuda=cuda)
            _, _, peak_offload = _run_step(model, batches(all_on, relief=True), cuda=cuda)
            result.update(peak_bytes_no_relief=peak_none, peak_bytes_offload=peak_offload,
                          peak_fell_by=peak_none - peak_offload, memory_passed=peak_offload < peak_none)
        result["passed"] = bool(parity and result.get("memory_passed", not cuda))
    finally:
        teardown(registry)
    return write_report(out_dir, "offload.json", result)


def teardown(registry) -> None:
    """Undo _setup: model-parallel state, the process group, the patch set."""
    import torch
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    registry.remove()


def write_report(out_dir: str, name: str, result: dict) -> int:
    """The probe's JSON report (also printed); exit status 0 when it passed."""
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result), flush=True)
    return 0 if result["passed"] else 1


def main(probe_function) -> None:
    """`python TOOL DIR` on a GPU, `python TOOL --cpu-smoke DIR` for the harness's plumbing on CPU."""
    sys.path.insert(0, REPO)
    if len(sys.argv) == 3 and sys.argv[1] == "--cpu-smoke":
        sys.exit(probe_function(sys.argv[2], cuda=False))
    sys.exit(probe_function(sys.argv[1]))


if __name__ == "__main__":
    main(probe)
