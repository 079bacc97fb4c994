"""The DCP planner: pure Python (standard library + numpy), never imports torch.

Bottom up: the plan (plan.py, padding.py; validate.py checks one), the cost model (costmodel/: its face is what a
policy may ask), what the policies build plans with (layout.py, list_scheduling.py, cp_flavour.py, timeline.py),
the policies (policies.py, dcp/, baselines/), the bound (bounds.py). tools/import_layers.py checks the order.
"""
from dcp_megatron.planner.costmodel import ClusterSpec, ModelShape, cluster_preset, model_preset
from dcp_megatron.planner.plan import Group, MicroBatch, Recompute, StepPlan, Wave

__all__ = ["ClusterSpec", "cluster_preset", "ModelShape", "model_preset",
           "Group", "MicroBatch", "Recompute", "StepPlan", "Wave"]
