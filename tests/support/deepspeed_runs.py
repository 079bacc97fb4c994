"""Launch real runs of pretrain_scripts/pretrain_gpt_deepspeed.py from tests and benchmarks.

`run_deepspeed(...)` writes the DeepSpeed JSON, starts torchrun on the script with a tiny Llama-like
model (GQA, RoPE, SwiGLU, RMSNorm, untied embeddings, no bias) on mock long-tailed documents, and
returns the parsed iteration lines (the same parser as the Megatron runs: the script prints
Megatron-style iteration and dcp lines). Each launch costs ~15 s on 2 cores, mostly imports.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile

from tests.support.dist_utils import free_port
from tests.support.megatron_runs import REPO, RunResult, parse_output, run_env, torchrun_command

DS_SCRIPT = os.path.join(REPO, "pretrain_scripts", "pretrain_gpt_deepspeed.py")

# Megatron's flags (the Megatron runs' tiny Llama, tests/support/megatron_runs.py), minus what the DeepSpeed JSON owns
# (optimizer, schedule, clipping, ZeRO) and evaluation; no CPU flags: the script defaults them without a GPU.
TINY_MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--ffn-hidden-size 128 --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 1 "
    "--global-batch-size 4 --position-embedding-type rope --swiglu --normalization RMSNorm --disable-bias-linear "
    "--untie-embeddings-and-output-weights --mock-data --tokenizer-type NullTokenizer --vocab-size 256 "
    "--split 98,1,1 --dataloader-inter-document-masking --attention-dropout 0 --hidden-dropout 0 --log-interval 1 "
    "--distributed-timeout-minutes 3 --seed 1234"
).split()


def blend_flags(directory: str) -> list[str]:
    """Megatron's data flags for the two corpora `write_blend` writes: a weighted --data-path blend and a --split."""
    return ["--data-path", "0.7", os.path.join(directory, "corpus_a"), "0.3", os.path.join(directory, "corpus_b"),
            "--split", "90,5,5"]


def write_blend(directory: str) -> list[str]:
    """Two megatron-core .bin/.idx corpora of long-tailed documents (token ids < 256); returns `blend_flags`."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(7)
    for name, num_documents in (("corpus_a", 300), ("corpus_b", 200)):
        prefix = os.path.join(directory, name)
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        for length in np.clip(rng.lognormal(5.0, 1.2, num_documents).astype(int), 2, 3000):
            builder.add_document(torch.from_numpy(rng.integers(0, 255, length).astype(np.uint16)), [int(length)])
        builder.finalize(prefix + ".idx")
    return blend_flags(directory)


def ds_config(*, stage: int, optimizer: dict | None = None, total_steps: int = 10, **extra) -> dict:
    """A DeepSpeed JSON as users write them: ZeRO stage, clipping, AdamW and a warm-up cosine schedule."""
    config = {
        "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0, "steps_per_print": 1000,
        "optimizer": optimizer or {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "betas": [0.9, 0.95]}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": total_steps, "warmup_num_steps": 2, "cos_min_ratio": 0.1}},
    }
    config.update(extra)
    return config


def run_deepspeed(config: dict, extra: list[str], *, nproc: int = 2, iters: int = 10, directory: str | None = None,
                  timeout_s: float = 900, torchrun: bool = True, model: list[str] | None = None,
                  max_restarts: int = 0) -> RunResult:
    """`torchrun=False` runs the script as a plain process: start-up checks happen before any process group,
    and its own exit code (2 for a usage error) comes back instead of torchrun's."""
    directory = directory or tempfile.mkdtemp(prefix="dcp-ds-")
    path = os.path.join(directory, f"ds_{free_port()}.json")
    with open(path, "w") as f:
        json.dump(config, f)
    flags = list(TINY_MODEL if model is None else model) + ["--deepspeed-config", path, "--train-iters", str(iters)] + list(extra)
    command = (torchrun_command(DS_SCRIPT, flags, nproc=nproc, launcher=False, max_restarts=max_restarts) if torchrun
               else [sys.executable, DS_SCRIPT, *flags])
    # a plain process makes its own one-rank group on MASTER_PORT (29500 by default): a free one, so runs side by
    # side (pytest workers, other suites) do not collide
    env = dict(run_env(), DS_ACCELERATOR="cpu", **({} if torchrun else {"MASTER_PORT": str(free_port())}))
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    return parse_output(proc.returncode, proc.stdout + proc.stderr)


def load_ds_script():
    """pretrain_gpt_deepspeed.py as a module, for in-process use of its functions."""
    spec = importlib.util.spec_from_file_location("pretrain_gpt_deepspeed", DS_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
