"""A plan as compact bytes: what split planning gathers from the ranks that planned each part (core/split_planning.py).

The JSON form (plan.py) is for people and tools; at 16,384 ranks a part's JSON costs ~40 ms to write and ~50 ms to
read back per 1,024 ranks, for every part on every rank. Here a plan is a short JSON header (the plan's scalars,
`extra`, and the table of reliefs and attention flavours its micro-batches name) and four int64 / float64 arrays:
groups (wave, first rank, size, micro-batch count), micro-batches (sequence count, relief index, flavour index,
estimated bytes), their estimated seconds, and the sequences (sample id, length), all in plan order.
`plan_from_bytes(plan_to_bytes(p)) == p` for every plan; the bytes are deterministic (same plan, same bytes).
"""
from __future__ import annotations

import json

import numpy as np

from dcp_megatron.planner.plan import Group, MicroBatch, Recompute, StepPlan, Wave

_MAGIC = b"DCPPLAN1"


def plan_to_bytes(plan: StepPlan) -> bytes:
    reliefs: dict[Recompute, int] = {}
    flavours: dict[str, int] = {}
    groups, mbs, times, seqs = [], [], [], []
    for w, wave in enumerate(plan.waves):
        for g in wave.groups:
            groups.append((w, g.first_rank, g.size, len(g.microbatches)))
            for mb in g.microbatches:
                mbs.append((len(mb.sequences), reliefs.setdefault(mb.recompute, len(reliefs)),
                            flavours.setdefault(mb.attention, len(flavours)), mb.est_mem_bytes))
                times.append(mb.est_time_s)
                seqs.extend(mb.sequences)
    header = json.dumps({
        "domain_size": plan.domain_size, "num_waves": len(plan.waves), "est_step_time_s": plan.est_step_time_s,
        "lower_bound_s": plan.lower_bound_s, "policy": plan.policy, "extra": plan.extra,
        "reliefs": [r.to_json() for r in reliefs], "flavours": list(flavours),
        "counts": [len(groups), len(mbs), len(seqs)]}, sort_keys=True, separators=(",", ":")).encode()
    arrays = (np.asarray(groups, dtype=np.int64).reshape(-1, 4), np.asarray(mbs, dtype=np.int64).reshape(-1, 4),
              np.asarray(times, dtype=np.float64), np.asarray(seqs, dtype=np.int64).reshape(-1, 2))
    return b"".join([_MAGIC, len(header).to_bytes(8, "little"), header] + [a.tobytes() for a in arrays])


def plan_from_bytes(data: bytes) -> StepPlan:
    """The plan `plan_to_bytes` wrote; ValueError for bytes it did not write (e.g. slices of different plans)."""
    try:
        return _decode(data)
    except (ValueError, KeyError, IndexError, TypeError) as err:   # (json's and unicode's errors are ValueErrors)
        if str(err).startswith("a plan's bytes"):
            raise
        raise ValueError(f"a plan's bytes: unreadable ({type(err).__name__}: {err})") from None


def _decode(data: bytes) -> StepPlan:
    if data[:8] != _MAGIC:
        raise ValueError("not a plan's bytes (plan_bytes.plan_to_bytes writes them)")
    size = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16:16 + size])
    num_groups, num_mbs, num_seqs = header["counts"]
    offset = 16 + size
    arrays = []
    for shape, dtype in (((num_groups, 4), np.int64), ((num_mbs, 4), np.int64), ((num_mbs,), np.float64),
                         ((num_seqs, 2), np.int64)):
        count = int(np.prod(shape))
        arrays.append(np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape))
        offset += count * 8
    if offset != len(data):
        raise ValueError(f"a plan's bytes: {len(data)} bytes where its header names {offset}")
    groups, mbs, times, seqs = (a.tolist() for a in arrays)
    reliefs = [Recompute.from_json(r) for r in header["reliefs"]]
    flavours = header["flavours"]
    pairs = list(map(tuple, seqs))
    waves: list[list[Group]] = [[] for _ in range(header["num_waves"])]
    m = s = 0
    for w, first, group_size, count in groups:
        batch = []
        for num, relief, flavour, mem in mbs[m:m + count]:
            batch.append(MicroBatch(tuple(pairs[s:s + num]), reliefs[relief], times[m + len(batch)], mem,
                                    flavours[flavour]))
            s += num
        m += count
        waves[w].append(Group(first, group_size, tuple(batch)))
    return StepPlan(domain_size=header["domain_size"], waves=tuple(Wave(tuple(g)) for g in waves),
                    est_step_time_s=header["est_step_time_s"], lower_bound_s=header["lower_bound_s"],
                    policy=header["policy"], extra=header["extra"])
