"""Patches for `megatron.core.dist_checkpointing.strategies.filesystem_async`.

CPU shim (no GPU only): its `torch` is a CPU view. the torch_dist checkpoint writer stages tensors through
torch.cuda streams and pinned memory.

Every run: when the writer of a rank's last bucket (the one it runs on its own thread) fails with an OSError,
upstream returns the exception to `write_preloaded_data_multithread`, whose type assertion keeps only its class
("error: <class 'OSError'>"): the errno and the file are lost, and a full disk reads as a bare worker failure.
Raised instead (with the file it was writing), the same caller passes its text on ("[Errno 28] No space left on
device: '.../__0_0.distcp'"), so the failed save can say what failed and where
(dcp_megatron/training/save_failure.py). Workers on other threads are unchanged (they report through queues).

Every run: the writers' results queue (`get_write_results_queue`) lives in a `multiprocessing` manager process,
spawned at a rank's first save (it re-imports the training script: ~950 MB resident on the tiny CPU model). A
rank ended by a signal (SIGTERM to rank 0 mid-save) runs no exit handler, so upstream's manager was orphaned:
measured alive over 60 s after the job ended, holding the job's stdout open (issue 46 saw it print a
BrokenPipeError ~10 s after the end). The manager is started here with an initializer that asks Linux to end it
when the process that started it ends (dcp_megatron/runtime/parent_death.py); the queue is the same.
"""
import functools
import importlib
import multiprocessing
import os
from multiprocessing.managers import SyncManager

from dcp_megatron.runtime.parent_death import die_with_parent
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


def _manager_dying_with_its_rank(original):
    module = importlib.import_module(_MODULE)

    @functools.wraps(original)
    def get_write_results_queue(mp_mode: str = "spawn"):
        if module._results_queue is None:
            manager = SyncManager(ctx=multiprocessing.get_context(mp_mode))
            manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
            module._results_queue = manager.Queue()   # (the proxy keeps its manager)
        return module._results_queue

    get_write_results_queue.dcp_original = original
    return get_write_results_queue


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
        Patch(target=f"{_MODULE}:get_write_results_queue",
              replacement=_manager_dying_with_its_rank(unwrapped_queue()),
              reason="the writers' results-queue manager process ends with the rank that started it (a rank killed "
                     "mid-save left it orphaned, ~950 MB, holding the job's output open).",
              versions=MEGATRON_CORE_VERSIONS),
    )


def unwrapped_queue():
    function = importlib.import_module(_MODULE).get_write_results_queue
    return getattr(function, "dcp_original", function)
