"""Patches for `megatron.training.training`.

CPU shim (no GPU only): the module's `torch` is a CPU view, since the loop creates tensors with
device='cuda' (start-up timestamps, loss sums, token counts) and calls torch.cuda
synchronize/empty_cache and memory statistics.

DCP: `train()` takes its schedule from `get_forward_backward_func` (imported by name into this
module). Under `--dcp` the schedule it gets is Megatron's own, wrapped in `DcpForwardBackward`
(dcp_megatron/training/schedule.py): each step is planned from its documents' lengths and every
rank runs its own micro-batches through Megatron's schedule. Under `--dcp`, `train()` also runs with a
heartbeat (dcp_megatron/runtime/heartbeat.py): when a collective times out (a stopped or hung rank; every
group honours `--distributed-timeout-minutes`), the run ends with one line naming the iteration and the
rank(s) that stopped answering, instead of the collective library's bare timeout and a traceback; a planned
micro-batch that runs out of memory ends it with one line naming it, recorded beside the checkpoints for the
resumed run to plan under (dcp_megatron/core/out_of_memory.py).
Under `--dcp-profile-out` (set by `dcp-profile`), `train()` profiles the model it was given instead of
training it (dcp_megatron/training/profiler.py), writes the profile and ends the run.
Without `--dcp` nothing changes.
"""
from __future__ import annotations

import functools
import importlib
from datetime import timedelta

from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

_MODULE = "megatron.training.training"

CPU_PATCHES = (cpu_torch_patch(_MODULE, "tensors created with device='cuda' and torch.cuda calls in the loop.",
                               MEGATRON_CORE_VERSIONS),)


def _with_dcp_schedule(original, specs):
    @functools.wraps(original)
    def get_forward_backward_func(*args, **kwargs):
        inner = original(*args, **kwargs)
        from megatron.training import get_args

        run_args = get_args()
        if not getattr(run_args, "dcp", False):
            return inner
        import torch

        from dcp_megatron.training.checks.moe_checks import needs_equal_rows
        from dcp_megatron.core.planning import model_shape_from_args
        from dcp_megatron.training.schedule import DcpForwardBackward

        spec = specs.spec_of(run_args)
        return DcpForwardBackward(
            inner, config=spec.dcp, model_shape=model_shape_from_args(run_args),
            timeout=timedelta(minutes=spec.timeout_minutes),
            is_logging_rank=torch.distributed.get_rank() == 0, has_gpu=torch.cuda.is_available(),
            sequence_parallel=bool(run_args.sequence_parallel), equal_rows_per_wave=needs_equal_rows(run_args))

    get_forward_backward_func.dcp_original = original
    return get_forward_backward_func


def _check_token_ids_against_the_tokenizer(run_args) -> None:
    """A tokenizer other than NullTokenizer is built by Megatron's initialize (its padded vocabulary sizes the
    embedding): the corpus's ids are checked against it here, before step 1, so an id past it is one line naming
    it rather than a bare IndexError in the embedding (NullTokenizer's --vocab-size is checked at start)."""
    padded = getattr(run_args, "padded_vocab_size", None)
    if getattr(run_args, "tokenizer_type", None) == "NullTokenizer" or not padded:
        return
    from dcp_megatron.flags.data_files import check_token_ids

    check_token_ids(run_args, vocab_size=padded,
                    what=f"--tokenizer-type {run_args.tokenizer_type} (ids 0-{padded - 1}, padded)")


