"""Reading and checking a cost-model profile JSON (the schema is in cost.py's docstring)."""
from __future__ import annotations

import json
import math

PROFILE_SCALARS = ("gemm_flops", "intra_node_bw", "inter_node_bw", "microbatch_overhead_s",
                    "collective_latency_s", "recompute_cost_factor", "document_overhead_s", "fp8_gemm_flops")
_ZERO_OK = ("microbatch_overhead_s", "collective_latency_s", "document_overhead_s")
_PROFILE_KEYS = frozenset(PROFILE_SCALARS + ("attn_rate_points", "attention_times", "activation_bytes_per_hidden",
                                             "output_bytes_per_vocab", "meta"))


def load_profile(path: str) -> dict:
    """Read and check a profile JSON (schema in cost.py's module docstring)."""
    with open(path) as f:
        try:
            obj = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"profile {path}: not valid JSON ({err})") from err
    return check_profile(obj, where=path)


def _is_positive(value, *, zero_ok: bool = False) -> bool:
    """A finite JSON number > 0 (>= 0 with zero_ok); NaN, Infinity, strings and booleans are not."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and (value > 0 or (zero_ok and value == 0)))


def check_profile(obj, *, where: str = "profile") -> dict:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a profile is a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _PROFILE_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed: {sorted(_PROFILE_KEYS)}")
    for key in PROFILE_SCALARS:
        if key in obj and not _is_positive(obj[key], zero_ok=key in _ZERO_OK):
            raise ValueError(f"{where}: {key} must be a positive finite number, got {obj[key]!r}")
    if "output_bytes_per_vocab" in obj and not _is_positive(obj["output_bytes_per_vocab"]):
        raise ValueError(f"{where}: output_bytes_per_vocab must be a positive finite number, got "
                         f"{obj['output_bytes_per_vocab']!r}")
    if "activation_bytes_per_hidden" in obj:
        factors = obj["activation_bytes_per_hidden"]
        if (not isinstance(factors, dict) or not factors or set(factors) - set(RECOMPUTE_KINDS)
                or not all(map(_is_positive, factors.values()))):
            raise ValueError(f"{where}: activation_bytes_per_hidden must map some of {list(RECOMPUTE_KINDS)} to "
                             f"positive finite bytes per token per layer per hidden/tp unit, got {factors!r}")
    if "attn_rate_points" in obj:
        pts = obj["attn_rate_points"]
        if (not isinstance(pts, list) or not pts
                or any(not isinstance(p, list) or len(p) != 2 or not all(map(_is_positive, p)) for p in pts)):
            raise ValueError(f"{where}: attn_rate_points must be a non-empty list of [length, rate], both positive "
                             f"finite numbers, got {pts!r}")
    if "attention_times" in obj:
        rows = obj["attention_times"]
        if (not isinstance(rows, list) or not rows
                or any(not isinstance(r, list) or len(r) != 3 or not all(map(_is_positive, r)) for r in rows)):
            raise ValueError(f"{where}: attention_times must be a non-empty list of [length, cp_size, seconds], all "
                             "positive finite numbers")
    return obj


RECOMPUTE_KINDS = ("none", "selective", "full")


CP_ATTENTION_KINDS = ("allgather", "ulysses")


def check_cp_attention(allowed) -> tuple[str, ...]:
    """The CP attention flavours plans may use, in CP_ATTENTION_KINDS order; "allgather" is always among them
    (the flavour every layout can run: Ulysses needs the heads to split over the group). ("ulysses",) alone
    means Ulysses wherever it can run (`CostModel.prefer_ulysses`), all-gather elsewhere."""
    names = (allowed,) if isinstance(allowed, str) else tuple(allowed)
    bad = [a for a in names if a not in CP_ATTENTION_KINDS]
    if bad:
        raise ValueError(f"cp_attention: unknown flavour(s) {bad}; choose from {list(CP_ATTENTION_KINDS)}")
    return tuple(k for k in CP_ATTENTION_KINDS if k in names or k == "allgather")


def check_allowed_recompute(allowed) -> tuple[str, ...]:
    """The relief menu names a planner may choose from (relief.MENU_NAMES order); ValueError naming bad values
    for an empty set or unknown names."""
    from dcp_megatron.planner.costmodel.relief import menu_names
    return menu_names(allowed)
