"""The DeepSpeed script's data: Megatron's datasets and sampler, read as each rank's share of a global batch.

The same pipeline as a megatron.training run with the same flags: the tokenizer from `--tokenizer-type`,
`GPTDataset` (or `MockGPTDataset` with `--mock-data`) over `--data-path` blends and `--split`, built by
megatron-core's `BlendedMegatronDatasetBuilder`, and Megatron's `MegatronPretrainingSampler`, which
deals every data-parallel rank `--micro-batch-size` samples per pull in order. A step is
`--global-batch-size` samples: each rank pulls its `global / (micro x data-parallel)` micro-batches,
exactly the samples Megatron's loop would train that step, and `global_batch.split_samples` cuts them
into documents at `cu_seqlens` (`--dataloader-inter-document-masking`; without it a sample is one
sequence). The data position is Megatron's: the number of samples consumed.
"""
from __future__ import annotations

import argparse

import torch

from dcp_megatron.core.global_batch import Documents, split_samples


def build_train_dataset(args: argparse.Namespace, tokenizer, *, valid_samples: int = 0):
    """Megatron's train dataset for --train-iters x --global-batch-size samples (`tokenizer`: Megatron's
    `build_tokenizer(args)`); with `valid_samples` > 0, (train, validation) datasets."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, path_to_cache=args.data_cache_path, tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=False, mmap_bin_files=args.mmap_bin_files,
        inter_document_masking=args.dataloader_inter_document_masking, context_parallel_size=1,
        data_parallel_size=args.data_parallel_size)
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    num_samples = [args.train_iters * args.global_batch_size, valid_samples, 0]
    train, valid, _ = BlendedMegatronDatasetBuilder(dataset_type, num_samples, lambda: True, config).build()
    if train is None:
        raise ValueError("the --split gives the train split no documents")
    if not valid_samples:
        return train
    if valid is None:
        raise ValueError("the --split gives the validation split no documents, and --eval-interval / --eval-iters "
                         "ask for evaluation")
    return train, valid


class SampleShares:
    """This rank's share of each step's global batch, as Megatron's sampler deals it (see the module docstring)."""

    def __init__(self, dataset, *, global_batch_size: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int) -> None:
        per_pull = micro_batch_size * data_parallel_size
        if global_batch_size % per_pull:
            raise ValueError(f"--global-batch-size {global_batch_size} is not a multiple of --micro-batch-size "
                             f"{micro_batch_size} x {data_parallel_size} data-parallel ranks")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.pulls_per_step = global_batch_size // per_pull
        self.consumed_samples = 0   # samples of the steps read so far (all ranks)
        self._loader = None
        self._ended = False

    def start(self, consumed_samples: int) -> None:
        """Read from `consumed_samples` on (0 at the start of training; a checkpoint's position on resume)."""
        from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

        if consumed_samples % self.global_batch_size:
            raise ValueError(f"data position {consumed_samples} samples is not a whole number of "
                             f"--global-batch-size {self.global_batch_size} steps")
        self.consumed_samples = consumed_samples
        self._loader = None
        self._ended = consumed_samples >= len(self.dataset)
        if self._ended:
            return
        sampler = MegatronPretrainingSampler(
            total_samples=len(self.dataset), consumed_samples=consumed_samples,
            micro_batch_size=self.micro_batch_size, data_parallel_rank=self.data_parallel_rank,
            data_parallel_size=self.data_parallel_size)
        self._loader = iter(torch.utils.data.DataLoader(self.dataset, batch_sampler=sampler, num_workers=0))

    def next_share(self) -> Documents | None:
        """This rank's documents of the next step, or None when the data ends (at the same step on every rank)."""
        if self._loader is None and not self._ended:
            self.start(self.consumed_samples)
        if self._ended:
            return None
        try:
            samples = [next(self._loader) for _ in range(self.pulls_per_step)]
        except StopIteration:
            self._loader, self._ended = None, True
            return None
        self.consumed_samples += self.global_batch_size
        return split_samples(samples)
