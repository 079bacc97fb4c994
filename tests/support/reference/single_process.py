"""Exactness harness, the single-process half: random layouts and the single-device TinyGPT reference.

The distributed half, TinyGPT steps through the planned-step loop users run, is parity.py:

- `random_plan` builds a StepPlan directly from a random layout: each wave a random partition of
  the domain into contiguous blocks (power-of-two blocks aligned, as the planner emits them),
  sequences dealt to random groups, each group's share cut into 1..k micro-batches (some groups
  get none), a random recompute per micro-batch.
- `reference_train_step` is single-device training on the whole batch (per-token mean loss).
"""
from __future__ import annotations

import random
from dataclasses import replace
from functools import partial
from typing import Callable, Sequence

import torch

from dcp_megatron.planner.plan import Group, MicroBatch, Recompute, StepPlan, Wave
from dcp_megatron.runtime.cp_attention import packed_causal_attention
from tests.support.reference.loss import next_token_labels, token_loss_sum
from tests.support.reference.stats import predicted_busy_s
from tests.support.reference.tiny_gpt import TinyGPT

TokensOf = Callable[[int, int], torch.Tensor]  # (sample_id, length) -> LongTensor [length]


def seeded_tokens(vocab_size: int, seed: int) -> TokensOf:
    """Deterministic token ids per sample, identical in every process."""
    def tokens_of(sample_id: int, length: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + sample_id)
        return torch.randint(vocab_size, (length,), generator=gen)
    return tokens_of


def _is_power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


def random_partition(domain_size: int, rng: random.Random) -> list[tuple[int, int]]:
    """Contiguous blocks covering [0, domain_size); a power-of-two block starts at a multiple of its size."""
    blocks, first = [], 0
    while first < domain_size:
        sizes = [s for s in range(1, domain_size - first + 1) if not _is_power_of_two(s) or first % s == 0]
        size = rng.choice(sizes)
        blocks.append((first, size))
        first += size
    return blocks


def random_recompute(rng: random.Random, num_layers: int) -> Recompute:
    choice = rng.randrange(5)
    if choice == 0:
        return Recompute("none")
    if choice == 1:
        return Recompute("selective")
    if choice == 2:
        return Recompute.of_modules({"mlp"})
    if choice == 3:
        return Recompute.of_modules({"core_attn", "mlp"})
    return Recompute("full", rng.randint(1, num_layers))


def random_plan(batch: Sequence[tuple[int, int]], domain_size: int, rng: random.Random, *, num_layers: int,
                max_waves: int = 3, max_microbatches: int = 3) -> StepPlan:
    """A random valid layout of `batch` (each sequence exactly once) over `domain_size` ranks."""
    partitions = [random_partition(domain_size, rng) for _ in range(rng.randint(1, max_waves))]
    slots = [(w, b) for w, blocks in enumerate(partitions) for b in range(len(blocks))]
    share: dict[tuple[int, int], list[tuple[int, int]]] = {slot: [] for slot in slots}
    for seq in batch:
        share[rng.choice(slots)].append(seq)
    waves = []
    for w, blocks in enumerate(partitions):
        groups = []
        for b, (first, size) in enumerate(blocks):
            seqs = share[(w, b)]
            num_cuts = min(max(len(seqs) - 1, 0), rng.randint(0, max_microbatches - 1))
            cuts = sorted(rng.sample(range(1, len(seqs)), num_cuts))
            pieces = [seqs[i:j] for i, j in zip([0] + cuts, cuts + [len(seqs)]) if j > i]
            mbs = tuple(MicroBatch(tuple(p), random_recompute(rng, num_layers),
                                   est_time_s=sum(n for _, n in p) / size * 1e-5) for p in pieces)
            groups.append(Group(first, size, mbs))
        waves.append(Wave(tuple(groups)))
    plan = StepPlan(domain_size=domain_size, waves=tuple(waves), policy="random")
    return replace(plan, est_step_time_s=max(predicted_busy_s(plan)))


def reference_train_step(model: TinyGPT, batch: Sequence[tuple[int, int]], tokens_of: TokensOf) -> float:
    """Single-device step on the whole batch: backward of the per-token mean loss; returns the loss."""
    lengths = [n for _, n in batch]
    tokens = torch.cat([tokens_of(sid, n) for sid, n in batch])
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(lengths), 0)
    logits = model(tokens, positions, partial(packed_causal_attention, cu_seqlens=cu_seqlens))
    loss_sum, num_tokens = token_loss_sum(logits, next_token_labels(tokens, lengths))
    loss = loss_sum / num_tokens
    loss.backward()
    return float(loss.detach())


def grad_max_rel_err(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """Over all parameters: max |grad - ref grad| / max |ref grad| (per parameter), the worst one."""
    worst = 0.0
    for (name, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        if ref.grad is None or p.grad is None:
            raise ValueError(f"parameter {name} has no gradient (model: {p.grad is not None}, "
                             f"reference: {ref.grad is not None})")
        scale = ref.grad.abs().max().item()
        diff = (p.grad - ref.grad).abs().max().item()
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst
