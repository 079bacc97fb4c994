"""The megatron.training adapter: the `--dcp*` flags in Megatron's parser, the planned forward-backward function
its `train()` calls, the forward step, checkpoints and the profiler. Megatron's loop stays Megatron's."""
