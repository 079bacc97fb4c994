"""Run-wide settings of the baselines: what a user sets once for a whole run.

A Megatron run cannot change these per step, so a baseline plans every batch of a run with one
setting. `planner/baselines/sweep.py` picks the setting with the lowest mean step over a run's batches
(a tuned user); the defaults here are what a user gets without that sweep.

- `StaticSetting`: the static layout's CP size and recompute (Megatron's `--context-parallel-size`,
  `--recompute-granularity` / `--recompute-num-layers`); its micro-batch holds one sequence of the run's
  length cap (`--seq-length`), so the recompute must fit that.
- `DynamicSetting`: `megatron-dynamic` (dev's dynamic CP) and `megatron-hybrid`: the per-rank token cap
  (`max_seqlen_per_dp_cp_rank`), the smallest dynamic CP size (`--min-dynamic-context-parallel-size`;
  `megatron-hybrid` has no such knob: 1) and the recompute, paid by every micro-batch, so it must fit the cap.
  The recompute is any relief of the cost model's menu (planner/costmodel/relief.py): none, megatron-core's
  `recompute_modules` sets (mlp, core_attn, ...), activation offloading, full recompute of k layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dcp_megatron.planner.padding import local_tokens
from dcp_megatron.planner.plan import Recompute

SMALLEST_CAP = 256       # token caps 256 x 2^(k/2), rounded to CAP_ROUNDING tokens (token_caps)
CAP_ROUNDING = 256
FULL_LIMIT_CAPS = 4      # memory limits of k_min .. k_min + 3 full layers (k_min: the fewest holding the longest)


@dataclass(frozen=True, kw_only=True)
class StaticSetting:
    POLICIES: ClassVar[tuple[str, ...]] = ("static", "static-balanced")   # the policies that take it
    cp_size: int
    recompute: Recompute

    def __post_init__(self) -> None:
        if not isinstance(self.cp_size, int) or isinstance(self.cp_size, bool) or self.cp_size <= 0:
            raise ValueError(f"StaticSetting.cp_size must be a positive int, got {self.cp_size!r}")
        if not isinstance(self.recompute, Recompute):
            raise ValueError(f"StaticSetting.recompute must be a Recompute, got {self.recompute!r}")

    def __str__(self) -> str:
        return f"cp {self.cp_size}, recompute {self.recompute}"

    def to_json(self) -> dict:
        return {"cp_size": self.cp_size, "recompute": self.recompute.to_json()}


@dataclass(frozen=True, kw_only=True)
class DynamicSetting:
    POLICIES: ClassVar[tuple[str, ...]] = ("megatron-dynamic", "megatron-hybrid")
    token_cap: int               # max_seqlen_per_dp_cp_rank: padded tokens per rank of a micro-batch
    recompute: Recompute         # run-wide: every micro-batch pays it
    min_cp_size: int = 1         # the smallest dynamic CP size

    def __post_init__(self) -> None:
        for name in ("token_cap", "min_cp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DynamicSetting.{name} must be a positive int, got {value!r}")
        if not isinstance(self.recompute, Recompute):
            raise ValueError(f"DynamicSetting.recompute must be a Recompute, got {self.recompute!r}")

    def __str__(self) -> str:
        return f"cap {self.token_cap}, min cp {self.min_cp_size}, recompute {self.recompute}"

    def to_json(self) -> dict:
        return {"token_cap": self.token_cap, "min_cp_size": self.min_cp_size, "recompute": self.recompute.to_json()}


SETTING_KEYS = {StaticSetting: ({"cp_size", "recompute"}, set()),                  # (required, optional)
                DynamicSetting: ({"token_cap", "recompute"}, {"min_cp_size"})}


def setting_from_json(obj: Any, policy: str | None = None) -> StaticSetting | DynamicSetting:
    """A run-wide setting from its JSON object (`to_json`'s form; recompute as plan.py's Recompute JSON). With
    `policy`, the kind that policy takes; without, the kind its keys name. ValueError saying what is wrong."""
    kinds = [k for k in SETTING_KEYS if policy is None or policy in k.POLICIES]
    if not kinds:
        raise ValueError(f"policy {policy!r} takes no run-wide setting; settings are for "
                         + ", ".join(p for k in SETTING_KEYS for p in k.POLICIES))
    if not isinstance(obj, dict):
        raise ValueError(f"a setting is a JSON object, got {obj!r}")

    def form(kind) -> str:
        required, optional = SETTING_KEYS[kind]
        return "{" + ", ".join(sorted(required) + [f"{k} (optional)" for k in sorted(optional)]) + "}"

    for kind in kinds:
        required, optional = SETTING_KEYS[kind]
        if required <= set(obj) <= required | optional:
            values = {k: v for k, v in obj.items() if k != "recompute"}
            return kind(recompute=Recompute.from_json(obj["recompute"]), **values)
    what = f"policy {policy!r} takes" if policy is not None else "a setting has the keys"
    raise ValueError(f"{what} {' or '.join(form(k) for k in kinds)}, got keys {sorted(obj)}")


def check_recompute_fits(cost, local_tokens: int, recompute: Recompute, what: str) -> None:
    """ValueError unless `recompute` is allowed and a micro-batch of `local_tokens` per rank fits with it."""
    if not cost.allows(recompute):
        raise ValueError(f"{what}: recompute {recompute} is not among the allowed {list(cost.allowed_recompute)}")
    if recompute.kind == "full" and recompute.full_layers > cost.layers_per_stage:
        raise ValueError(f"{what}: recompute {recompute} exceeds the stage's {cost.layers_per_stage} layers")
    if cost.memory_from_tokens(local_tokens, recompute) > cost.cluster.mem_budget_bytes:
        raise ValueError(f"{what}: a micro-batch of {local_tokens} tokens per rank does not fit the memory budget "
                         f"with recompute {recompute} (at most {cost.max_local_tokens(recompute)} tokens per rank)")


def least_recompute_for(cost, local_tokens: int) -> Recompute | None:
    """The cheapest run-wide recompute with which `local_tokens` per rank fit: none, selective, else the
    fewest full layers (memory falls along `recompute_options`, time rises); None when nothing fits."""
    return next((r for r in cost.recompute_options() if cost.max_local_tokens(r) >= local_tokens), None)


def default_dynamic_setting(cost, longest: int, sizes: list[int]) -> DynamicSetting:
    """What a user gets without tuning: the largest cap memory allows with the least recompute with which
    the run's longest sequence (`longest`, its length cap) fits the largest allowed CP size (`sizes`
    ascending), smallest CP size 1; the strongest recompute's when none holds it (a batch's own sequences
    then decide whether it runs)."""
    share = local_tokens(int(longest), sizes[-1])
    r = next((r for r in cost.recompute_options() if cost.max_local_tokens(r) >= share), cost.strongest_recompute)
    return DynamicSetting(token_cap=max(int(cost.max_local_tokens(r)), 1), recompute=r)


def token_caps(cost, longest: int, top_size: int) -> list[int]:
    """The per-rank token caps a tuned dynamic-CP run chooses from (sweep.dynamic_grid; dcp's ZeRO-3 seeds
    near their best cap, lockstep_seeds.py), ascending: those that hold the longest sequence on `top_size` ranks."""
    most = cost.max_local_tokens(cost.strongest_recompute)
    need = 2 * -(-int(longest) // (2 * top_size))
    caps, k = {most}, 0
    while (cap := int(round(SMALLEST_CAP * 2 ** (k / 2) / CAP_ROUNDING)) * CAP_ROUNDING) <= most:
        caps.add(cap)
        k += 1
    caps.update(cost.max_local_tokens(r) for r in cost.recompute_options() if r.kind != "full")
    # the most tokens the fewest full layers that hold the longest sequence allow, and a few more layers
    full = [cost.max_local_tokens(r) for r in cost.recompute_options() if r.kind == "full"]
    first = next((i for i, cap in enumerate(full) if cap >= need), len(full))
    caps.update(full[first:first + FULL_LIMIT_CAPS])
    return sorted(c for c in caps if need <= c <= most)
