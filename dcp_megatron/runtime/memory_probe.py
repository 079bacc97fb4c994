"""Bytes a forward keeps for backward, and the peak of live bytes, counted per storage (torch only).

Two probes, usable on real tensors, on the `meta` device (nothing allocated) or under FakeTensorMode:

- `SavedBytes`: autograd's saved-tensor hooks record every tensor a forward saves for backward, by its storage
  (views and tensors saved twice are one allocation), under the bucket the caller names (a layer) and the
  scopes open when it was saved (a module: what fine-grained offloading would group). Bytes are read when asked,
  so storages a checkpoint empties after saving (`CheckpointWithoutOutput`'s `resize_(0)`) count what they hold.
- `LiveBytes`: a TorchDispatchMode that follows every storage an operator returns until it dies and keeps the
  peak of their sum, read before each operator: activations, their gradients and every temporary, never the
  storages that existed before it started (weights) nor those named in `exclude`. A weight's gradient
  (`drop_weight_grads`: freed once accumulated) is taken out of the sum from its birth on: on the GPU
  megatron-core writes it straight into the fp32 main-grad buffer (gradient-accumulation fusion), static state.
"""
from __future__ import annotations

import weakref
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def storage_key(tensor: torch.Tensor) -> int:
    """One key per allocation: every view of a storage shares it."""
    return tensor.untyped_storage()._cdata


class SavedBytes:
    """Records what a forward saves for backward (see the module docstring); `exclude`: tensors never counted
    (the weights a linear saves)."""

    def __init__(self, exclude=()) -> None:
        self._excluded = {storage_key(t) for t in exclude}
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._bucket_of: dict[int, str] = {}
        self._scopes_of: dict[int, set] = defaultdict(set)
        self._described: dict[int, tuple] = {}
        self.bucket = "outside"
        self._scopes: list[str] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key not in self._excluded:
            if key not in self._storages:
                self._storages[key] = tensor.untyped_storage()
                self._bucket_of[key] = self.bucket
                self._described[key] = (tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""))
            self._scopes_of[key].add(self._scopes[-1] if self._scopes else "")
        # an alias without autograd history: the tensor itself would make a node that saves its own output hold
        # that output's grad_fn, a cycle through C++ the collector cannot see; a forward that raises (runs out of
        # memory) before its backward would then keep its whole graph alive
        return tensor.detach()

    def __enter__(self) -> "SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def enter_scope(self, name: str) -> None:
        """Tensors saved until `exit_scope` are marked with `name` (one saved in several scopes carries them all)."""
        self._scopes.append(name)

    def exit_scope(self) -> None:
        self._scopes.pop()

    def bytes_by_bucket(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for key, storage in self._storages.items():
            out[self._bucket_of[key]] += storage.nbytes()
        return dict(out)

    def bytes_saved_only_in(self, bucket: str, scopes) -> int:
        """Bytes of `bucket`'s storages saved inside the named scopes and nowhere else."""
        scopes = set(scopes)
        return sum(s.nbytes() for k, s in self._storages.items()
                   if self._bucket_of[k] == bucket and self._scopes_of[k] <= scopes)

    def tensors(self, bucket: str) -> list[tuple[tuple, str, int, tuple]]:
        """(shape, dtype, bytes, scopes) of each storage first saved in `bucket`, largest first."""
        rows = [(self._described[k], s.nbytes(), tuple(sorted(self._scopes_of[k])))
                for k, s in self._storages.items() if self._bucket_of[k] == bucket]
        return sorted(((shape, dtype, n, sc) for (shape, dtype), n, sc in rows), key=lambda r: -r[2])

    def release(self) -> None:
        """Drop the references to the storages (call before backward so none outlives its graph)."""
        self._storages = {k: _Empty(s.nbytes()) for k, s in self._storages.items()}


class _Empty:
    """A released storage's byte count."""

    def __init__(self, nbytes: int) -> None:
        self._nbytes = nbytes

    def nbytes(self) -> int:
        return self._nbytes


class LiveBytes(TorchDispatchMode):
    """The peak of live bytes over the operators run inside (see the module docstring); `mark(name)` records the
    live bytes at a named point."""

    def __init__(self, exclude=()) -> None:
        super().__init__()
        self._excluded = {storage_key(t) for t in exclude}
        self._live: dict[int, weakref.ref] = {}
        self._born: dict[int, int] = {}
        self._history: list[int] = []            # live bytes before each operator
        self.marks: dict[str, int] = {}

    def _follow(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._excluded or key in self._live:
            return
        self._live[key] = weakref.ref(storage)
        self._born[key] = len(self._history)
        weakref.finalize(storage, self._live.pop, key, None)

    def live_bytes(self) -> int:
        return sum(s.nbytes() for s in (r() for r in list(self._live.values())) if s is not None)

    @property
    def peak(self) -> int:
        return max(self._history + [self.live_bytes()])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._history.append(self.live_bytes())
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._follow(leaf)
        return out

    def forget(self, tensor: torch.Tensor) -> None:
        """Never count this tensor's storage, from its birth on (a weight's gradient, once known to be one)."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live:
            born = self._born[key]
            self._history[born:] = [b - storage.nbytes() for b in self._history[born:]]
            del self._live[key]
        self._excluded.add(key)
        weakref.finalize(storage, self._excluded.discard, key)     # a later storage may reuse the address

    def mark(self, name: str) -> None:
        self.marks[name] = self.live_bytes()


def drop_weight_grads(weights, live: LiveBytes) -> list:
    """Hooks that free each weight's gradient once accumulated and tell `live` never to have counted it; remove
    them with `.remove()`."""
    def drop(weight):
        live.forget(weight.grad)
        weight.grad = None
    return [w.register_post_accumulate_grad_hook(drop) for w in weights if w.requires_grad]
