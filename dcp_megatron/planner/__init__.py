"""The DCP planner: pure Python (standard library + numpy), never imports torch."""
from dcp_megatron.planner.cluster import ClusterSpec, cluster_preset
from dcp_megatron.planner.model import ModelShape, model_preset
from dcp_megatron.planner.plan import Group, MicroBatch, Recompute, StepPlan, Wave

__all__ = ["ClusterSpec", "cluster_preset", "ModelShape", "model_preset",
           "Group", "MicroBatch", "Recompute", "StepPlan", "Wave"]
