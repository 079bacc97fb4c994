"""dcp-megatron: Data-Centric Parallel training for Megatron-core and DeepSpeed."""
__version__ = "0.1.0"
