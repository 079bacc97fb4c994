"""Start-up checks only a megatron.training run needs: the model-parallel layout, MoE dispatchers, FP8 and the GPU
path."""
