"""The torch_dist writers' results-queue manager ends with the rank that started it (issue 46: a rank killed
mid-save left it orphaned, ~950 MB, holding the job's output open; patches/core_dist_checkpointing_filesystem_async.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest


_SCRIPT = """
import os, signal, sys

if __name__ == "__main__":
    import types

    sys.path.insert(0, {repo!r})
    # megatron-core's module as the patch sees it (its global queue unset), without importing megatron-core
    upstream = types.ModuleType({module!r})
    upstream._results_queue = None
    upstream.get_write_results_queue = lambda mp_mode="spawn": None
    sys.modules[{module!r}] = upstream
    from patches.core_dist_checkpointing_filesystem_async import _manager_dying_with_its_rank

    queue = _manager_dying_with_its_rank(upstream.get_write_results_queue)()
    queue.put(1)
    assert queue.get() == 1
    print(queue._manager._process.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)   # as a rank ended by a signal: no exit handler runs
"""


def test_the_results_queue_manager_dies_with_its_rank(tmp_path):
    from patches.core_dist_checkpointing_filesystem_async import _MODULE

    script = tmp_path / "rank.py"
    script.write_text(_SCRIPT.format(repo=os.getcwd(), module=_MODULE))
    out = tmp_path / "rank.out"
    with open(out, "w") as f:   # (a file, not a pipe: an orphaned manager would hold a pipe open)
        subprocess.run([sys.executable, "-W", "ignore", str(script)], stdout=f, stderr=subprocess.DEVNULL, timeout=120)
    manager_pid = int(out.read_text().split()[0])
    deadline = time.monotonic() + 20
    while os.path.exists(f"/proc/{manager_pid}") and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = os.path.exists(f"/proc/{manager_pid}")
    if alive:
        os.kill(manager_pid, 9)
    assert not alive, "the manager outlived the rank that started it"
