"""The plan: what every rank of a DCP domain runs in one training step.

A plan is data. It is built by a policy from the lengths of one global batch,
checked by `validate`, serialised to JSON (other tools read it) and executed by
the runtime. Every rank computes the same plan from the same lengths.

    StepPlan  domain_size D, waves[]
    Wave      groups[]: a partition of ranks [0, D) into contiguous blocks
    Group     first_rank, size c (CP size), microbatches[] run in order by all c members
    MicroBatch sequences[(sample_id, length)] packed THD, recompute policy, estimates
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterator

# A sequence of a global batch: (sample_id, length in tokens).
Sequence = tuple[int, int]


# megatron-core 0.19.2's recompute_modules and offload_modules this planner models (planner/costmodel/relief.py)
RECOMPUTE_MODULE_NAMES = ("core_attn", "mlp", "layernorm", "moe_act", "moe", "shared_experts")
OFFLOAD_MODULE_NAMES = ("core_attn", "attn_proj", "expert_fc1", "moe_act")


@dataclass(frozen=True)
class Recompute:
    """Memory relief of one micro-batch.

    kind: "none" (keep all activations), "selective" (megatron-core's selective granularity: recompute
    the `modules`, default core attention only), or "full" (checkpoint the first `full_layers` layers).
    offload: megatron-core's fine-grained activation offloading of these modules' inputs (GPU only),
    with kind none or selective. Runtime code reads `.kind` / `.full_layers`; `modules` / `offload`
    default so that old plans and old code keep their meaning.
    """

    kind: str = "none"
    full_layers: int = 0
    modules: frozenset = frozenset()
    offload: frozenset = frozenset()

    def __post_init__(self) -> None:
        if self.kind not in ("none", "selective", "full"):
            raise ValueError(f"recompute kind must be none/selective/full, got {self.kind!r}")
        if self.kind == "full" and self.full_layers <= 0:
            raise ValueError(f"full recompute needs full_layers >= 1, got {self.full_layers}")
        if self.kind != "full" and self.full_layers != 0:
            raise ValueError(f"full_layers={self.full_layers} given with recompute kind {self.kind!r}")
        modules, offload = frozenset(self.modules), frozenset(self.offload)
        if self.kind == "selective" and not modules:
            modules = frozenset({"core_attn"})     # megatron-core's default recompute_modules
        if self.kind != "selective" and modules:
            raise ValueError(f"recompute modules {sorted(modules)} need kind 'selective', got {self.kind!r}")
        if modules - set(RECOMPUTE_MODULE_NAMES) or offload - set(OFFLOAD_MODULE_NAMES):
            raise ValueError(f"unknown recompute modules {sorted(modules - set(RECOMPUTE_MODULE_NAMES))} / offload "
                             f"modules {sorted(offload - set(OFFLOAD_MODULE_NAMES))}; megatron-core's recompute "
                             f"modules are {', '.join(RECOMPUTE_MODULE_NAMES)}, its offload modules "
                             f"{', '.join(OFFLOAD_MODULE_NAMES)}")
        if self.kind == "full" and offload:
            raise ValueError("offload is not combined with full recompute (a recomputed layer keeps its input only)")
        object.__setattr__(self, "modules", modules)
        object.__setattr__(self, "offload", offload)

    @property
    def legacy(self) -> bool:
        """Expressible in the old plan format: none, selective of core attention, full k."""
        return not self.offload and self.modules in (frozenset(), frozenset({"core_attn"}))

    @staticmethod
    def of_modules(modules) -> "Recompute":
        """Module recompute of `modules` (none when empty)."""
        return Recompute("selective", modules=frozenset(modules)) if modules else Recompute("none")

    def to_json(self) -> str | dict:
        if self.kind == "full":
            return {"full_layers": self.full_layers}
        if self.legacy:
            return self.kind
        out = {"modules": sorted(self.modules)}
        if self.offload:
            out["offload"] = sorted(self.offload)
        return out

    @staticmethod
    def from_json(obj: Any) -> "Recompute":
        if isinstance(obj, dict):
            if set(obj) == {"full_layers"}:
                return Recompute("full", int(obj["full_layers"]))
            if "modules" in obj and set(obj) <= {"modules", "offload"}:
                modules = frozenset(str(m) for m in obj["modules"])
                return Recompute("selective" if modules else "none", modules=modules,
                                 offload=frozenset(str(m) for m in obj.get("offload", ())))
            raise ValueError(f"recompute object must be {{'full_layers': k}} or {{'modules': [...], "
                             f"'offload': [...]}}, got {obj!r}")
        if obj in ("none", "selective"):
            return Recompute(obj)
        raise ValueError(f"recompute must be 'none', 'selective', {{'full_layers': k}} or {{'modules': [...]}}, "
                         f"got {obj!r}")

    def __str__(self) -> str:
        if self.kind == "full":
            return f"full{self.full_layers}"
        if self.legacy:
            return self.kind
        name = "+".join(sorted(self.modules)) or "none"
        return name + (f"+offload({','.join(sorted(self.offload))})" if self.offload else "")


NO_RECOMPUTE = Recompute("none")
SELECTIVE = Recompute("selective")


@dataclass(frozen=True)
class MicroBatch:
    sequences: tuple[Sequence, ...]
    recompute: Recompute = NO_RECOMPUTE
    est_time_s: float = 0.0
    est_mem_bytes: int = 0
    attention: str = "allgather"   # CP attention flavour on its group: "allgather" or "ulysses"

    @property
    def num_tokens(self) -> int:
        return sum(length for _, length in self.sequences)

    @property
    def lengths(self) -> list[int]:
        return [length for _, length in self.sequences]

    def to_json(self) -> dict:
        out = {
            "sequences": [[int(s), int(n)] for s, n in self.sequences],
            "recompute": self.recompute.to_json(),
            "est_time_s": float(self.est_time_s),
            "est_mem_bytes": int(self.est_mem_bytes),
        }
        if self.attention != "allgather":
            out["attention"] = self.attention
        return out

    @staticmethod
    def from_json(obj: dict) -> "MicroBatch":
        return MicroBatch(
            sequences=tuple((int(s), int(n)) for s, n in obj["sequences"]),
            recompute=Recompute.from_json(obj.get("recompute", "none")),
            est_time_s=float(obj.get("est_time_s", 0.0)),
            est_mem_bytes=int(obj.get("est_mem_bytes", 0)),
            attention=str(obj.get("attention", "allgather")),
        )


@dataclass(frozen=True)
class Group:
    first_rank: int
    size: int
    microbatches: tuple[MicroBatch, ...]

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.size)

    @property
    def est_time_s(self) -> float:
        return sum(mb.est_time_s for mb in self.microbatches)

    def to_json(self) -> dict:
        return {
            "first_rank": int(self.first_rank),
            "size": int(self.size),
            "microbatches": [mb.to_json() for mb in self.microbatches],
        }

    @staticmethod
    def from_json(obj: dict) -> "Group":
        return Group(
            first_rank=int(obj["first_rank"]),
            size=int(obj["size"]),
            microbatches=tuple(MicroBatch.from_json(m) for m in obj["microbatches"]),
        )


@dataclass(frozen=True)
class Wave:
    groups: tuple[Group, ...]

    @property
    def est_time_s(self) -> float:
        return max((g.est_time_s for g in self.groups), default=0.0)

    def group_of(self, rank: int) -> Group:
        for g in self.groups:
            if g.first_rank <= rank < g.first_rank + g.size:
                return g
        raise ValueError(f"rank {rank} is in no group of this wave")

    def to_json(self) -> dict:
        return {"groups": [g.to_json() for g in self.groups]}

    @staticmethod
    def from_json(obj: dict) -> "Wave":
        return Wave(groups=tuple(Group.from_json(g) for g in obj["groups"]))


@dataclass(frozen=True)
class StepPlan:
    domain_size: int
    waves: tuple[Wave, ...]
    est_step_time_s: float = 0.0
    lower_bound_s: float = 0.0
    policy: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    # ---- queries used by the runtime and tools -------------------------------------------
    def sequences(self) -> Iterator[Sequence]:
        for wave in self.waves:
            for g in wave.groups:
                for mb in g.microbatches:
                    yield from mb.sequences

    def rank_schedule(self, rank: int) -> list[tuple[int, Group]]:
        """(wave index, group) this rank belongs to, for every wave, in order."""
        if not 0 <= rank < self.domain_size:
            raise ValueError(f"rank {rank} outside domain [0, {self.domain_size})")
        return [(i, w.group_of(rank)) for i, w in enumerate(self.waves)]

    def num_microbatches(self, rank: int) -> int:
        return sum(len(g.microbatches) for _, g in self.rank_schedule(rank))

    def cp_size_histogram(self) -> dict[int, int]:
        """CP size -> number of sequences run at that size."""
        hist: dict[int, int] = {}
        for wave in self.waves:
            for g in wave.groups:
                n = sum(len(mb.sequences) for mb in g.microbatches)
                if n:
                    hist[g.size] = hist.get(g.size, 0) + n
        return dict(sorted(hist.items()))

    def summary(self) -> str:
        hist = " ".join(f"cp{c}:{n}" for c, n in self.cp_size_histogram().items())
        mbs = [self.num_microbatches(r) for r in range(self.domain_size)]
        return (f"{self.policy or 'plan'}: waves={len(self.waves)} [{hist}] "
                f"mb/rank={min(mbs)}..{max(mbs)} est={self.est_step_time_s * 1e3:.1f}ms "
                f"lb={self.lower_bound_s * 1e3:.1f}ms")

    # ---- JSON ----------------------------------------------------------------------------
    def to_json(self) -> dict:
        out = {
            "domain_size": int(self.domain_size),
            "est_step_time_s": float(self.est_step_time_s),
            "lower_bound_s": float(self.lower_bound_s),
            "policy": self.policy,
            "waves": [w.to_json() for w in self.waves],
        }
        if self.extra:
            out["extra"] = self.extra
        return out

    def dumps(self) -> str:
        """Deterministic JSON text: same plan, byte-identical output."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(obj: dict | str) -> "StepPlan":
        if isinstance(obj, str):
            obj = json.loads(obj)
        return StepPlan(
            domain_size=int(obj["domain_size"]),
            waves=tuple(Wave.from_json(w) for w in obj["waves"]),
            est_step_time_s=float(obj.get("est_step_time_s", 0.0)),
            lower_bound_s=float(obj.get("lower_bound_s", 0.0)),
            policy=str(obj.get("policy", "")),
            extra=dict(obj.get("extra", {})),
        )
