"""Common flag mistakes named by flag, before Megatron's own `validate_args` meets them as bare assertions.

megatron.training 0.19.2 stops on these with an `AssertionError` and no message (`--save` without
`--save-interval`), or with one that names internal values rather than the flags to change (`global batch
size not divisible by micro batch size times data parallel size`, raised only once process groups exist;
`max_position_embeddings must be greater than ...`; `--lr-warmup-iters` not below the decay iterations, found
only when the optimizer's scheduler is built). Every run on megatron.training, with or without
`--dcp`, gets one line naming the flags instead (patches/training_arguments.py calls this first).

`check_unrunnable_flags` (also the DeepSpeed script's) refuses flags that would fail later or do nothing:
`--rampup-batch-size` (megatron-core 0.19's calculator ignores it: the run trains `--global-batch-size` from
step 1), `--wandb-project` without wandb installed (ModuleNotFoundError when the writer is set up), or
without an experiment name or a directory for its files, and `--position-embedding-type yarn` without a GPU
(megatron-core's YaRN embedding moves its tables to `torch.cuda.current_device()` in every forward); also
without a GPU, `--fine-grained-activation-offloading` / `--offload-modules` (megatron.training's bare assertion
that TE runs it; TE's offload is CUDA streams and pinned memory) and `--moe-grouped-gemm` (validate_args asks CUDA
for the compute capability: "Found no NVIDIA driver").

`check_backend` (both scripts, after the CPU defaults) refuses `--distributed-backend nccl` given on a machine
without a GPU: torch's ProcessGroupNCCL raises "no GPUs found" with a traceback per rank once the process groups
are made.

`check_model_parallel_tiles_world`: a world size that TP x PP (x CP) does not divide (Megatron's assertion names
`total_model_size`, with a traceback).
"""
from __future__ import annotations

import argparse
import importlib.util
import math

from dcp_megatron.config import DcpUsageError


def data_parallel_size_of(args: argparse.Namespace) -> int | None:
    """World size / (TP x PP x CP), as Megatron's validate_args will compute it; None where it cannot."""
    model_size = (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                  * args.context_parallel_size)
    world_size = getattr(args, "world_size", None)
    if getattr(args, "tensor_parallel_num_weight_shards", None) not in (None, 1):
        return None   # weight shards add an axis Megatron derives inside validate_args; its own check stands
    if not world_size or model_size < 1 or world_size % model_size:
        return None   # Megatron's own check names an indivisible world size
    return world_size // model_size


