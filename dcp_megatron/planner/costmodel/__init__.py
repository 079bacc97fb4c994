"""The cost model: what one micro-batch costs (seconds, bytes per rank) and which relief it runs (docs/cost_model.md).

The face below is what the rest of the planner, the policies included, may ask of the cost model; the inner modules
are its own (and the runtime's and tests' where they need a constant). A policy gets one `CostModel` and asks it:
- time: `microbatch_time(lengths, cp_size, first_rank=, recompute=)`, and for hot loops the per-document terms
  `doc_terms`, `time_from_sums` / `times_from_sums`, `ideal_doc_seconds`, `doc_alone_seconds`;
- memory: `microbatch_memory(lengths, cp_size, recompute=)`, `fits`, `max_local_tokens`, `memory_from_tokens`,
  `bytes_per_local_token`, `static_bytes`;
- relief: `recompute_options`, `full_recompute_options`, `choose_recompute` / `best_recompute(_from_sums)` /
  `best_reliefs_from_sums` (many micro-batches at once),
  `fitting_reliefs`, `base_recompute`, `strongest_recompute`, `allows`, `allowed_recompute`;
- the run: `model` (ModelShape), `cluster` (ClusterSpec), `cp_attention`, `ulysses_time`, `memoised` (run-wide
  values a policy derives from the cost model alone).
What it is built from: `ModelShape` / `model_preset` (with `MlaShape`), `ClusterSpec` / `cluster_preset` /
`cpu_cluster`, `GpuCosts`, a profile (`load_profile`), the relief menu's names (`MENU_NAMES`). What corrects it from
measurements, one step at a time: `TimeCorrection` (`CostModel.with_time_scale`), `MemoryCorrection` and
`MemoryScale` (`CostModel.with_memory_scale`).

Numpy only. The cost model imports the plan format (planner/plan.py, planner/padding.py) and nothing else of the
planner: never the layout, the policies or the bound (tools/import_layers.py checks it).
"""
from dcp_megatron.planner.costmodel.cluster import ClusterSpec, GiB, cluster_preset, cpu_cluster
from dcp_megatron.planner.costmodel.cost import CostModel
from dcp_megatron.planner.costmodel.cost_profile import load_profile
from dcp_megatron.planner.costmodel.gpu_costs import GpuCosts
from dcp_megatron.planner.costmodel.memory_correction import MemoryCorrection, MemoryScale, NO_MEMORY_SCALE
from dcp_megatron.planner.costmodel.mla import MlaShape
from dcp_megatron.planner.costmodel.model import ModelShape, model_preset
from dcp_megatron.planner.costmodel.refine import TimeCorrection
from dcp_megatron.planner.costmodel.relief import MENU_NAMES

__all__ = ["CostModel", "ModelShape", "model_preset", "MlaShape", "ClusterSpec", "cluster_preset", "cpu_cluster",
           "GiB", "GpuCosts", "load_profile", "MENU_NAMES", "TimeCorrection", "MemoryCorrection", "MemoryScale",
           "NO_MEMORY_SCALE"]
