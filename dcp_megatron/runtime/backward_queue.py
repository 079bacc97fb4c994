"""What a failed backward leaves queued on a CPU thread, released (torch only).

Autograd's engine runs a CPU backward on the calling thread from a ready queue kept per thread across calls. When
a node raises (an out-of-memory inside a backward), the engine stops at once and the nodes already queued behind it
stay in that queue, each holding its part of the graph: every activation saved for backward below it and the
gradients already passed to it. Nothing in Python refers to them, so the garbage collector cannot free them; they
go only when a later backward on the thread pops them (a GPU's device threads pop theirs at once). Until then a
failed pass keeps most of its activations alive: on an emulated device (runtime/device_ceiling.py) the next
micro-batch's forward runs out of memory on top of them.

`BackwardQueueSentinel`, made before a pass that may fail, builds a one-node graph then; `release()` after the
failure runs its backward. The queue pops its newest nodes first (by sequence number), and the sentinel's node is
older than every node of the failed pass, so every node left queued is popped (and dropped: its backward has
ended) before the sentinel's own backward completes.
"""
from __future__ import annotations

import torch


class BackwardQueueSentinel:
    """`sentinel = BackwardQueueSentinel()` before a pass; `sentinel.release()` after it failed (module docstring)."""

    def __init__(self) -> None:
        leaf = torch.zeros((), requires_grad=True)
        with torch.enable_grad():
            self._root = leaf.clone()   # its node is numbered now, before any node of the pass

    def release(self) -> None:
        """Pop (and drop) every node a failed backward on this thread left queued; once per sentinel."""
        if self._root is None:
            return
        root, self._root = self._root, None
        with torch.enable_grad():
            root.backward()
