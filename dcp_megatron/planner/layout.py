"""What both policy families (baselines/, dcp/) build plans from: input checks, allowed group sizes, micro-batch
estimates, waves from scheduled groups, and the finished StepPlan."""
from __future__ import annotations

import itertools
from typing import Iterable, Sequence

import numpy as np

from dcp_megatron.planner.costmodel import ClusterSpec
from dcp_megatron.planner.cp_flavour import choose_cp_attention
from dcp_megatron.planner.plan import NO_RECOMPUTE, Group, MicroBatch, Recompute, StepPlan, Wave
from dcp_megatron.planner.timeline import plan_makespan


def check_batch(batch: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(sample ids, lengths) as int64 arrays; ValueError on an empty batch, a non-positive
    length or a repeated sample id."""
    if len(batch) == 0:
        raise ValueError("the batch is empty: a plan needs at least one sequence")
    try:
        if set(map(len, batch)) != {2}:
            raise ValueError("an entry is not a pair")
        exact = np.fromiter(itertools.chain.from_iterable(batch), dtype=np.float64, count=2 * len(batch))
    except (TypeError, ValueError, OverflowError) as err:
        raise ValueError(f"a batch is a list of (sample_id, length) integer pairs ({err})") from err
    arr = exact.astype(np.int64)
    if not np.array_equal(arr, exact):
        j = int(np.flatnonzero(arr != exact)[0]) // 2
        raise ValueError(f"batch entry {j} {tuple(batch[j])!r} is not a pair of integers")
    ids, lengths = arr[0::2], arr[1::2]
    bad = np.flatnonzero(lengths <= 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"sample {int(ids[i])} has length {int(lengths[i])}; lengths must be positive")
    if ids.size > 1 and not (ids[1:] > ids[:-1]).all() and (np.diff(np.sort(ids)) == 0).any():
        uniq, counts = np.unique(ids, return_counts=True)
        raise ValueError(f"sample id {int(uniq[counts > 1][0])} appears more than once in the batch")
    return ids, lengths


def pow2_sizes(limit: int) -> list[int]:
    sizes, c = [], 1
    while c <= limit:
        sizes.append(c)
        c *= 2
    return sizes


def candidate_sizes(cluster: ClusterSpec) -> list[int]:
    """Group sizes the dcp policy uses: powers of two up to the limit, and the limit itself
    when it is not one (a non-power-of-two domain such as 3, 6, 12 can then use all ranks)."""
    limit = cluster.cp_size_limit
    sizes = pow2_sizes(limit)
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


def divisor_sizes(cluster: ClusterSpec) -> list[int]:
    """Group sizes that tile the domain evenly (uniform waves), up to the CP size limit."""
    D, limit = cluster.domain_size, cluster.cp_size_limit
    return [c for c in range(1, limit + 1) if D % c == 0]


def check_static_memory(cost) -> None:
    if cost.static_bytes >= cost.cluster.mem_budget_bytes:
        raise ValueError(f"the model's static state alone ({cost.static_bytes / 2**30:.4g} GiB per rank: weights, "
                         f"grads, optimizer state) exceeds the memory budget of {cost.cluster.budget_words()}; "
                         f"raise the budget (--dcp-memory-budget-gb), shard the optimizer state over more ranks "
                         f"(--use-distributed-optimizer, more data-parallel ranks), or split the model "
                         f"(--tensor-model-parallel-size, --pipeline-model-parallel-size)")


def min_fitting_size(lengths: np.ndarray, ids: np.ndarray, sizes: list[int], cost) -> np.ndarray:
    """Index into `sizes` (ascending) of the smallest size at which each sequence alone fits
    (with the strongest allowed recompute); ValueError naming a sequence that fits none."""
    check_static_memory(cost)
    options = cost.recompute_options()     # the one holding the most may differ by size (CPU count, relief_choice.py)
    caps = np.array([max(cost.max_local_tokens(r, s) for r in options) for s in sizes], dtype=np.int64)
    # padding.local_tokens(L, s) = 2·ceil(L / 2s) <= cap  <=>  L <= 2s·(cap // 2): one threshold per size
    thresholds = np.asarray(sizes, dtype=np.int64) * (2 * (caps // 2))
    fits = np.asarray(lengths)[:, None] <= thresholds[None, :]
    idx = np.where(fits.any(axis=1), fits.argmax(axis=1), len(sizes))
    bad = np.flatnonzero(idx == len(sizes))
    if bad.size:
        j = int(bad[np.argmax(lengths[bad])])
        raise ValueError(f"sample {int(ids[j])} of {int(lengths[j])} tokens fits no CP group up to size "
                         f"{sizes[-1]} with the allowed recompute {list(cost.allowed_recompute)} (at most "
                         f"{cost.strongest_recompute}; memory budget {cost.cluster.mem_budget_bytes / 2**30:.4g} GiB "
                         f"per rank); allow more recompute (e.g. full), a larger max CP size, more memory per rank, "
                         f"or shorten it (GlobalBatcher overlong='split' or 'truncate')")
    return idx


def microbatch_from_sums(cost, sequences: tuple, local: float, compute: float, attn: float, size: int,
                         first_rank: int, recompute: Recompute | None = None) -> MicroBatch:
    """A MicroBatch with its time and memory estimated from its documents' summed terms
    (`CostModel.doc_terms`); recompute None: the fastest allowed that fits."""
    if recompute is None:
        recompute = cost.choose_recompute(local, compute, attn, size)
        if recompute is None:     # no layout packs one (min_fitting_size): reached only through a planner bug
            raise ValueError(f"a micro-batch of documents {[length for _, length in sequences]} ({local:g} local "
                             f"tokens per rank on a CP group of {size}) fits no allowed recompute "
                             f"({'/'.join(cost.allowed_recompute)}) within {cost.cluster.budget_words()}: raise "
                             f"--dcp-memory-budget-gb or allow full recompute (--dcp-recompute), and report it")
    return MicroBatch(sequences, recompute,
                      float(cost.time_from_sums(local, compute, attn, size, first_rank, recompute)),
                      int(cost.memory_from_tokens(local, recompute, size)))


def microbatches_from_sums(cost, chunks: list, size: int) -> list[MicroBatch]:
    """`microbatch_from_sums` of each (first rank, sequences, local, compute, attention sums) chunk on a CP group of
    `size`, in order; those its relief choice takes without relief (none fits) estimated in one `times_from_sums`
    call (the same floats)."""
    if not chunks:
        return []
    sums = np.array([c[2:] for c in chunks], dtype=np.float64)
    quick = np.zeros(len(chunks), dtype=bool)
    if cost.base_recompute is NO_RECOMPUTE and not cost.time_scale:     # `CostModel.choose_recompute`'s shortcut
        quick = sums[:, 0] <= cost.max_local_tokens(NO_RECOMPUTE, size)
    firsts = np.array([c[0] for c in chunks], dtype=np.int64)
    times = cost.times_from_sums(sums[:, 0], sums[:, 1], sums[:, 2], size, firsts, NO_RECOMPUTE).tolist()
    mems = (cost.static_bytes + np.ceil(sums[:, 0] * cost.bytes_per_local_token(NO_RECOMPUTE, size))).astype(
        np.int64).tolist()
    out = [MicroBatch(seqs, NO_RECOMPUTE, times[n], mems[n]) if fast else None
           for n, ((_, seqs, _, _, _), fast) in enumerate(zip(chunks, quick.tolist()))]
    slow = np.flatnonzero(~quick)
    if slow.size:           # the others' relief choice at once (`best_reliefs_from_sums`: the same choices, floats)
        reliefs, slow_times = cost.best_reliefs_from_sums(sums[slow, 0], sums[slow, 1], sums[slow, 2], size,
                                                          firsts[slow])
        for n, recompute, t in zip(slow.tolist(), reliefs, slow_times.tolist()):
            first, seqs, loc, comp, att = chunks[n]
            out[n] = (microbatch_from_sums(cost, seqs, loc, comp, att, size, first) if recompute is None else
                      MicroBatch(seqs, recompute, t, int(cost.memory_from_tokens(loc, recompute, size))))
    return out


def assemble_waves(domain_size: int, scheduled: Iterable[Group]) -> tuple[Wave, ...]:
    """Waves from groups given in execution order: each group goes to the first wave after
    every wave its members already use, so a rank's groups keep their order; ranks a wave
    does not use get an empty singleton group there (they run nothing in it)."""
    next_wave = [0] * domain_size
    slots: list[list] = []                 # per wave: the group starting at each rank, or None
    for g in scheduled:
        lo = g.first_rank
        if g.size == 1:
            w = next_wave[lo]
            next_wave[lo] = w + 1
        else:
            hi = lo + g.size
            w = max(next_wave[lo:hi])
            next_wave[lo:hi] = [w + 1] * g.size
        while len(slots) <= w:
            slots.append([None] * domain_size)
        slots[w][lo] = g
    if not slots:
        slots.append([None] * domain_size)
    empty: dict[int, Group] = {}
    out = []
    for starts in slots:
        filled, r = [], 0
        while r < domain_size:
            g = starts[r]
            if g is None:
                g = empty.get(r) or empty.setdefault(r, Group(r, 1, ()))
            filled.append(g)
            r += g.size
        out.append(Wave(tuple(filled)))
    return tuple(out)


def finish_plan(policy: str, waves, cost, bound: float, extra: dict | None = None) -> StepPlan:
    """The StepPlan of a policy's waves: each CP micro-batch labelled with the attention flavour its estimate was
    scored with (cp_flavour.py), the step estimate from the per-rank timeline, the batch's lower bound."""
    waves = choose_cp_attention(waves, cost)
    plan = StepPlan(domain_size=cost.cluster.domain_size, waves=waves, lower_bound_s=bound, policy=policy,
                    extra=extra or {})
    return StepPlan(domain_size=plan.domain_size, waves=waves, est_step_time_s=plan_makespan(plan),
                    lower_bound_s=bound, policy=policy, extra=extra or {})