def check_model_parallel_tiles_world(args: argparse.Namespace) -> None:
    """Megatron's validate_args asserts that the world size is a multiple of TP x PP x CP (a traceback that names
    `total_model_size`); say it with the flags and the ranks that would run."""
    world_size = getattr(args, "world_size", None)
    if not world_size or getattr(args, "tensor_parallel_num_weight_shards", None) not in (None, 1):
        return   # weight shards add an axis Megatron derives inside validate_args; its own check stands
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size)
    model_size = tp * pp * cp
    if model_size < 1 or world_size % model_size == 0:
        return
    sizes = f"TP {tp} x PP {pp}{f' x CP {cp}' if cp > 1 else ''}"
    flags = "--tensor-model-parallel-size / --pipeline-model-parallel-size" + (
        " / --context-parallel-size" if cp > 1 else "")
    example = model_size * max(1, world_size // model_size)
    raise DcpUsageError(f"world size {world_size} is not divisible by {sizes} = {model_size} (every model replica "
                        f"spans {model_size} ranks): run a multiple of {model_size} ranks (e.g. {example}), or "
                        f"change {flags} so their product divides {world_size}")


def check_unrunnable_flags(args: argparse.Namespace, *, has_gpu: bool) -> None:
    """Refuse flags that would do nothing or fail after start-up (module docstring), naming what to do."""
    rampup = getattr(args, "rampup_batch_size", None)
    if rampup is not None:
        raise DcpUsageError(f"--rampup-batch-size {' '.join(map(str, rampup))} is ignored by megatron-core 0.19 "
                            f"(deprecated: the run would train --global-batch-size from step 1); give the ramp as "
                            f"--step-batch-size-schedule{_schedule_example(args, rampup)} (THRESHOLD:BATCH pairs, "
                            "thresholds in tokens), or drop the flag")
    if getattr(args, "wandb_project", None):
        if not getattr(args, "wandb_exp_name", None):
            raise DcpUsageError(f"--wandb-project {args.wandb_project} needs --wandb-exp-name NAME")
        if not (getattr(args, "wandb_save_dir", None) or getattr(args, "save", None)):
            raise DcpUsageError(f"--wandb-project {args.wandb_project} needs --wandb-save-dir DIR (or --save, "
                                "under which wandb's files go by default)")
        if importlib.util.find_spec("wandb") is None:
            raise DcpUsageError(f"--wandb-project {args.wandb_project}: wandb is not installed (Megatron imports it "
                                "when it sets up its writer); pip install wandb, or drop --wandb-project")
    if getattr(args, "position_embedding_type", None) == "yarn" and not has_gpu:
        raise DcpUsageError("--position-embedding-type yarn needs a GPU: megatron-core's YaRN rotary embedding "
                            "moves its tables to the current CUDA device in every forward; on CPU use "
                            "--position-embedding-type rope")
    if not has_gpu:
        check_mla_rope(args)
        check_gpu_only_flags(args)


def check_mla_rope(args: argparse.Namespace) -> None:
    """Without a GPU: multi-latent attention's YaRN rope (its default) moves its tables to CUDA in every forward."""
    rope_type = getattr(args, "rope_type", None)
    if getattr(args, "multi_latent_attention", False) and rope_type in (None, "yarn"):
        given = "--rope-type yarn" if rope_type else "--multi-latent-attention (its default --rope-type yarn)"
        raise DcpUsageError(f"{given} needs a GPU: megatron-core's YaRN rotary embedding (--rotary-scaling-factor, "
                            "--mscale) moves its tables to the current CUDA device in every forward; on CPU give "
                            "--rope-type rope")


def check_gpu_only_flags(args: argparse.Namespace) -> None:
    """On a machine without a GPU: flags whose megatron-core code needs CUDA, refused before they fail in it."""
    offload = [flag for flag, given in (
        ("--fine-grained-activation-offloading", getattr(args, "fine_grained_activation_offloading", False)),
        ("--offload-modules", bool(getattr(args, "offload_modules", None)))) if given]
    if offload:
        # megatron.training asserts TE for it (a bare AssertionError); TE's offload is CUDA streams and pinned memory
        raise DcpUsageError(f"{' '.join(offload)} needs a GPU: megatron-core's fine-grained activation offloading "
                            "copies activations to pinned host memory on CUDA streams (so does --dcp-recompute "
                            f"offload); on CPU drop {' and '.join(offload)}")
    if getattr(args, "moe_grouped_gemm", False):
        # megatron.training's validate_args asks CUDA for the compute capability: "Found no NVIDIA driver"
        raise DcpUsageError("--moe-grouped-gemm needs a GPU: megatron.training checks the GPU's compute capability "
                            "for its grouped GEMM kernels; on CPU drop it (the experts then run as megatron-core's "
                            "SequentialMLP)")


def check_backend(args: argparse.Namespace, *, has_gpu: bool) -> None:
    """`--distributed-backend nccl` without a GPU (given explicitly: without the flag a CPU run defaults to gloo)."""
    if getattr(args, "distributed_backend", None) == "nccl" and not has_gpu:
        raise DcpUsageError("--distributed-backend nccl needs a GPU (torch's NCCL process group finds none on this "
                            "machine); on CPU give --distributed-backend gloo, or leave the flag out (without a GPU "
                            "it defaults to gloo)")


def _schedule_example(args: argparse.Namespace, rampup) -> str:
    """The schedule megatron-core's old ramp-up calculator followed, when it is a short one."""
    start, increment, ramp_samples = (int(v) for v in rampup)
    final, seq_length = getattr(args, "global_batch_size", None), getattr(args, "seq_length", None)
    if not (final and seq_length and increment > 0 and start < final) or (final - start) % increment:
        return ' "0:START TOKENS:BATCH ..."'
    steps = (final - start) // increment
    if steps > 6:
        return ' "0:START TOKENS:BATCH ..."'
    per_step = ramp_samples / steps
    pairs = [f"{math.ceil(i * per_step) * seq_length}:{start + i * increment}" for i in range(steps + 1)]
    return f' "{" ".join(pairs)}"'


def check_sequence_parallel_rows(args: argparse.Namespace) -> None:
    """TP > 1 with --sequence-parallel splits every --seq-length sequence over the TP ranks (Megatron's bare
    assertion in scatter_to_sequence_parallel_region otherwise: at step 1, or under --dcp, which pads its own
    training micro-batches, at the first evaluation, after training)."""
    tp, seq_length = args.tensor_model_parallel_size, args.seq_length
    if not (getattr(args, "sequence_parallel", False) and tp > 1 and seq_length and seq_length % tp):
        return
    multiple = f"give a --seq-length multiple of {tp} (e.g. {max(tp, seq_length - seq_length % tp)})"
    where = f"--sequence-parallel splits each --seq-length sequence over the {tp} TP ranks"
    if getattr(args, "dcp", False):
        if not (getattr(args, "eval_iters", 0) or getattr(args, "full_validation", False)):
            return   # DCP pads its micro-batches' rows to a multiple of TP; nothing else runs Megatron's batches
        raise DcpUsageError(f"--seq-length {seq_length} is not divisible by --tensor-model-parallel-size {tp}: "
                            f"{where} in Megatron's evaluation (--dcp pads only its training micro-batches); "
                            f"{multiple}, or --eval-iters 0")
    raise DcpUsageError(f"--seq-length {seq_length} is not divisible by --tensor-model-parallel-size {tp}: {where}; "
                        f"{multiple}, or drop --sequence-parallel")


def check_warmup_below_decay(args: argparse.Namespace) -> None:
    """Megatron's scheduler asserts warm-up < decay without a message. Iteration-based schedules only
    (sample-based runs give --lr-*-samples, checked by Megatron itself)."""
    decay_iters = (getattr(args, "lr_decay_iters", None) or args.train_iters) if getattr(args, "train_iters", None) \
        else None
    warmup_iters = getattr(args, "lr_warmup_iters", 0) or 0
    if decay_iters and getattr(args, "lr_warmup_fraction", None) is None and warmup_iters >= decay_iters:
        decay_flag = "--lr-decay-iters" if getattr(args, "lr_decay_iters", None) else "--train-iters"
        raise DcpUsageError(f"--lr-warmup-iters {warmup_iters} must be below {decay_flag} {decay_iters} (the "
                            f"learning rate warms up, then decays): lower --lr-warmup-iters or raise {decay_flag}")


def check_megatron_flags(args: argparse.Namespace) -> None:
    """Refuse (DcpUsageError) the mistakes of the module docstring, naming the flag to change."""
    import torch

    check_model_parallel_tiles_world(args)
    check_unrunnable_flags(args, has_gpu=torch.cuda.is_available())
    check_backend(args, has_gpu=torch.cuda.is_available())   # after the CPU defaults (patches/training_arguments.py)
    check_sequence_parallel_rows(args)
    if args.save and (args.save_interval is None or args.save_interval < 1):
        got = "is missing" if args.save_interval is None else f"is {args.save_interval}"
        raise DcpUsageError(f"--save {args.save} needs --save-interval N (iterations between checkpoints, >= 1); "
                            f"--save-interval {got}")
    if args.seq_length is not None and args.max_position_embeddings is not None \
            and args.seq_length > args.max_position_embeddings:
        raise DcpUsageError(f"--seq-length {args.seq_length} is over --max-position-embeddings "
                            f"{args.max_position_embeddings}: raise --max-position-embeddings to at least "
                            f"{args.seq_length}, or shorten --seq-length")
    check_warmup_below_decay(args)
    data_parallel_size = data_parallel_size_of(args)
    if data_parallel_size is None or not args.micro_batch_size or args.micro_batch_size < 1:
        return
    # The evaluation batch defaults to the training one (Megatron's validate_args), so each is checked as used.
    eval_batch = getattr(args, "eval_global_batch_size", None) or args.global_batch_size
    eval_micro = getattr(args, "eval_micro_batch_size", None) or args.micro_batch_size
    batches = (("--global-batch-size", args.global_batch_size, "--micro-batch-size", args.micro_batch_size),
               ("--eval-global-batch-size", eval_batch, "--eval-micro-batch-size", eval_micro))
    for batch_flag, batch_size, micro_flag, micro_size in batches:
        if batch_size is None:
            continue   # derived by Megatron (micro-batch x data-parallel size) or from a batch-size schedule
        unit = micro_size * data_parallel_size
        if batch_size % unit:
            raise DcpUsageError(
                f"{batch_flag} {batch_size} is not divisible by {micro_flag} {micro_size} x data-parallel size "
                f"{data_parallel_size} (world size {args.world_size} / (TP {args.tensor_model_parallel_size} x PP "
                f"{args.pipeline_model_parallel_size} x CP {args.context_parallel_size})) = {unit}: give a multiple "
                f"of {unit}, e.g. {batch_flag} {max(unit, batch_size - batch_size % unit)}")
