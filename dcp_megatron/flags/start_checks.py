"""The start-up checks of a run's DCP settings that both engines share: one ordered list, run once per start.

Each engine gathers what these checks read into a `DcpStart` once (megatron.training: Megatron's args after its
own validate_args, training/arguments.py; DeepSpeed: Megatron's flags plus the JSON's "dcp" block,
deepspeed/config.py), runs `check_dcp_start` once, then builds the run's DcpConfig from the same settings (its
`__post_init__` holds the value checks). A check names the flags it reads and the one line it refuses with; the
line names a setting as the user gave it on that engine (`Wording`). The checks only one engine needs stay with
it: Megatron's flag conflicts, layout and GPU path (training/checks/), DeepSpeed's JSON and ZeRO checks
(deepspeed/config.py); the flag mistakes both meet before Megatron's own checks (flag_checks.py) and the
output and resume paths (run_paths.py) are called by each engine once, at its own point of the start.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from dcp_megatron.config import DcpUsageError, check_gpus_per_node


@dataclass(frozen=True, kw_only=True)
class Wording:
    """How an engine's refusals name what the user gave (flags only, or flags and the JSON's "dcp" block)."""

    enable: str            # what turns DCP on
    profile: str           # the profile setting, before its path
    gpus_per_node: str
    max_cp_size: str
    domain: str            # what the DCP domain is, after its size ({size}: the domain size)
    ulysses_refusal: str   # the Ulysses flavour where this engine does not run it
    ulysses_runs_on_cpu: bool   # whether the flavour runs here without a GPU


MEGATRON = Wording(
    enable="--dcp", profile="--dcp-profile", gpus_per_node="--dcp-gpus-per-node", max_cp_size="--dcp-max-cp-size",
    domain="(world size / (TP x PP))",
    ulysses_refusal=("--dcp-cp-attention ulysses: the Ulysses CP flavour runs under DeepSpeed "
                     "(pretrain_scripts/pretrain_gpt_deepspeed.py) only; Megatron-LM's get_batch hands "
                     "attention a CP group per micro-batch but no flavour"),
    ulysses_runs_on_cpu=False)
DEEPSPEED = Wording(
    enable='--dcp (or "dcp": {"enabled": true})', profile="dcp profile",
    gpus_per_node='--dcp-gpus-per-node (or "dcp" gpus_per_node)',
    max_cp_size='--dcp-max-cp-size (or "dcp" max_cp_size)',
    domain="(the world size); give at most {size}",
    ulysses_refusal=("Ulysses CP attention (--dcp-cp-attention / \"cp_attention\") is not wired to Transformer "
                     "Engine's attention yet; on GPU use the all-gather flavour"),
    ulysses_runs_on_cpu=True)


@dataclass(frozen=True, kw_only=True)
class DcpStart:
    """What the shared checks read of one start, gathered once by the engine."""

    wording: Wording
    enabled: bool                         # --dcp (or the block's "enabled")
    given: tuple[str, ...] = ()           # the DCP settings given, as the refusal names them
    settings: Mapping[str, object] = field(default_factory=dict)   # DcpConfig keyword arguments given
    domain_size: int | None = None        # the DCP domain (data-parallel ranks); None: not known here
    timeout_minutes: float | None = None  # --distributed-timeout-minutes
    has_gpu: bool = False


@dataclass(frozen=True)
class StartCheck:
    reads: tuple[str, ...]   # the flags (and "dcp" block keys) it reads
    refusal: str             # the gist of its one line
    run: Callable[[DcpStart], None]
    without_dcp: bool = False   # also when DCP is off


def _settings_need_dcp(start: DcpStart) -> None:
    if not start.enabled and start.given:
        raise DcpUsageError(f"{', '.join(start.given)} only take effect with {start.wording.enable}")


def _timeout_is_positive(start: DcpStart) -> None:
    if start.timeout_minutes is not None and not start.timeout_minutes > 0:
        raise DcpUsageError(f"--distributed-timeout-minutes must be positive, got {start.timeout_minutes}")


def _profile_is_a_file(start: DcpStart) -> None:
    path = start.settings.get("profile")
    if path and not os.path.isfile(path):
        kind = "is a directory; give the profile JSON file" if os.path.isdir(path) else "no such file"
        raise DcpUsageError(f"{start.wording.profile} {path}: {kind}")


def _ranks_per_node(start: DcpStart) -> None:
    check_gpus_per_node(start.settings.get("gpus_per_node"), flag=start.wording.gpus_per_node)


def _cp_attention_runs_here(start: DcpStart) -> None:
    flavours = start.settings.get("cp_attention") or ()
    if "ulysses" in flavours and (start.has_gpu or not start.wording.ulysses_runs_on_cpu):
        raise DcpUsageError(start.wording.ulysses_refusal)


def _largest_group_fits_the_domain(start: DcpStart) -> None:
    max_cp_size, size = start.settings.get("max_cp_size"), start.domain_size
    if size is not None and max_cp_size is not None and max_cp_size > size:
        raise DcpUsageError(f"{start.wording.max_cp_size} {max_cp_size} exceeds the DCP domain of {size} ranks "
                            + start.wording.domain.format(size=size))


# In order: the first refusal is the one the user sees.
START_CHECKS = (
    StartCheck(("--dcp", "--dcp-*", '"dcp" block'), "<settings> only take effect with --dcp", _settings_need_dcp,
               without_dcp=True),
    StartCheck(("--dcp-profile", '"dcp" profile'), "<path>: no such file / is a directory", _profile_is_a_file),
    StartCheck(("--dcp-gpus-per-node", '"dcp" gpus_per_node'), "does not describe this job (LOCAL_WORLD_SIZE, "
               "the world size)", _ranks_per_node),
    StartCheck(("--dcp-cp-attention", '"dcp" cp_attention'), "ulysses where this engine does not run it",
               _cp_attention_runs_here),
    StartCheck(("--dcp-max-cp-size", '"dcp" max_cp_size'), "exceeds the DCP domain", _largest_group_fits_the_domain),
    StartCheck(("--distributed-timeout-minutes",), "must be positive", _timeout_is_positive, without_dcp=True),
)


def check_dcp_start(start: DcpStart) -> None:
    """Every shared start-up check, in order (DcpUsageError: the first refusal)."""
    for check in START_CHECKS:
        if start.enabled or check.without_dcp:
            check.run(start)
