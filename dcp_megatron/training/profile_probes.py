"""What the profiler measures besides whole micro-batches: inside the user's model, time in the core
attention (forward and backward) and the bytes saved for backward, split at the transformer block;
between ranks, the all-gather's bandwidth and latency.

Both attach to the model as built by the user's model provider, from the outside (torchtitan-style):

- `AttentionTimer` wraps every layer's `self_attention.core_attention` forward between two identity
  autograd functions: the entry one marks the forward's start and, when its backward runs (last,
  once the attention's input gradients exist), the backward's end; the exit one marks the forward's
  end and the backward's start. On GPU the marks are CUDA events (kernels run asynchronously).
- `SavedBytesMeter` is a `saved_tensors_hooks` context around the forward: every tensor autograd
  keeps for backward is counted once per storage, except the parameters' own storages (weights are
  static state, not activations). Bytes saved while the transformer block's forward runs (between
  its forward pre-hook and hook) are the layers'; the rest is the embedding, output layer and loss.
  Megatron's full recompute saves each checkpointed chunk's input inside the block, so the split
  holds for every recompute kind.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from dcp_megatron.training.forward_step import Clock
from dcp_megatron.core.recompute import transformer_block


def core_attentions(chunk) -> list:
    block = transformer_block(chunk)
    layers = getattr(block, "layers", None) or []
    return [layer.self_attention.core_attention for layer in layers
            if hasattr(getattr(layer, "self_attention", None), "core_attention")]


class _Entry(torch.autograd.Function):
    @staticmethod
    def forward(ctx, timer, *tensors):
        ctx.timer = timer
        timer.forward_start = timer.clock.mark()
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        timer = ctx.timer
        timer.pairs.append((timer.backward_start, timer.clock.mark()))
        return (None, *grads)


class _Exit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, timer, output):
        ctx.timer = timer
        timer.pairs.append((timer.forward_start, timer.clock.mark()))
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        ctx.timer.backward_start = ctx.timer.clock.mark()
        return None, grad


class AttentionTimer:
    """Seconds spent in the model's core attention, forward and backward (module docstring)."""

    def __init__(self, model_chunks, clock: Clock) -> None:
        self.clock = clock
        self.pairs: list = []
        self.forward_start = self.backward_start = None
        self._wrapped = [m for chunk in model_chunks for m in core_attentions(chunk)]
        for module in self._wrapped:
            module.forward = self._timed(module.forward)

    @property
    def found(self) -> bool:
        return bool(self._wrapped)

    def _timed(self, forward):
        def timed_forward(query, key, value, *args, **kwargs):
            if not torch.is_grad_enabled():
                return forward(query, key, value, *args, **kwargs)   # a no-grad (recompute) forward: not timed
            query, key, value = _Entry.apply(self, query, key, value)
            return _Exit.apply(self, forward(query, key, value, *args, **kwargs))
        timed_forward.dcp_original = forward
        return timed_forward

    def reset(self) -> None:
        self.pairs = []

    def seconds(self) -> float:
        if self.clock.cuda and self.pairs:
            self.pairs[-1][1].synchronize()
        return sum(self.clock.seconds(a, b) for a, b in self.pairs)

    def remove(self) -> None:
        for module in self._wrapped:
            module.forward = module.forward.dcp_original
        self._wrapped = []


class SavedBytesMeter:
    """Bytes saved for backward during a forward, and the share saved inside the block (module docstring)."""

    def __init__(self, model_chunks) -> None:
        self._static = {p.untyped_storage().data_ptr() for chunk in model_chunks for p in chunk.parameters()}
        for chunk in model_chunks:
            for p in chunk.parameters():
                if getattr(p, "main_grad", None) is not None:
                    self._static.add(p.main_grad.untyped_storage().data_ptr())
        self._in_block = 0
        self._handles = []
        for chunk in model_chunks:
            block = transformer_block(chunk)
            if block is not None:
                self._handles.append(block.register_forward_pre_hook(self._enter_block))
                self._handles.append(block.register_forward_hook(self._leave_block))
        self.saved_bytes = self.block_saved_bytes = 0
        self._seen: set[int] = set()
        self._hooks = None

    def _enter_block(self, module, args):
        self._in_block += 1

    def _leave_block(self, module, args, output):
        self._in_block -= 1

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self._static and pointer not in self._seen:
            self._seen.add(pointer)
            self.saved_bytes += storage.nbytes()
            if self._in_block:
                self.block_saved_bytes += storage.nbytes()
        return tensor.detach()   # not the tensor itself: memory_probe.SavedBytes._pack says why

    def __enter__(self):
        self.saved_bytes = self.block_saved_bytes = 0
        self._seen = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._seen = set()
        return False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def all_gather_constants(group, domain_size: int, device) -> tuple[float, float] | None:
    """(bytes/s one rank receives, seconds of a tiny all-gather) over the domain; None on one rank."""
    if domain_size < 2:
        return None

    def best(numel: int) -> float:
        local = torch.zeros(numel, device=device)
        gathered = torch.empty(numel * domain_size, device=device)
        times = []
        for _ in range(6):
            dist.barrier(group=group)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            dist.all_gather_into_tensor(gathered, local, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return min(times[1:])

    latency = best(2)
    sizes = (1 << 20, 1 << 22)
    bandwidth = statistics.median(4 * n * (domain_size - 1) / max(best(n) - latency, 1e-9) for n in sizes)
    return bandwidth, latency
