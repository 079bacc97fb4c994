"""Checkpoint save/load for pretrain_gpt.py: one file per (TP, PP) rank, written by DP rank 0.

Layout: DIR/iter_NNNNNNN/mp_rank_TT_PPP.pt and DIR/latest_checkpointed_iteration.txt (the
tracker is written last, so an interrupted save is never picked up). A checkpoint holds the
model, optimizer and LR-schedule states, the iteration, the data position (`GlobalBatchStream.state_dict()`:
the stream depends only on data, seed and token budget, so it resumes exactly), the RNG state and the model/parallel shape it was saved
with; loading into a different shape is an error naming both.
"""
from __future__ import annotations

import os
from typing import Any

import torch
from megatron.core import parallel_state

_TRACKER = "latest_checkpointed_iteration.txt"
# Flags whose values must match between the saving and the loading run.
SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
               "vocab_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "swiglu",
               "normalization", "disable_bias_linear", "untie_embeddings_and_output_weights")


def _rank_file(directory: str, iteration: int) -> str:
    tp = parallel_state.get_tensor_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_rank()
    return os.path.join(directory, f"iter_{iteration:07d}", f"mp_rank_{tp:02d}_{pp:03d}.pt")


def save_checkpoint(directory: str, *, iteration: int, data_state: dict, args, model, optimizer,
                    lr_schedule) -> None:
    writes = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    if writes:
        path = _rank_file(directory, iteration)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        state = {
            "iteration": iteration,
            "data": data_state,
            "shape": {flag: getattr(args, flag) for flag in SHAPE_FLAGS},
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "lr_schedule": lr_schedule.state_dict(),
            "rng": torch.get_rng_state(),
        }
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(directory, _TRACKER), "w") as f:
            f.write(f"{iteration}\n")
    torch.distributed.barrier()


def load_checkpoint(directory: str, *, args, model, optimizer, lr_schedule) -> tuple[int, dict | None]:
    """Restore states in place; returns (iteration, data stream state), (0, None) when DIR has none."""
    tracker = os.path.join(directory, _TRACKER)
    if not os.path.exists(tracker):
        return 0, None
    with open(tracker) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ValueError(f"{tracker}: expected an iteration number, found {text!r}")
    iteration = int(text)
    path = _rank_file(directory, iteration)
    if not os.path.exists(path):
        raise ValueError(f"checkpoint {path} is missing: was {directory} saved with a different TP/PP layout?")
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    mismatched = {flag: (saved, getattr(args, flag)) for flag, saved in state["shape"].items()
                  if getattr(args, flag) != saved}
    if mismatched:
        details = ", ".join(f"--{flag.replace('_', '-')} saved {saved} vs now {now}"
                            for flag, (saved, now) in mismatched.items())
        raise ValueError(f"checkpoint {path} does not match this run: {details}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    lr_schedule.load_state_dict(state["lr_schedule"])
    torch.set_rng_state(state["rng"])
    return state["iteration"], state["data"]
