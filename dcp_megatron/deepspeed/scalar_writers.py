"""The DCP step scalars (`runtime/step_scalars.py`) through a DeepSpeed engine's monitor.

DeepSpeed's `MonitorMaster` (`engine.monitor`) writes to the TensorBoard, W&B, Comet and CSV
back-ends its config enables (`"tensorboard": {"enabled": true, ...}`); it writes on global rank 0.
"""
from __future__ import annotations


def write_to_deepspeed_monitor(monitor, scalars: dict[str, float], step: int) -> bool:
    """Through a DeepSpeed engine's `monitor` (MonitorMaster); False when it has no monitor enabled."""
    if monitor is None or not getattr(monitor, "enabled", False):
        return False
    monitor.write_events([(tag, value, step) for tag, value in scalars.items()])
    return True
