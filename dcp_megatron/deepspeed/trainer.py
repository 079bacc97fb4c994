"""The DeepSpeed trainer: Megatron's loop for a DeepSpeed engine, with or without `--dcp`.

`run(argv, model_provider=..., forward_loss=..., patches=...)` is a DeepSpeed script's `main`
(`dcp_megatron.train_deepspeed`, which supplies the patch set): Megatron's flags (arguments.py),
set-up (setup.py), an optional resume (checkpoint.py: the data position travels in DeepSpeed's client state), then
`--train-iters` planned steps (steps.py), each logged as Megatron logs it plus the ` dcp iteration` line both
engines print (core/plan_log.py), the evaluation after every `--eval-interval` steps and at the end
(evaluation.py), and a checkpoint every `--save-interval` steps; `--exit-interval N` saves (under --save) and
stops after the first step N divides, as Megatron's loop does. A collective that times out ends the run with
the one line both engines give (core/collective_watch.py), as does a micro-batch that runs out of memory (recorded
for the resumed run: core/out_of_memory.py); a usage error with one line and exit status 2.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from dcp_megatron.config import DcpUsageError


def log_step(training, outcome, *, iteration: int, train_iters: int, consumed: int) -> None:
    """Megatron's iteration line (loss, grad norm, learning rate) and the step's plan line. The engine steps its
    scheduler after each update, so the rate read here is the one iteration + 1's update will use (Megatron logs
    the same); the line says which iteration's it is."""
    from dcp_megatron.core.plan_log import dcp_iteration_line

    engine, steps = training.engine, training.steps
    norm = f" grad norm: {outcome.grad_norm:.6f} |" if outcome.grad_norm is not None else ""
    lr = engine.get_lr()[0] if engine.get_lr() else float("nan")
    print(f" iteration {iteration:8d}/{train_iters:8d} | consumed tokens: {consumed:12d} | "
          f"lm loss: {outcome.loss:.6E} |{norm} learning rate: {lr:.6E} | (the rate of iteration {iteration + 1}) | "
          f"step time (ms): "
          f"{outcome.seconds * 1000:.1f} |", flush=True)
    print(dcp_iteration_line(steps.loop.last_record, forward_backward_s=outcome.seconds,
                             domain_rank=steps.pool.domain_rank, corrections=steps.corrections,
                             memory=steps.loop.memory_text()), flush=True)


def log_validation(training, where: str) -> None:
    """Megatron's validation line (megatron.training's evaluate_and_print_results)."""
    loss = training.evaluation.evaluate(training.engine)
    if training.rank == 0:
        print(f" validation loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {math.exp(min(20, loss)):.6E} |",
              flush=True)


def resume(training, args: argparse.Namespace) -> tuple[int, int]:
    """(iteration, consumed tokens) of the checkpoint at --load, its data position restored; (0, 0) without."""
    from dcp_megatron.deepspeed import checkpoint

    if not args.load or not checkpoint.has_latest(args.load):   # (--load = --save, nothing saved yet: a first start)
        return 0, 0
    iteration, data_state = checkpoint.load(training.engine, args.load, apply_config=args.override_optimizer_config)
    try:
        training.steps.load_state_dict(data_state["samples"])
    except (KeyError, ValueError) as err:
        raise DcpUsageError(f"--load {args.load}: the checkpoint's data position does not fit this run "
                            f"({err})") from None
    consumed = int(data_state["consumed_tokens"])
    if training.evaluation is not None:
        training.evaluation.shares.start(int(data_state.get("valid_samples", 0)))
    if training.rank == 0:
        print(f"resumed from {args.load} at iteration {iteration} ({consumed} tokens trained)", flush=True)
    return iteration, consumed


def save(training, args: argparse.Namespace, *, iteration: int, consumed: int) -> None:
    from dcp_megatron.deepspeed import checkpoint

    if training.rank == 0:
        print(f"saving checkpoint at iteration {iteration} to {args.save}", flush=True)
    valid = {} if training.evaluation is None else {
        "valid_samples": training.evaluation.shares.consumed_samples}   # as Megatron's consumed_valid_samples
    checkpoint.save(training.engine, args.save, iteration=iteration, ds_config=training.ds_config,
                    data_state={"samples": training.steps.state_dict(), "consumed_tokens": consumed, **valid})


