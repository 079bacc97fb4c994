"""A baseline's step time on one batch under a run-wide setting, for the sweep (baselines/sweep.py).

`SettingScorer(policy, batches, cost, max_seq_len)(j, setting)` is the float `make_plan(policy, batches[j], cost,
max_seq_len=..., setting=setting).est_step_time_s` gives (tests/unit/test_sweep_scoring.py checks every grid
point), without building what the step time does not need. A sweep tries each layout knob under several
run-wide reliefs, and the relief changes the micro-batches' times, not the layout, so the layout is made once
per batch and knob:
- `megatron-dynamic`: the schedule and its groups' summed terms per (token cap, smallest CP size);
- `megatron-hybrid`: the buckets and where they run per token cap;
- `static`, `static-balanced`: the micro-batches per CP size (their capacity is the run's cap at that size).
Each setting is then timed (`times_from_sums`, one micro-batch per group) and the makespan taken on arrays
(`timeline.one_microbatch_makespan`). In lockstep (PP > 1 fillers, EP, ZeRO-3) the dynamic schedulers' idle
ranks run fillers, so there the plan's waves are built as before (the layout still cached). Errors are the
planner's own (ValueError: the setting cannot run the batch), raised again for each setting they concern.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np

from dcp_megatron.planner.plan import StepPlan
from dcp_megatron.planner.timeline import one_microbatch_makespan, plan_makespan


KEPT_KNOBS = 4      # layout knobs whose layouts stay cached (each holds one layout per batch)


class SettingScorer:
    """`scorer(j, setting)`: batch j's modelled step time under `setting` (ValueError: it cannot run)."""

    def __init__(self, policy: str, batches: Sequence[Sequence[tuple[int, int]]], cost, *, max_seq_len: int) -> None:
        from dcp_megatron.planner.layout import check_batch

        self.policy, self.cost, self.max_seq_len = policy, cost, int(max_seq_len)
        self.batches = batches
        self.arrays = [check_batch(b) for b in batches]
        # layout knob -> {batch: layout, or the ValueError making it raised}; the grid tries a knob's reliefs one
        # after another, so only the last few knobs are kept (a knob asked for again is made again: the same layout)
        self.layouts: OrderedDict = OrderedDict()
        self.checked: dict = {}          # batch -> None, or make_plan's ValueError for the batch itself

    def __call__(self, j: int, setting) -> float:
        if self.policy == "megatron-dynamic":
            return self._dynamic(j, setting)
        self._check_batch(j)
        if self.policy == "megatron-hybrid":
            return self._hybrid(j, setting)
        return self._static(j, setting)

    def _layout(self, j: int, knob, make):
        per_batch = self.layouts.setdefault(knob, {})
        self.layouts.move_to_end(knob)
        while len(self.layouts) > KEPT_KNOBS:
            self.layouts.popitem(last=False)
        if j not in per_batch:
            try:
                per_batch[j] = make()
            except ValueError as err:
                per_batch[j] = err
        found = per_batch[j]
        if isinstance(found, ValueError):
            raise found
        return found

    def _check_batch(self, j: int) -> None:
        """make_plan's checks of the batch itself (its longest against the run's cap, a sequence no layout holds)."""
        from dcp_megatron.planner.layout import candidate_sizes, min_fitting_size

        if j not in self.checked:
            ids, lengths = self.arrays[j]
            self.checked[j] = None
            if int(lengths.max()) > self.max_seq_len:
                k = int(lengths.argmax())
                self.checked[j] = ValueError(f"sample {int(ids[k])} has {int(lengths[k])} tokens, over the run's "
                                             f"max_seq_len {self.max_seq_len}")
            else:
                try:
                    min_fitting_size(lengths, ids, candidate_sizes(self.cost.cluster), self.cost)
                except ValueError as err:
                    self.checked[j] = err
        if self.checked[j] is not None:
            raise self.checked[j]

    def _makespan(self, layout_sums, recompute) -> float:
        local, compute, attn, size, first, wave = layout_sums
        times = self.cost.times_from_sums(local, compute, attn, size, first, recompute)
        return one_microbatch_makespan(wave, first, size, times, self.cost.cluster.domain_size)

    def _dynamic(self, j: int, setting) -> float:
        from dcp_megatron.planner.baselines.megatron_dynamic import dynamic_schedule, schedule_sums, waves_of_schedule
        from dcp_megatron.planner.baselines.settings import check_recompute_fits
        from dcp_megatron.planner.cp_flavour import choose_cp_attention

        cost = self.cost
        # the memory check of every setting, also when its cap's schedule is already known
        check_recompute_fits(cost, setting.token_cap, setting.recompute, f"megatron-dynamic ({setting})")
        ids, lengths = self.arrays[j]

        def make():
            schedule = dynamic_schedule(lengths, cost, setting)
            return schedule, schedule_sums(schedule, lengths, cost)

        schedule, sums = self._layout(j, (setting.token_cap, setting.min_cp_size), make)
        if not cost.model.lockstep:       # `waves_of_schedule` times its groups with `times_from_sums` too
            return self._makespan(sums, setting.recompute)
        waves = waves_of_schedule(schedule, ids, lengths, cost, setting.recompute, sums)
        return plan_makespan(StepPlan(domain_size=cost.cluster.domain_size, waves=choose_cp_attention(waves, cost)))

    def _hybrid(self, j: int, setting) -> float:
        from dcp_megatron.planner.baselines.hybrid import check_bucket_memory, hybrid_layout
        from dcp_megatron.planner.baselines.settings import check_recompute_fits
        from dcp_megatron.planner.policies import make_plan

        cost = self.cost
        if cost.model.lockstep:
            return make_plan(self.policy, self.batches[j], cost, max_seq_len=self.max_seq_len,
                             setting=setting).est_step_time_s
        check_recompute_fits(cost, setting.token_cap, setting.recompute, f"megatron-hybrid ({setting})")
        layout = self._layout(j, setting.token_cap, lambda: hybrid_layout(self.arrays[j][1], cost, setting))
        check_bucket_memory(cost, layout, setting)
        size, first, wave = (np.asarray(x, dtype=np.int64) for x in (layout.size_of, layout.first_of, layout.wave_of))
        recompute, sums = setting.recompute, layout.sums
        times = cost.times_from_sums(sums[0], sums[1], sums[2], size, first, recompute)
        if recompute.offload:
            # the plan times each bucket with `time_from_sums`, which adds an offload's host-link contention
            # across nodes in another order (an ulp apart): those buckets one at a time, as the plan does
            per_node = cost.cluster.gpus_per_node
            for b in np.flatnonzero(first // per_node != (first + size - 1) // per_node).tolist():
                times[b] = cost.time_from_sums(float(sums[0][b]), float(sums[1][b]), float(sums[2][b]),
                                               int(size[b]), int(first[b]), recompute)
        return one_microbatch_makespan(wave, first, size, times, cost.cluster.domain_size)

    def _static(self, j: int, setting) -> float:
        from dcp_megatron.planner.baselines import BASELINES
        from dcp_megatron.planner.baselines.static import static_packing, static_layout

        cost = self.cost
        ids, lengths = self.arrays[j]
        layout = static_layout(cost, self.max_seq_len, setting)      # ValueError: the setting cannot run
        _, items = self._layout(j, setting.cp_size, lambda: static_packing(ids, lengths, cost, self.max_seq_len,
                                                                             setting))
        waves = BASELINES[self.policy](ids, lengths, cost, max_seq_len=self.max_seq_len, setting=setting,
                                       packing=(layout, items))
        return plan_makespan(StepPlan(domain_size=cost.cluster.domain_size, waves=waves))
