"""Where a `dcp` plan's layout came from, and its one-token label for logs and reports.

`make_plan("dcp", ...)` (policies.py) returns one of three kinds of plan, all with policy "dcp":
- own: dcp's own layout (dcp/own_layout.py);
- seeded: a baseline's layout with dcp's per-micro-batch (or, under ZeRO-3, per-wave) reliefs, `extra["seeded_from"]`
  naming the baseline's layout (`megatron-dynamic`, `megatron-hybrid@tuned`, `megatron-dynamic@cap11520`);
- fallback: a baseline's plan as is, no relief changed, `extra["fallback"]` naming it.
The label is one whitespace-free token, so log parsers read it as `plan (\\S+):`: `dcp`, `dcp(seeded:megatron-dynamic)`,
`dcp(fallback:static)`. A baseline's own plan (policy static, ...) is labelled by its policy.
"""
from __future__ import annotations

OWN, SEEDED, FALLBACK = "own", "seeded", "fallback"
ORIGINS = (OWN, SEEDED, FALLBACK)


def plan_origin(plan) -> tuple[str, str | None]:
    """(OWN | SEEDED | FALLBACK, the baseline layout it came from or None)."""
    if plan.extra.get("fallback"):
        return FALLBACK, str(plan.extra["fallback"])
    if plan.extra.get("seeded_from"):
        return SEEDED, str(plan.extra["seeded_from"])
    return OWN, None


def plan_label(plan) -> str:
    """The plan's policy and, for a seeded or fallback plan, its origin, as one token (module docstring)."""
    origin, source = plan_origin(plan)
    if origin == OWN:
        return plan.policy
    return f"{plan.policy}({origin}:{''.join(source.split())})"   # one token even if a seed name held a space
