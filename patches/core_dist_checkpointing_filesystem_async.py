"""Patches for `megatron.core.dist_checkpointing.strategies.filesystem_async`.

CPU shim (no GPU only): its `torch` is a CPU view. the torch_dist checkpoint writer stages tensors through
torch.cuda streams and pinned memory.

Every run: when the writer of a rank's last bucket (the one it runs on its own thread) fails with an OSError,
upstream returns the exception to `write_preloaded_data_multithread`, whose type assertion keeps only its class
("error: <class 'OSError'>"): the errno and the file are lost, and a full disk reads as a bare worker failure.
Raised instead (with the file it was writing), the same caller passes its text on ("[Errno 28] No space left on
device: '.../__0_0.distcp'"), so the failed save can say what failed and where
(dcp_megatron/training/save_failure.py). Workers on other threads are unchanged (they report through queues).
"""
import functools
import importlib
import os

from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

_REASON = ('the torch_dist checkpoint writer stages tensors through torch.cuda streams and pinned memory.')
_MODULE = "megatron.core.dist_checkpointing.strategies.filesystem_async"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)


def _raising_os_errors(original):
    @functools.wraps(original)
    def write_preloaded_data(transform_list, local_proc_idx, write_bucket, results_queue, count_queue, use_fsync,
                             **kwargs):
        output = original(transform_list, local_proc_idx, write_bucket, results_queue, count_queue, use_fsync,
                          **kwargs)
        if results_queue is None and output is not None and isinstance(output[1], OSError):
            err = output[1]
            path = err.filename or write_bucket[0]
            raise OSError(err.errno, err.strerror or str(err), os.fspath(path)) from err
        return output

    write_preloaded_data.dcp_original = original
    return write_preloaded_data


def dcp_patches() -> tuple[Patch, ...]:
    writer = importlib.import_module(_MODULE).FileSystemWriterAsync
    original = vars(writer)["write_preloaded_data"].__func__
    original = getattr(original, "dcp_original", original)
    return (
        Patch(target=f"{_MODULE}:FileSystemWriterAsync.write_preloaded_data",
              replacement=staticmethod(_raising_os_errors(original)),
              reason="a rank's own writer thread's OSError (a full disk) is raised with its file, not reduced to its "
                     "class name, so the failed save names the cause and the path.",
              versions=MEGATRON_CORE_VERSIONS),
    )
