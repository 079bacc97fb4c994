"""A data stream for tests: documents in a seeded order per epoch, cut into token-budget global batches.

What a step trains on depends only on the corpus (its document lengths), the seed and the
batching budget (tokens_per_step, max_seq_len, overlong). Nothing here knows the world size,
TP/PP/CP or the DCP layout, so runs with different layouts see identical batches and their
losses are comparable.

- Order: epoch e visits every document once, in `epoch_order(num_documents, seed, e)`.
- Batches: `GlobalBatcher` (planner/batcher.py) cuts each epoch's stream of planned lengths
  (tokens - 1, see dcp_megatron/data/documents.py) greedily by the token budget. Epochs are not mixed: an
  epoch's last batch may be partial, and the next epoch starts a fresh batch, so every
  training position of every document is in exactly one batch per epoch.
- Ids: `GlobalBatch.step` counts steps since the start of training and `seq_id`s run on
  across steps and epochs, so both are unique for the whole run.
- Resume: `state_dict()` holds the position of the next batch (epoch, document offset in the
  epoch's order, token offset inside a document split across batches, step, next seq id).
  Greedy batching restarts identically at a batch boundary, so a resumed stream yields
  exactly the batches an uninterrupted one would.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterator

import numpy as np

from dcp_megatron.data.documents import MIN_DOCUMENT_TOKENS, DocumentSource
from dcp_megatron.planner.batcher import GlobalBatch, GlobalBatcher

# Separates the order's random stream from other users of the same seed (e.g. mock tokens).
_ORDER_STREAM = 0x0D0C5


def epoch_order(num_documents: int, seed: int, epoch: int, *, shuffle: bool = True) -> np.ndarray:
    """int64 [num_documents]: the document ids of `epoch` in visiting order."""
    if not shuffle:
        return np.arange(num_documents, dtype=np.int64)
    rng = np.random.default_rng([_ORDER_STREAM, seed, epoch])
    return rng.permutation(num_documents).astype(np.int64)


@dataclass(frozen=True, kw_only=True)
class DataPosition:
    """Where the next global batch starts."""

    epoch: int
    offset: int          # index into epoch_order(...) of the first document not fully consumed
    token_offset: int    # training positions of that document already consumed (split documents)
    step: int            # step number of the next batch
    next_seq_id: int     # seq_id of the next sequence


class GlobalBatchStream:
    """Endless iterator of `GlobalBatch`es over a `DocumentSource`; see the module docstring."""

    def __init__(self, source: DocumentSource, *, tokens_per_step: int, max_seq_len: int, seed: int,
                 overlong: str = "error", shuffle: bool = True) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"GlobalBatchStream.seed must be a non-negative int, got {seed!r}")
        self._batcher = GlobalBatcher(tokens_per_step=tokens_per_step, max_seq_len=max_seq_len, overlong=overlong)
        self._seed = seed
        self._shuffle = bool(shuffle)
        self._planned = self._planned_lengths(source)
        self._position = DataPosition(epoch=0, offset=0, token_offset=0, step=0, next_seq_id=0)
        self._batches: Iterator[GlobalBatch] | None = None   # the current epoch's batcher, from ...
        self._batches_start = self._position                    # ... this position
        self._cached_order: tuple[int, np.ndarray] = (-1, np.empty(0, dtype=np.int64))

    def _planned_lengths(self, source: DocumentSource) -> np.ndarray:
        token_counts = np.asarray(source.lengths(), dtype=np.int64)
        if token_counts.ndim != 1 or token_counts.size == 0:
            raise ValueError(f"the document source holds no documents (lengths shape {token_counts.shape})")
        too_short = np.flatnonzero(token_counts < MIN_DOCUMENT_TOKENS)
        if too_short.size:
            first = int(too_short[0])
            raise ValueError(f"{too_short.size} document(s) have fewer than {MIN_DOCUMENT_TOKENS} tokens and cannot "
                             f"train, e.g. document {first} with {int(token_counts[first])}; drop them when "
                             f"preprocessing")
        planned = token_counts - 1
        if self._batcher.overlong == "error":
            too_long = np.flatnonzero(planned > self._batcher.max_seq_len)
            if too_long.size:
                first = int(too_long[0])
                # Checked up front: the batcher would only find it when the stream reaches it.
                raise ValueError(
                    f"{too_long.size} document(s) are longer than max_seq_len={self._batcher.max_seq_len} training "
                    f"positions, e.g. document {first} with {int(planned[first])}; raise max_seq_len, or opt in to "
                    f"overlong='split' (cut into pieces) or overlong='truncate' (keep the first max_seq_len)")
        return planned

    # ---- properties ---------------------------------------------------------------------------
    @property
    def num_documents(self) -> int:
        return int(self._planned.size)

    @property
    def planned_lengths(self) -> np.ndarray:
        """int64 [num_documents]: training positions per document (tokens - 1)."""
        return self._planned.copy()

    @property
    def position(self) -> DataPosition:
        return self._position

    @property
    def max_seq_len(self) -> int:
        return self._batcher.max_seq_len

    @property
    def tokens_per_step(self) -> int:
        return self._batcher.tokens_per_step

    # ---- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> "GlobalBatchStream":
        return self

    def __next__(self) -> GlobalBatch:
        return self.next_batch()

    def next_batch(self) -> GlobalBatch:
        if self._batches is None:
            self._batches_start = self._position
            self._batches = self._batcher.batches(self._remaining_documents(self._batches_start))
        relative = next(self._batches, None)
        assert relative is not None, f"epoch {self._position.epoch} yielded no batch at {self._position}"
        batch = self._renumber(relative)
        self._advance(batch)
        return batch

    def _order(self, epoch: int) -> np.ndarray:
        # One permutation per epoch, reused by every batch of it.
        if self._cached_order[0] != epoch:
            self._cached_order = (epoch, epoch_order(self.num_documents, self._seed, epoch, shuffle=self._shuffle))
        return self._cached_order[1]

    def _remaining_documents(self, pos: DataPosition) -> Iterator[tuple[int, int]]:
        """(doc_id, planned length) from `pos` to the end of its epoch; a partly consumed
        document contributes only its remaining positions."""
        order = self._order(pos.epoch)
        for index in range(pos.offset, order.size):
            doc_id = int(order[index])
            skip = pos.token_offset if index == pos.offset else 0
            yield doc_id, int(self._planned[doc_id]) - skip

    def _renumber(self, relative: GlobalBatch) -> GlobalBatch:
        """Batcher output -> run-wide step, seq ids and token offsets. The batcher was started at
        `_batches_start`; if that was inside a document, the batcher saw only its remainder."""
        pos, start = self._position, self._batches_start
        first_doc = int(self._order(start.epoch)[start.offset]) if start.token_offset else None
        sources = tuple((doc_id, offset + (start.token_offset if doc_id == first_doc else 0), length)
                        for doc_id, offset, length in relative.sources)
        sequences = tuple((pos.next_seq_id + i, length) for i, (_, length) in enumerate(relative.sequences))
        return GlobalBatch(step=pos.step, sequences=sequences, sources=sources)

    def _advance(self, batch: GlobalBatch) -> None:
        pos = self._position
        offset, token_offset = pos.offset, pos.token_offset
        for doc_id, piece_offset, length in batch.sources:
            end = piece_offset + length
            # A piece finishes its document unless the document was split and more pieces follow.
            if self._batcher.overlong != "split" or end == int(self._planned[doc_id]):
                offset, token_offset = offset + 1, 0
            else:
                token_offset = end
        epoch = pos.epoch
        if offset == self.num_documents:
            epoch, offset, token_offset = epoch + 1, 0, 0
            self._batches = None
        self._position = DataPosition(epoch=epoch, offset=offset, token_offset=token_offset, step=pos.step + 1,
                                      next_seq_id=pos.next_seq_id + len(batch.sequences))

    # ---- checkpointing ------------------------------------------------------------------------
    def _fingerprint(self) -> dict:
        # Resuming with other data or another budget would silently train on different batches.
        return {"seed": self._seed, "shuffle": self._shuffle, "tokens_per_step": self._batcher.tokens_per_step,
                "max_seq_len": self._batcher.max_seq_len, "overlong": self._batcher.overlong,
                "num_documents": self.num_documents, "num_planned_tokens": int(self._planned.sum())}

    def state_dict(self) -> dict:
        return {"position": asdict(self._position), "fingerprint": self._fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != {"position", "fingerprint"}:
            raise ValueError(f"not a GlobalBatchStream state: expected keys ['fingerprint', 'position'], "
                             f"got {sorted(state) if isinstance(state, dict) else type(state).__name__}")
        expected = self._fingerprint()
        changed = {k: (state["fingerprint"].get(k), v) for k, v in expected.items() if state["fingerprint"].get(k) != v}
        if changed:
            details = ", ".join(f"{k}: saved {old!r}, now {new!r}" for k, (old, new) in changed.items())
            raise ValueError(f"cannot resume the data stream: the data or batching settings changed ({details})")
        try:
            position = DataPosition(**{k: int(v) for k, v in state["position"].items()})
        except (TypeError, ValueError) as err:
            raise ValueError(f"bad data position in state: {state['position']!r} ({err})") from err
        if not (position.epoch >= 0 and 0 <= position.offset < self.num_documents and position.step >= 0
                and position.next_seq_id >= 0 and position.token_offset >= 0):
            raise ValueError(f"data position out of range for {self.num_documents} documents: {position}")
        doc_id = int(self._order(position.epoch)[position.offset])
        if position.token_offset >= self._planned[doc_id]:
            raise ValueError(f"data position {position} is past the end of document {doc_id} "
                             f"({int(self._planned[doc_id])} positions)")
        self._position = position
        self._batches = None
