"""A full disk during a save: the run's last line says so (the cause, the file), and no partial iteration is left.

The full disk is injected: the torch_dist writer's per-item write (`_write_item`, below our writer patch) raises
OSError(ENOSPC) as `write()` does on a full file system, after writing a few bytes, for the files of iteration 2
(a real small file system needs a mount this machine's tests may not make). One real launch, 2 ranks, plain
torchrun of our script with the injection prepended: iteration 1 saves, iteration 2's save fails.
"""
from __future__ import annotations

import errno
import os

import pytest

from dcp_megatron.training.save_failure import os_error_in
from dcp_megatron.runtime import checkpoint_manifest as manifest_io
from tests.support.megatron_runs import OUR_SCRIPT, run_training
from tests.integration.test_fault_matrix import MEGATRON_DCP

pytestmark = pytest.mark.timeout(900)

_FULL_DISK = '''
import errno as _errno
import functools as _functools
import os as _os

import megatron.core.dist_checkpointing.strategies.filesystem_async as _writer

_real_write_item = _writer._write_item


@_functools.wraps(_real_write_item)   # its signature: the writer passes arguments by what it sees
def _write_item(*args, **kwargs):  # the disk fills up while iteration 2 is written
    stream = next(a for a in args if hasattr(a, "write") and hasattr(a, "name"))
    if "iter_0000002" in str(stream.name):
        stream.write(b"partial")
        raise OSError(_errno.ENOSPC, _os.strerror(_errno.ENOSPC))
    return _real_write_item(*args, **kwargs)


_writer._write_item = _write_item
'''


def test_the_cause_of_a_failed_save_is_found_in_every_form_megatron_passes_it_on():
    from torch.distributed.checkpoint.api import CheckpointException

    full = OSError(errno.ENOSPC, "No space left on device", "/ckpt/iter_0000002/__0_0.distcp")
    assert os_error_in(full) == (errno.ENOSPC, "No space left on device", "/ckpt/iter_0000002/__0_0.distcp")
    try:
        raise RuntimeError("Worker failure") from full
    except RuntimeError as wrapped:
        assert os_error_in(wrapped)[0] == errno.ENOSPC
    # Rank 0's CheckpointException: each rank's failure, as the writer threads passed it on (text only).
    text = RuntimeError(f"Worker failure: An error is caught while starting worker 0, error: {full}")
    found = os_error_in(CheckpointException("write", {1: (text, None)}))
    assert found == (errno.ENOSPC, "No space left on device", "/ckpt/iter_0000002/__0_0.distcp")
    assert os_error_in(RuntimeError("Incomplete worker results")) is None


def test_a_full_disk_during_a_save_ends_the_run_saying_so_and_leaves_no_partial_checkpoint(tmp_path):
    script = tmp_path / "pretrain_gpt_full_disk.py"
    text = open(OUR_SCRIPT).read()
    head = "dcp_megatron.enable()\n"
    assert head in text
    script.write_text(text.replace(head, head + _FULL_DISK, 1))
    save = tmp_path / "ckpt"
    run = run_training(str(script), [*MEGATRON_DCP, "--save", str(save), "--save-interval", "1"], iters=3,
                       launcher=False, timeout_s=600)
    assert run.returncode != 0 and sorted(run.losses) == [1, 2], run.output[-4000:]
    ours = [line for line in run.output.splitlines() if line.startswith("dcp: error: ")]
    assert len(ours) == 1, run.output[-4000:]   # rank 0 says it once for every rank
    line = ours[0]
    assert "iteration 2: saving the checkpoint to --save" in line and "No space left on device" in line, line
    assert f"writing {save}/iter_0000002/__" in line and ".distcp" in line, line
    assert f"removed the partial {save}/iter_0000002" in line and "the latest checkpoint stays iteration 1" in line
    # The workers end on that line: no worker traceback (torchrun's own summary of the failed worker follows).
    assert run.output.count("Traceback") == run.output.count("raise ChildFailedError("), run.output[-4000:]
    assert not (save / "iter_0000002").exists(), "a partial iteration directory stayed"
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    manifest = manifest_io.read_manifest(str(save / "iter_0000001"))
    manifest_io.verify(str(save / "iter_0000001"), manifest, rank=0, world_size=1)


def test_a_full_disk_during_a_deepspeed_save_says_so_and_removes_the_partial_tag(tmp_path):
    """DeepSpeed's engine raises the OSError itself: the script's loop prints SaveFailed's message as one line."""
    from dcp_megatron.deepspeed import checkpoint

    class FullDiskEngine:   # writes part of a tag's files, then the disk is full
        def save_checkpoint(self, directory, *, tag, save_latest, client_state):
            os.makedirs(os.path.join(directory, tag))
            path = os.path.join(directory, tag, "mp_rank_00_model_states.pt")
            with open(path, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    save = tmp_path / "ckpt"
    (save / "iter_0000001").mkdir(parents=True)
    (save / "latest").write_text("iter_0000001")
    with pytest.raises(checkpoint.SaveFailed) as failed:
        checkpoint.save(FullDiskEngine(), str(save), iteration=2, data_state={}, ds_config={})
    message = str(failed.value)
    assert "No space left on device (errno 28) writing" in message and "iter_0000002/mp_rank_00" in message
    assert "the latest checkpoint stays iter_0000001" in message and "\n" not in message
    assert isinstance(failed.value, RuntimeError), "the script's loop reports RuntimeErrors in one line"
    assert not (save / "iter_0000002").exists() and (save / "latest").read_text() == "iter_0000001"