def _with_timeout_report(original, specs):
    @functools.wraps(original)
    def train(*args, **kwargs):
        from megatron.training import get_args

        run_args = get_args()
        if not getattr(run_args, "dcp", False):
            return original(*args, **kwargs)
        import torch

        from dcp_megatron.config import DcpUsageError
        from dcp_megatron.core.collective_watch import CollectiveWatch
        from dcp_megatron.core.out_of_memory import MicrobatchOutOfMemory, outside_microbatch
        from dcp_megatron.flags.refusal import exit_refused
        from dcp_megatron.runtime.device_ceiling import emulated_device

        if getattr(run_args, "dcp_profile_out", None):
            _profile_instead(run_args, specs.spec_of(run_args),
                             forward_step_func=args[0] if args else kwargs["forward_step_func"],
                             model=args[1] if len(args) > 1 else kwargs["model"])
        # The loop sets args.curr_iteration to the number of finished steps when each step starts.
        # --dcp-device-memory-gb without a GPU: the loop runs on an emulated device (runtime/device_ceiling.py)
        with CollectiveWatch(rank=torch.distributed.get_rank(), world_size=torch.distributed.get_world_size(),
                             step_of=lambda: getattr(run_args, "curr_iteration", 0) + 1,
                             timeout_minutes=run_args.distributed_timeout_minutes) as watch, \
                emulated_device(specs.spec_of(run_args).dcp.device_memory_gb):
            try:
                _check_token_ids_against_the_tokenizer(run_args)
                return original(*args, **kwargs)
            except SystemExit as err:
                if err.code in (0, None):   # the loop's collective exit (signal, duration, interval), after a barrier
                    _say_signal_exit(run_args, is_logging_rank=watch.rank == 0)
                raise
            except DcpUsageError as err:
                # A check that needs the built tokenizer (the first step's plannability) refuses on every rank
                # alike: one line and exit 2, as at start-up, not a traceback per rank under plain torchrun.
                exit_refused(err)
            except MicrobatchOutOfMemory as err:   # one line, recorded beside the checkpoints (out_of_memory.py)
                watch.stop_on_out_of_memory(err, save_dir=run_args.save, prefix="dcp: error: ")
            except torch.OutOfMemoryError as err:   # the optimizer step, an evaluation: named, recorded, one line
                event = outside_microbatch(err, iteration=getattr(run_args, "curr_iteration", 0) + 1,
                                           rank=watch.rank)
                watch.stop_on_out_of_memory(err, save_dir=run_args.save, prefix="dcp: error: ", event=event)
            except RuntimeError as err:
                watch.stop_on_timeout(err, where=f"iteration {getattr(run_args, 'curr_iteration', 0) + 1}",
                                      prefix="dcp: error: ")
                raise

    train.dcp_original = original
    return train


def _say_signal_exit(run_args, *, is_logging_rank: bool) -> None:
    """--exit-signal-handler: upstream ends with "exiting program after receiving SIGTERM." without the step; one
    line naming the last finished iteration and whether it was saved. Called on every rank as train() ends the
    process with status 0 (a collective decision, after a barrier), so the all-gather of the signal flags pairs up."""
    if not getattr(run_args, "exit_signal_handler", False):
        return
    from megatron.training import get_signal_handler

    if not any(get_signal_handler().signals_received()):
        return
    import signal

    iteration = getattr(run_args, "curr_iteration", 0) + 1   # the loop sets it to the finished steps as a step starts
    saved = f"saved to --save {run_args.save}" if run_args.save else "nothing saved (no --save)"
    if is_logging_rank:
        name = signal.Signals(getattr(run_args, "exit_signal", signal.SIGTERM)).name
        print(f"dcp: {name} received (--exit-signal-handler): stopped after iteration {iteration}; {saved}",
              flush=True)


def _profile_instead(run_args, spec, *, forward_step_func, model) -> None:
    """The profiler's run in place of the training loop; ends the process when the profile is written (run_profile
    returns on every rank after rank 0 wrote it)."""
    from dcp_megatron.core.planning import model_shape_from_args
    from dcp_megatron.training.profiler import run_profile

    run_profile(forward_step_func, model if isinstance(model, list) else [model],
                profile=spec.profile, dcp=spec.dcp,
                shape=model_shape_from_args(run_args), sequence_parallel=bool(run_args.sequence_parallel),
                timeout=timedelta(minutes=spec.timeout_minutes))
    raise SystemExit(0)


def dcp_patches(specs) -> tuple[Patch, ...]:
    """`specs`: the patch set's RunSpecSlot, which the patched validate_args fills (training_arguments.py)."""
    module = importlib.import_module(_MODULE)
    original = getattr(module.get_forward_backward_func, "dcp_original", module.get_forward_backward_func)
    original_train = getattr(module.train, "dcp_original", module.train)
    return (
        Patch(target=f"{_MODULE}:train", replacement=_with_timeout_report(original_train, specs),
              reason="under --dcp, a collective timeout ends the run with one line naming the iteration and the "
                     "rank that stopped answering (a heartbeat in the rendezvous store).",
              versions=MEGATRON_CORE_VERSIONS, rebind_aliases=False),
        Patch(target=f"{_MODULE}:get_forward_backward_func", replacement=_with_dcp_schedule(original, specs),
              reason="under --dcp, train() runs each step's planned micro-batches (a count per rank) through "
                     "Megatron's own schedule.",
              versions=MEGATRON_CORE_VERSIONS, rebind_aliases=False),
    )
