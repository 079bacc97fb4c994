"""A rank's micro-batch dicts on a domain wider than two: the CP group, place in it and recompute each
micro-batch carries follow the plan wave by wave (groups change between waves), an idle rank runs one
masked filler, and the position ids a CP group of any size hands the model stay inside the documents'
own positions (a learned position table) while padding stays out of the loss. No process group needed:
the pool is a stand-in that names blocks."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from dcp_megatron.core.microbatches import MICROBATCH_KEY, build_batch, rank_batches  # noqa: E402
from dcp_megatron.planner.plan import NO_RECOMPUTE, Group, MicroBatch, Recompute, StepPlan, Wave  # noqa: E402


class _NamedBlocks:
    """GroupPool's interface for rank_batches: `domain_rank` and `group(first, size)` -> a name per block."""

    def __init__(self, domain_rank: int) -> None:
        self.domain_rank = domain_rank

    def group(self, first_rank: int, size: int):
        return None if size == 1 else f"block[{first_rank},{first_rank + size})"


def _mb(*sequences, recompute=NO_RECOMPUTE):
    return MicroBatch(tuple(sequences), recompute)


def _domain_of_four_plan() -> StepPlan:
    """Wave 0: two CP-2 groups side by side; wave 1: CP-3 on ranks 0-2, rank 3 alone with two micro-batches;
    wave 2: one CP-4 group. Rank 4 of a 5-rank domain idles in every wave."""
    wave0 = Wave((Group(0, 2, (_mb((0, 9), recompute=Recompute("full", 1)),)),
                  Group(2, 2, (_mb((1, 7)), _mb((2, 4), recompute=Recompute("selective")))),
                  Group(4, 1, ())))
    wave1 = Wave((Group(0, 3, (_mb((3, 11)),)), Group(3, 1, (_mb((4, 2)), _mb((5, 3)))), Group(4, 1, ())))
    wave2 = Wave((Group(0, 4, (_mb((6, 16), (7, 5), recompute=Recompute("full", 2)),)), Group(4, 1, ())))
    return StepPlan(domain_size=5, waves=(wave0, wave1, wave2), policy="test")


def _documents(plan: StepPlan) -> dict[int, torch.Tensor]:
    return {sid: torch.stack([torch.full((n,), 100 + sid), torch.arange(n), torch.ones(n, dtype=torch.int64)], 1)
            for sid, n in plan.sequences()}


@pytest.mark.parametrize("rank", range(5))
def test_each_microbatch_carries_the_group_its_plan_names(rank):
    plan = _domain_of_four_plan()
    batches = rank_batches(plan, _documents(plan), pool=_NamedBlocks(rank), device="cpu")
    expected = [(wave_index, group, mb) for wave_index, group in plan.rank_schedule(rank) for mb in group.microbatches]
    if rank == 4:   # idle in every wave: one masked filler so it still joins the gradient reduction
        (filler,) = batches
        context = filler[MICROBATCH_KEY]
        assert (context.cp_size, context.group, context.recompute) == (1, None, NO_RECOMPUTE)
        assert float(filler["loss_mask"].sum()) == 0 and filler["cu_seqlens"].tolist() == [[0, 1]]
        return
    assert len(batches) == len(expected)
    for batch, (wave_index, group, mb) in zip(batches, expected):
        context = batch[MICROBATCH_KEY]
        assert context.wave_index == wave_index
        assert context.cp_size == group.size and context.cp_rank == rank - group.first_rank
        assert context.group == _NamedBlocks(rank).group(group.first_rank, group.size)
        assert context.recompute == mb.recompute
        assert batch["cu_seqlens"][0, -1] == sum(n for _, n in mb.sequences)
        assert set(batch["tokens"][0][batch["loss_mask"][0] > 0].tolist()) == {100 + sid for sid, _ in mb.sequences}


def test_groups_change_between_waves_for_every_rank_of_the_wide_plan():
    plan = _domain_of_four_plan()
    seen = {r: [b[MICROBATCH_KEY].group for b in rank_batches(plan, _documents(plan), pool=_NamedBlocks(r),
                                                                device="cpu")] for r in range(4)}
    assert seen[0] == ["block[0,2)", "block[0,3)", "block[0,4)"]
    assert seen[2] == ["block[2,4)", "block[2,4)", "block[0,3)", "block[0,4)"]
    assert seen[3] == ["block[2,4)", "block[2,4)", None, None, "block[0,4)"]


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4, 5, 6, 7])
def test_position_ids_stay_inside_the_documents_and_padding_stays_out_of_the_loss(cp_size):
    """Documents as long as the position table (1024 = --max-position-embeddings) on a CP group of any size: the
    padding to a multiple of 2c (1026 at c = 3) must not index the table past 1023, nor count in the loss."""
    lengths = [1024, 7, 1]
    docs = [torch.stack([torch.arange(n), torch.arange(n), torch.ones(n, dtype=torch.int64)], 1) for n in lengths]
    seen_positions, real_tokens = [], 0
    for cp_rank in range(cp_size):
        batch = build_batch(docs, cp_size=cp_size, cp_rank=cp_rank, group="G", recompute=NO_RECOMPUTE,
                            wave_index=0, device="cpu")
        positions, mask = batch["position_ids"][0], batch["loss_mask"][0] > 0
        bounds = batch["cu_seqlens_padded"][0] // cp_size
        for doc, length in enumerate(lengths):
            rows = slice(int(bounds[doc]), int(bounds[doc + 1]))
            assert int(positions[rows].max()) <= length - 1, (cp_rank, doc)
            # the real tokens keep their own positions (the token value is its position here)
            assert torch.equal(positions[rows][mask[rows]], batch["tokens"][0][rows][mask[rows]])
        real_tokens += int(mask.sum())
        seen_positions.append(positions[mask])
    assert real_tokens == sum(lengths)          # every real token once, no padding row in the loss
    assert int(torch.cat(seen_positions).max()) == max(lengths) - 1
