"""dcp-megatron: Data-Centric Parallel training for Megatron-core and DeepSpeed.

Two ways to use it with a script built on `megatron.training.pretrain`:
- unchanged, through the launcher: `torchrun ... -m dcp_megatron.launch pretrain_gpt.py ... --dcp`;
- with two added lines before `pretrain(...)` runs (before the script's own Megatron imports is
  best, so the script's `from megatron.core.utils import ...` names bind the patched functions):

      import dcp_megatron
      dcp_megatron.enable()
"""
__version__ = "0.1.0"

_REGISTRY = None


def enable():
    """Apply dcp-megatron's patches to megatron-core / megatron.training (idempotent); returns the registry.

    Adds the --dcp* flags to Megatron's parser; only `--dcp` on the command line changes training.
    The patches are version-checked (megatron-core 0.19.2) and reversible: `enable().remove()`."""
    global _REGISTRY  # one process, one set of patches: a second call returns the same applied registry
    if _REGISTRY is None or not _REGISTRY.applied:
        from patches.sets import patch_set

        _REGISTRY = patch_set("megatron").apply()
    return _REGISTRY
