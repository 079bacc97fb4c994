"""The baselines: the layouts Megatron users run today, each planned with one run-wide setting.

static.py (`static`, `static-balanced`: Megatron's fixed CP size), hybrid.py (`megatron-hybrid`: megatron-core's
hybrid CP scheduler), megatron_dynamic.py (`megatron-dynamic`: dev's dynamic CP); settings.py holds the run-wide
setting each takes and its default, sweep.py tunes it over a run's batches as a user would. dcp plans them too
(dcp/search.py), so it never loses to them.
"""
from __future__ import annotations

from typing import Callable

from dcp_megatron.planner.baselines.hybrid import plan_megatron_hybrid
from dcp_megatron.planner.baselines.megatron_dynamic import plan_megatron_dynamic
from dcp_megatron.planner.baselines.settings import DynamicSetting, StaticSetting
from dcp_megatron.planner.baselines.static import plan_static, plan_static_balanced

BASELINES: dict[str, Callable] = {
    "static": plan_static,
    "static-balanced": plan_static_balanced,
    "megatron-hybrid": plan_megatron_hybrid,
    "megatron-dynamic": plan_megatron_dynamic,
}
# the kind of run-wide setting each baseline takes (`setting=`)
SETTING_KINDS: dict[str, type] = {"static": StaticSetting, "static-balanced": StaticSetting,
                                  "megatron-hybrid": DynamicSetting, "megatron-dynamic": DynamicSetting}
