"""dcp-megatron: Data-Centric Parallel training for Megatron-core and DeepSpeed.

A DeepSpeed script hands its model provider and forward/loss to `dcp_megatron.train_deepspeed` (the trainer:
dcp_megatron/deepspeed/trainer.py; pretrain_scripts/pretrain_gpt_deepspeed.py). Two ways to use it with a
script built on `megatron.training.pretrain`:
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


def deepspeed_patches(*, timeout):
    """The patch set a DeepSpeed run applies before `deepspeed.init_distributed`, not applied (the DeepSpeed
    trainer applies it and removes it when the run closes); `timeout`: the job's collective timeout."""
    from patches.sets import patch_set

    return patch_set("deepspeed", timeout=timeout)


def train_deepspeed(argv=None, *, model_provider, forward_loss) -> int:
    """A DeepSpeed script's `main`: Megatron's flags in `argv`, the user's `model_provider(args, has_gpu=, bf16=)`
    and `forward_loss(engine, batch)`; 0 when trained, 2 (one line on stderr) for a usage error."""
    from dcp_megatron.deepspeed.trainer import run
    from patches.torch_compile import eager_compile

    with eager_compile():   # megatron-core imported first here, not by the trainer's parser (patches/torch_compile.py)
        import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
        import megatron.training.arguments  # noqa: F401
    return run(argv, model_provider=model_provider, forward_loss=forward_loss, patches=deepspeed_patches)
