"""The megatron-core seam layer both engines share: a global batch's documents, this rank's micro-batch dicts,
planning from megatron-core's model shapes, recompute switches, MoE auxiliary losses, core attention, and the one
planned-step loop (`step_loop.py`) that the megatron.training and DeepSpeed adapters each drive."""
