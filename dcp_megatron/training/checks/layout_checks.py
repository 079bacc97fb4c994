"""What `--dcp` cannot yet do in a model-parallel layout (Mixture-of-Experts, FSDP; deep and virtual pipelines run).

Called once per start from training/arguments.py's `refuse_conflicting_flags` under `--dcp`, before Megatron's own
checks and before anything is built: every refusal is one line naming the flag to change and saying why. The layout facts behind each:
- PP > 2 and virtual stages: with --dataloader-inter-document-masking Megatron-LM's get_batch reads a batch on
  every stage and model chunk, so middle stages get each micro-batch's cu_seqlens (DCP hands every chunk its
  micro-batches; the CP size and group it leaves out there are filled in by patches/models_gpt_gpt_model.py);
  without it, get_batch returns nothing on middle stages, and a CP > 1 micro-batch would run there without its
  documents: refused.
- MoE with expert parallelism: every MoE layer's dispatch/combine all-to-alls (forward and backward) pair up
  the micro-batches of the EP group's ranks. The plan runs them in lockstep (one micro-batch per group per
  wave, planner.costmodel.model.ModelShape.lockstep); full recompute would replay a layer's forward all-to-alls in
  backward on recomputing ranks only, so it is taken out of --dcp-recompute's choices.
- MoE with TP > 1 (Megatron requires sequence parallelism there): each TP rank routes its share of the rows;
  the per-document token counts are summed over the TP group and the micro-batch's CP group in turn.
- Multi-token prediction (`--mtp-num-layers`) runs: its shift and loss follow each micro-batch's CP group and
  documents (patches/transformer_multi_token_prediction.py).
- Sharded weights (`--use-megatron-fsdp`, `--use-torch-fsdp2`): every module's forward and backward all-gather
  its weights over the DP x CP group, so every rank would have to run the same micro-batches in lockstep (as
  ZeRO-3 does under DeepSpeed); megatron-core 0.19.2's implementations need CUDA (Megatron-FSDP creates
  `torch.cuda.Stream`s, megatron_fsdp.py; the FSDP2 wrapper builds a "cuda" DeviceMesh,
  torch_fully_sharded_data_parallel.py), so their exactness under --dcp is not verified: refused.
- `global_aux_loss` reduces per micro-batch over the whole TP x DP x CP group, which ranks running different
  micro-batch counts cannot join, and balances each micro-batch against the running mean of the micro-batches so
  far: a function of the plan's packing and order, so not exact even in lockstep; `quantile_balancing` gathers router logits per micro-batch and is untested
  with per-micro-batch groups.
"""
from __future__ import annotations

import argparse
import os

from dcp_megatron.config import DcpUsageError, recompute_choices


def check_dcp_layout(args: argparse.Namespace) -> None:
    """Refuse (DcpUsageError) what --dcp cannot honour in this layout; narrow --dcp-recompute for EP > 1."""
    virtual_stages = any(getattr(args, name, None) is not None for name in (
        "virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
        "num_virtual_stages_per_pipeline_rank"))
    refusals = (
        ((args.pipeline_model_parallel_size > 2 or virtual_stages) and not args.dataloader_inter_document_masking,
         f"--dcp with --pipeline-model-parallel-size {args.pipeline_model_parallel_size}"
         f"{' and virtual pipeline stages' if virtual_stages else ''} needs --dataloader-inter-document-masking: "
         "without it Megatron-LM's get_batch hands middle stages no batch, so their attention would run without "
         "the micro-batch's documents and CP group"),
    )
    # the memory readings are one per micro-batch of one stage; pipelining interleaves them (off by default there)
    memory_flags = [f"--dcp-memory-{name}" for name in ("refine", "probe")
                    if getattr(args, f"dcp_memory_{name}", False)]
    refusals += (
        (args.pipeline_model_parallel_size > 1 and bool(memory_flags),
         f"{' and '.join(memory_flags)} cannot run under --pipeline-model-parallel-size "
         f"{args.pipeline_model_parallel_size}: the memory probe and refinement read one micro-batch at a time on one "
         f"stage, which pipelining interleaves; drop {' and '.join(memory_flags)} (off by default with PP > 1) or "
         "run PP 1"),
    )
    for flag, sharded in (("--use-megatron-fsdp", getattr(args, "use_megatron_fsdp", False)),
                          ("--use-torch-fsdp2", getattr(args, "use_torch_fsdp2", False))):
        refusals += (
            (bool(sharded),
             f"{flag} is not supported with --dcp: it all-gathers every module's weights over the DP x CP group in "
             "each forward and backward, which ranks running their own micro-batches do not pair up, and "
             "megatron-core 0.19.2's implementation needs CUDA, so it is not verified exact; use "
             "--use-distributed-optimizer, or DeepSpeed ZeRO-3 under --dcp (pretrain_gpt_deepspeed.py)"),
        )
    num_experts = getattr(args, "num_experts", None)
    if num_experts:
        balancing = args.moe_router_load_balancing_type
        balancing = balancing if isinstance(balancing, list) else [balancing]
        refusals += (
            ("global_aux_loss" in balancing,
             "--moe-router-load-balancing-type global_aux_loss cannot be exact under --dcp: it all-reduces token "
             "counts over the whole domain at every micro-batch (ranks running different micro-batch counts cannot "
             "join) and balances each micro-batch against the running mean of the micro-batches so far, which "
             "depends on how the plan packs and orders documents; use aux_loss, seq_aux_loss (per document under "
             "--dcp), sinkhorn, none, or --moe-router-enable-expert-bias (counts of the whole global batch)"),
            ("quantile_balancing" in balancing,
             "--moe-router-load-balancing-type quantile_balancing is not supported with --dcp: it reduces over the "
             "whole domain per micro-batch, which ranks running different micro-batch counts cannot join; use "
             "aux_loss, seq_aux_loss, sinkhorn or none"),
        )
    for refused, message in refusals:
        if refused:
            raise DcpUsageError(message)
    if num_experts and args.expert_model_parallel_size > 1:
        _without_full_recompute(args)


def _without_full_recompute(args: argparse.Namespace) -> None:
    """EP > 1: a recomputing rank would replay its MoE all-to-alls in backward alone (module docstring): full
    recompute and `moe` module recompute (which reruns the MoE layer with its dispatch) are off."""
    reason = (f"--expert-model-parallel-size {args.expert_model_parallel_size}: full and moe recompute would replay "
              "MoE all-to-alls in backward on the recomputing ranks only")
    kinds = recompute_choices(args.dcp_recompute)   # "" or "," is refused, not read as every kind
    if kinds is not None:
        replaying = [k for k in kinds if k in ("full", "moe")]
        if replaying:
            raise DcpUsageError(f"--dcp-recompute {args.dcp_recompute}: drop {', '.join(repr(k) for k in replaying)} "
                                f"({reason})")
        return
    args.dcp_recompute = "none,selective,mlp"
    if int(os.environ.get("RANK", getattr(args, "rank", 0) or 0)) == 0:
        print(f"dcp: --dcp-recompute none,selective,mlp ({reason})", flush=True)
