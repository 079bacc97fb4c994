"""What a `--dcp` run is configured with (`DcpConfig`, inside the run's `RunSpec`) and the one error its checks
raise (`DcpUsageError`).

Both engines' adapters build a run's spec once from its flags and hand callees only their part (never
Megatron's whole `args`); every check that refuses a flag raises `DcpUsageError` with what to change.
This module imports nothing of the project, so every layer can use it.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

DCP_POLICIES = ("static", "static-balanced", "megatron-hybrid", "megatron-dynamic", "dcp")
# --dcp-recompute's names: the planner's relief menu (costmodel/relief.py MENU_NAMES; a unit test holds them equal):
# none, full (k layers), megatron-core's recompute_modules one by one ("selective": core attention, the old
# name), and "offload" (megatron-core's fine-grained activation offloading: GPU only, megatron.training only)
RECOMPUTE_CHOICES = ("none", "selective", "full", "core_attn", "mlp", "layernorm", "moe_act", "moe", "offload")
DEFAULT_RECOMPUTE = ("none", "selective", "full", "mlp")   # what runs on every stack, CPU included
NEEDS_TRANSFORMER_ENGINE = ("layernorm", "moe_act")   # recomputed by TE's CheckpointWithoutOutput only
CP_ATTENTION_CHOICES = ("allgather", "ulysses")
OFFLOAD_REFUSAL = ("--dcp-recompute offload: megatron-core's fine-grained activation offloading runs on GPU only "
                   "(CUDA streams, pinned host memory), under megatron.training's --dcp with Transformer Engine "
                   "(not the DeepSpeed script, ZeRO included); drop 'offload' here (dcp-simulate still plans it)")


class DcpUsageError(ValueError):
    """A flag or input that --dcp cannot honour; the message says what to change."""


AUTO_PART_RANKS = 1024          # --dcp-plan-part-ranks' default part ...
AUTO_SPLIT_FROM = 8192          # ... from domains of this many ranks (smaller domains plan whole: docs/simulator.md)


@dataclass(frozen=True, kw_only=True)
class DcpConfig:
    """What the DCP adapter needs of a run (validated; built from Megatron's args once)."""

    policy: str = "dcp"
    max_cp_size: int | None = None
    memory_budget_gb: float | None = None
    # --dcp-device-memory-gb: the device memory this run may use (GiB). On GPU a cap of torch's allocator below the
    # device (runtime/device_memory.py) and the base of the default budget (costmodel/device_budget.py); without a GPU
    # an emulated device that raises out-of-memory errors (runtime/device_ceiling.py) and the default budget.
    # None: the device's own memory
    device_memory_gb: float | None = None
    recompute: tuple[str, ...] = DEFAULT_RECOMPUTE
    profile: str | None = None
    dump_plans: str | None = None
    check_plans: bool = True         # one all-reduced plan hash per step (planning.check_same_plan)
    gpus_per_node: int | None = None
    seq_length: int
    log_interval: int = 1
    plan_ahead: bool = True          # plan step k+1 while step k trains (planner/ahead.py)
    # --dcp-plan-part-ranks: plan a large domain in parts of this many ranks, each rank its own part
    # (core/split_planning.py); 0: every rank plans the whole domain; None: parts of 1,024 from 8,192 ranks on
    plan_part_ranks: int | None = None
    train_iters: int | None = None   # the last step: nothing to read ahead after it
    iterations_to_skip: frozenset[int] = frozenset()   # --iterations-to-skip: Megatron reads those steps itself
    refine: bool = True              # correct the cost model from measured times (planner/costmodel/refine.py)
    # correct the memory count from each micro-batch's measured bytes in the first `memory_refine_steps` steps
    # (costmodel/memory_correction.py), and probe the largest micro-batch of each relief before step 1; None: on GPU
    memory_refine: bool | None = None
    memory_refine_steps: int = 5
    memory_probe: bool | None = None
    cp_attention: tuple[str, ...] = ("allgather",)   # CP attention flavours per micro-batch (+ "ulysses")
    row_multiple: int = 1            # each micro-batch's local rows padded to a multiple (FP8 GEMM shapes)
    fp8: bool = False                # linear GEMMs in FP8 (the cost model's FP8 rate and weight copies)
    te_attention: bool = False       # Transformer Engine's attention (on GPU: its p2p CP ring)
    # whether this run executes megatron-core's activation offload (the megatron.training adapter sets it where it
    # built the layers with it, on GPU: training/checks/offload_checks.py); without it "offload" is refused
    offload_runs: bool = False
    # fault injection and diagnostics (docs/reliability.md): raise an out-of-memory when global rank R takes
    # micro-batch M of iteration I (--dcp-inject-out-of-memory-at I:R:M); write each micro-batch's measured
    # saved-for-backward bytes into a directory (--dcp-dump-saved-bytes DIR, megatron.training path)
    inject_out_of_memory_at: tuple[int, int, int] | None = None
    dump_saved_bytes: str | None = None
    # --dcp-policy-setting: a baseline's run-wide setting (planner/baselines/settings.py's StaticSetting or
    # DynamicSetting; typed loosely, this module imports nothing of the project); None: the policy's default
    policy_setting: object | None = None
    # the smallest planner count of a micro-batch that ran out of memory in an earlier run of this job (recorded
    # beside its checkpoints: core/out_of_memory.py); the planner keeps every count below it. None: none recorded
    memory_limit_bytes: int | None = None
    # the memory factors (relief, factor) the failed micro-batches were counted with: the count starts at them
    recorded_memory_factors: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if self.policy not in DCP_POLICIES:
            raise DcpUsageError(f"--dcp-policy {self.policy!r} is not one of {DCP_POLICIES}")
        if self.plan_part_ranks is not None and (not isinstance(self.plan_part_ranks, int)
                                                 or isinstance(self.plan_part_ranks, bool) or self.plan_part_ranks < 0):
            raise DcpUsageError(f"--dcp-plan-part-ranks must be an int >= 0 (0: plan the whole domain on every rank), "
                                f"got {self.plan_part_ranks!r}")
        if self.max_cp_size is not None and self.max_cp_size < 1:
            raise DcpUsageError(f"--dcp-max-cp-size must be >= 1, got {self.max_cp_size}")
        if self.memory_budget_gb is not None and not (math.isfinite(self.memory_budget_gb)
                                                      and self.memory_budget_gb > 0):
            raise DcpUsageError(f"--dcp-memory-budget-gb must be a positive number of GiB, got {self.memory_budget_gb}")
        if self.device_memory_gb is not None and not (math.isfinite(self.device_memory_gb)
                                                      and self.device_memory_gb > 0):
            raise DcpUsageError(f"--dcp-device-memory-gb must be a positive number of GiB, got {self.device_memory_gb}")
        if self.memory_limit_bytes is not None and self.memory_limit_bytes <= 0:
            raise DcpUsageError(f"a recorded out-of-memory limit must be positive bytes, got {self.memory_limit_bytes}")
        refuse_bad_recompute(self.recompute)
        if "offload" in self.recompute and not self.offload_runs:
            raise DcpUsageError(OFFLOAD_REFUSAL)
        needs_te = [r for r in self.recompute if r in NEEDS_TRANSFORMER_ENGINE]
        if needs_te and not self.te_attention:
            raise DcpUsageError(f"--dcp-recompute {','.join(needs_te)} needs --transformer-impl transformer_engine: "
                                "megatron-core recomputes those modules with CheckpointWithoutOutput, which needs "
                                f"Transformer Engine; drop {','.join(needs_te)} or run the TE spec on GPU")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise DcpUsageError(f"--dcp-gpus-per-node must be >= 1, got {self.gpus_per_node}")
        bad = [a for a in self.cp_attention if a not in CP_ATTENTION_CHOICES]
        if bad or not self.cp_attention:
            raise DcpUsageError(f"--dcp-cp-attention: unknown {bad or 'empty list'}; give a comma list from "
                                f"{','.join(CP_ATTENTION_CHOICES)}")
        if self.memory_refine_steps < 1:
            raise DcpUsageError(f"--dcp-memory-refine-steps must be >= 1, got {self.memory_refine_steps}")
        if self.row_multiple < 1:
            raise DcpUsageError(f"--dcp-row-alignment must be >= 1, got {self.row_multiple}")
        if self.seq_length < 1:
            raise DcpUsageError(f"--seq-length must be positive, got {self.seq_length}")
        if self.policy_setting is not None:
            takes = getattr(type(self.policy_setting), "POLICIES", None)
            if takes is None:
                raise DcpUsageError(f"--dcp-policy-setting must be a run-wide setting, got {self.policy_setting!r}")
            if self.policy not in takes:
                raise DcpUsageError(f"--dcp-policy-setting ({self.policy_setting}) is a setting of --dcp-policy "
                                    f"{' / '.join(takes)}, not of --dcp-policy {self.policy}"
                                    + (" (dcp plans every step itself: it takes no setting)"
                                       if self.policy == "dcp" else ""))


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """A run's settings as its engine built and checked them once at start-up, by topic; each callee gets its
    part: the planner and the step loop `dcp`, the process groups and the collective watch `timeout_minutes`,
    a `dcp-profile` run its `profile`."""

    dcp: DcpConfig                   # plan, reliefs, output (plan dumps, log interval) and the domain's shape
    # --distributed-timeout-minutes (checked positive at start: flags/start_checks.py): every collective of the run
    timeout_minutes: float | None = None
    # output of a `dcp-profile` run (training/profiler.py's ProfileConfig; typed loosely, as policy_setting), else None
    profile: object | None = None


class RunSpecSlot:
    """The spec a megatron.training start built (`args`: the run's, which Megatron hands its later seams), for the
    seams it calls after start-up (its schedule, the profiler): one per applied patch set (patches/megatron_set.py),
    so no module holds a run's state. (Not on `args`: Megatron pickles args into every checkpoint.)"""

    def __init__(self) -> None:
        self._held: tuple[object, RunSpec] | None = None

    def hold(self, args: object, spec: RunSpec) -> None:
        self._held = (args, spec)

    def spec_of(self, args: object) -> RunSpec:
        assert self._held is not None and self._held[0] is args, \
            "the patched validate_args builds a --dcp run's spec before train() asks for it"
        return self._held[1]


def refuse_bad_recompute(kinds: tuple[str, ...]) -> None:
    """Both paths' one check of the recompute kinds: known names, and at least one (`""` is not "all")."""
    bad = [r for r in kinds if r not in RECOMPUTE_CHOICES]
    if bad or not kinds:
        raise DcpUsageError(f"--dcp-recompute: unknown {bad or 'empty list'}; give a comma list from "
                            f"{','.join(RECOMPUTE_CHOICES)}")


def recompute_choices(value: str | None) -> tuple[str, ...] | None:
    """--dcp-recompute as a checked tuple (None when the flag is not given)."""
    kinds = parse_comma_list(value)
    if kinds is not None:
        refuse_bad_recompute(kinds)
    return kinds


def parse_comma_list(value: str | None) -> tuple[str, ...] | None:
    """A comma-list flag (--dcp-recompute, --dcp-cp-attention) as a tuple; None when the flag is not given."""
    return tuple(a.strip() for a in value.split(",") if a.strip()) if value is not None else None


def local_world_size() -> int | None:
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value and value.isdigit() and int(value) > 0 else None


def check_gpus_per_node(gpus_per_node: int | None, *, flag: str = "--dcp-gpus-per-node") -> None:
    """Ranks per node must describe this job: >= 1, torchrun's LOCAL_WORLD_SIZE where torchrun says it, else a
    divisor of the world size (the planner prices a CP group inside a node at NVLink bandwidth)."""
    if gpus_per_node is None:
        return
    if gpus_per_node < 1:
        raise DcpUsageError(f"{flag} must be >= 1 (ranks per node), got {gpus_per_node}")
    local_size, world_size = local_world_size(), int(os.environ.get("WORLD_SIZE", "0") or 0)
    if local_size is not None and gpus_per_node != local_size:
        raise DcpUsageError(f"{flag} {gpus_per_node} does not describe this job: torchrun runs {local_size} ranks "
                            f"per node (LOCAL_WORLD_SIZE); give {local_size}, or leave the flag out")
    if local_size is None and world_size > 0 and world_size % gpus_per_node:
        raise DcpUsageError(f"{flag} {gpus_per_node} does not describe this job: the world of {world_size} ranks "
                            f"is not a whole number of nodes of {gpus_per_node}")


def part_ranks_of(config: DcpConfig, domain_size: int) -> int:
    """The ranks per part split planning uses on this domain (0: plan it whole)."""
    if config.plan_part_ranks is not None:
        return config.plan_part_ranks
    return default_part_ranks(domain_size)


def default_part_ranks(domain_size: int) -> int:
    """--dcp-plan-part-ranks' default on a domain of this many ranks (0: whole)."""
    return AUTO_PART_RANKS if domain_size >= AUTO_SPLIT_FROM else 0
