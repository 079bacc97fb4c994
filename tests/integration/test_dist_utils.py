"""The spawn helper reports a failing rank's traceback, and the ranks it left waiting, instead of hanging."""
import pytest
import torch.distributed as dist

from tests.support.dist_utils import run_distributed


def _one_rank_raises(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # rank 0 waits for a peer that is gone: must fail on the group timeout, not hang
    return rank


def test_failure_of_one_rank_reaches_pytest_with_every_traceback():
    with pytest.raises(RuntimeError) as info:  # a hang would end in TimeoutError instead
        run_distributed(_one_rank_raises, 2, timeout_s=120, group_timeout_s=3)
    message = str(info.value)
    assert "2 of 2 ranks failed" in message
    assert "--- rank 1 ---" in message and "ValueError: boom from rank one" in message
    assert "--- rank 0 ---" in message
