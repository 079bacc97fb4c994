"""Patches for `megatron.training.checkpointing`.

CPU shim (no GPU only): its `torch` is a CPU view; checkpoint save/load moves RNG state and reductions
through torch.cuda.

DCP: under `--dcp`, after `save_checkpoint` returns (a persistent, synchronous save) every rank hashes
its share of the iteration directory and rank 0 writes a checksum manifest beside Megatron's files
(dcp_megatron/training/checkpoints.py): torch_dist checkpoints carry no checksums, so a flipped byte
would load silently. Megatron's files, tracker and loading stay as they are. Async and non-persistent
saves are left unrecorded (their files are finished later or elsewhere).

Every run (with or without --dcp): a save that fails (a full disk) ends the run with one line saying what failed
and where, and removes the partial iteration directory (dcp_megatron/training/save_failure.py); upstream ends
with `RuntimeError: Worker failure ...` and leaves the directory.
"""
from __future__ import annotations

import functools
import importlib

from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

_REASON = ('checkpoint save/load moves RNG state and reductions through torch.cuda.')
_MODULE = "megatron.training.checkpointing"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)


def _with_manifest(original):
    @functools.wraps(original)
    def save_checkpoint(iteration, model, *args, **kwargs):
        from megatron.training import get_args

        from dcp_megatron.training.save_failure import failed_save_ends_run

        run_args = get_args()
        if not getattr(run_args, "dcp", False):
            with failed_save_ends_run(run_args, iteration):
                return original(iteration, model, *args, **kwargs)
        from dcp_megatron.training.checkpoints import may_save, record_saved_checkpoint

        if not may_save(run_args, iteration, model):
            return None
        with failed_save_ends_run(run_args, iteration):
            result = original(iteration, model, *args, **kwargs)
            if not run_args.async_save and not kwargs.get("non_persistent_ckpt") and not kwargs.get("release"):
                record_saved_checkpoint(run_args, iteration)
        return result

    save_checkpoint.dcp_original = original
    return save_checkpoint


def dcp_patches() -> tuple[Patch, ...]:
    module = importlib.import_module(_MODULE)
    original = getattr(module.save_checkpoint, "dcp_original", module.save_checkpoint)
    return (
        Patch(target=f"{_MODULE}:save_checkpoint", replacement=_with_manifest(original),
              reason="under --dcp, no save of non-finite weights; a checksum manifest of each saved checkpoint "
                     "(verified before it is loaded); every run: a failed save ends in one line and leaves no "
                     "partial iteration directory.",
              versions=MEGATRON_CORE_VERSIONS),
    )