def train(args: argparse.Namespace, *, model_provider, forward_loss, patches) -> None:
    from dcp_megatron.core.collective_watch import CollectiveWatch
    from dcp_megatron.core.out_of_memory import EVALUATION, MicrobatchOutOfMemory, outside_microbatch
    from dcp_megatron.deepspeed.setup import setup_training
    from dcp_megatron.runtime.device_ceiling import emulated_device

    training = setup_training(args, model_provider=model_provider, forward_loss=forward_loss, patches=patches)
    engine, steps, rank = training.engine, training.steps, training.rank
    iteration, consumed = resume(training, args)
    started = time.perf_counter()
    where = "start"
    # --dcp-device-memory-gb without a GPU: the loop runs on an emulated device (runtime/device_ceiling.py)
    with CollectiveWatch(rank=rank, world_size=torch.distributed.get_world_size(), step_of=lambda: iteration + 1,
                         timeout_minutes=args.distributed_timeout_minutes) as watch, \
            emulated_device(steps.loop.config.device_memory_gb):
        try:
            while iteration < args.train_iters:
                where = f"iteration {iteration + 1}"
                outcome = steps.train_step(engine, last=iteration + 1 == args.train_iters)
                iteration += 1
                consumed += outcome.num_tokens
                if rank == 0 and iteration % args.log_interval == 0:
                    log_step(training, outcome, iteration=iteration, train_iters=args.train_iters, consumed=consumed)
                if training.evaluation is not None and iteration % args.eval_interval == 0:
                    where = f"evaluating at iteration {iteration}"
                    # before the save, as Megatron
                    log_validation(training, f"iteration {iteration} on validation set")
                exiting = bool(args.exit_interval) and iteration % args.exit_interval == 0
                if args.save and ((args.save_interval and (iteration % args.save_interval == 0
                                                           or iteration == args.train_iters)) or exiting):
                    where = f"saving iteration {iteration}"
                    save(training, args, iteration=iteration, consumed=consumed)
                if exiting and iteration < args.train_iters:   # as Megatron's loop: saved first, no final evaluation
                    if rank == 0:
                        print(f"exiting at iteration {iteration} (--exit-interval {args.exit_interval})", flush=True)
                    break
            if training.evaluation is not None and iteration == args.train_iters:
                where = "evaluating at the end of training"
                log_validation(training, "the end of training for val data")
        except MicrobatchOutOfMemory as err:   # one line, recorded beside the checkpoints (out_of_memory.py)
            watch.stop_on_out_of_memory(err, save_dir=args.save, prefix="error: ")
        except torch.OutOfMemoryError as err:   # engine.step(), an evaluation: named as such, recorded, one line
            event = outside_microbatch(err, iteration=iteration + 1, rank=rank,
                                       phase=EVALUATION if where.startswith("evaluating") else None)
            watch.stop_on_out_of_memory(err, save_dir=args.save, prefix="error: ", event=event)
        except (FloatingPointError, RuntimeError) as err:  # non-finite loss, lost tokens, a collective timed out
            watch.stop_on_timeout(err, where=where, prefix="error: ")
            print(f"error: rank {rank}, {where}: {err}", file=sys.stderr, flush=True)
            raise SystemExit(1) from err
    if rank == 0:
        print(f"done: {iteration} iterations in {time.perf_counter() - started:.1f} s", flush=True)
    torch.distributed.barrier()
    training.close()


def run(argv=None, *, model_provider, forward_loss, patches) -> int:
    """A DeepSpeed script's `main` (through dcp_megatron.train_deepspeed, which hands it the patch set): 0 when
    trained, 2 (one line on stderr, nothing trained) for a usage error."""
    from dcp_megatron.deepspeed.arguments import parse_args

    try:
        train(parse_args(argv), model_provider=model_provider, forward_loss=forward_loss, patches=patches)
    except DcpUsageError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0
