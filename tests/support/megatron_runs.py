"""Launch real megatron.training runs from tests and read what they print.

`run_training(...)` starts torchrun (optionally through `-m dcp_megatron.launch`) on a script
with the flag set of Megatron-LM's Llama-3 example at tiny size (GQA, RoPE, SwiGLU, RMSNorm,
untied embeddings, no bias, distributed optimizer, per-token loss, cosine LR, clip-grad, eval)
plus the CPU flags, and returns the exit code, the output and the parsed iteration lines.
Each launch costs ~15-30 s on 2 cores (imports and start-up): tests share runs through
module-scoped fixtures.
"""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field

from dcp_megatron.planner.plan_origin import OWN, plan_origin
from tests.support.dist_utils import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUR_SCRIPT = os.path.join(REPO, "pretrain_scripts", "pretrain_gpt.py")

LLAMA_TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--ffn-hidden-size 128 --seq-length 1024 --max-position-embeddings 1024 "
    "--micro-batch-size 1 --global-batch-size 8 "
    "--position-embedding-type rope --swiglu --normalization RMSNorm --disable-bias-linear "
    "--untie-embeddings-and-output-weights --use-distributed-optimizer --calculate-per-token-loss "
    "--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 2 --clip-grad 1.0 --weight-decay 0.1 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 256 --split 98,1,1 --eval-iters 1 --eval-interval 5 "
    "--dataloader-inter-document-masking --attention-dropout 0 --hidden-dropout 0 --log-interval 1 --seed 1234"
).split()

# DeepSeek-V3's recipe (Megatron-LM's examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh, core_v0.19.0) at tiny size
# on LLAMA_TINY's run (without GQA, which MLA excludes): multi-latent attention (--rope-type rope: YaRN needs a GPU),
# a dense first layer then MoE (4 experts top-2, sigmoid scores, expert bias, group-limited top-k, top-k scaling,
# a shared expert, seq_aux_loss at DeepSeek's tiny coefficient).
DEEPSEEK_TINY = tuple(" ".join(LLAMA_TINY).replace("--group-query-attention --num-query-groups 2 ", "").split())
DEEPSEEK_FLAGS = (
    "--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 "
    "--v-head-dim 12 --qk-layernorm --rope-type rope "
    "--num-experts 4 --moe-ffn-hidden-size 32 --moe-router-topk 2 --moe-router-score-function sigmoid "
    "--moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-4 --moe-router-num-groups 2 "
    "--moe-router-group-topk 1 --moe-router-topk-scaling-factor 2.5 --moe-shared-expert-intermediate-size 64 "
    "--moe-layer-freq [0,1] --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4"
).split()

CPU_FLAGS = (
    "--transformer-impl local --use-cpu-initialization --distributed-backend gloo --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion "
    "--no-persist-layer-norm --distributed-timeout-minutes 3"
).split()

_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+) \|.*?grad norm: ([0-9.]+)")
_ITERATION_NUMBER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|")
_MOE_METRIC = re.compile(r"\| ((?:seq_)?load_balancing_loss|z_loss|mtp_\d+ loss): ([0-9.E+-]+)")
_EVAL = re.compile(r"validation loss at iteration (\d+) (?:on validation set )?\| lm loss value: ([0-9.E+-]+)")
_DCP = re.compile(r" dcp iteration\s+(\d+) \| plan (\S+): .*?cp sizes (\S+) \| micro-batches/rank (\S+) .*?"
                  r"recompute (\S+) \| predicted \(ms\): ([0-9.]+) \| forward-backward \(ms\): ([0-9.]+)")


def is_own_plan(plan_or_label) -> bool:
    """Whether a step ran dcp's own layout: its log label (`dcp_steps[i]["policy"]`) is plain `dcp`, not
    `dcp(seeded:<baseline>)` (a baseline's layout with dcp's reliefs) nor `dcp(fallback:<baseline>)`; or a StepPlan
    (a plan dump) of policy dcp with neither `extra.seeded_from` nor `extra.fallback` (planner/plan_origin.py)."""
    if isinstance(plan_or_label, str):
        return plan_or_label == "dcp"
    return plan_or_label.policy == "dcp" and plan_origin(plan_or_label)[0] == OWN


@dataclass
class RunResult:
    returncode: int
    output: str
    losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    dcp_steps: dict[int, dict] = field(default_factory=dict)
    eval_losses: dict[int, float] = field(default_factory=dict)
    moe_metrics: dict[str, dict[int, float]] = field(default_factory=dict)   # MoE router and MTP losses per step

    @property
    def z_losses(self) -> dict[int, float]:
        return self.moe_metrics.get("z_loss", {})

    def loss_trace(self) -> list[float]:
        return [self.losses[i] for i in sorted(self.losses)]

    def check(self) -> "RunResult":
        assert self.returncode == 0, f"run failed (exit {self.returncode}):\n{self.output[-6000:]}"
        return self


def parse_output(returncode: int, output: str) -> RunResult:
    result = RunResult(returncode, output)
    for match in _ITERATION.finditer(output):
        result.losses[int(match[1])] = float(match[2])
        result.grad_norms[int(match[1])] = float(match[3])
    for line in output.splitlines():
        iteration = _ITERATION_NUMBER.search(line)
        for match in _MOE_METRIC.finditer(line) if iteration else ():
            result.moe_metrics.setdefault(match[1], {})[int(iteration[1])] = float(match[2])
    for match in _EVAL.finditer(output):
        result.eval_losses[int(match[1])] = float(match[2])
    for match in _DCP.finditer(output):
        result.dcp_steps[int(match[1])] = {
            "policy": match[2], "cp_sizes": match[3], "counts": [int(c) for c in match[4].split("/")],
            "recompute": match[5], "predicted_ms": float(match[6]), "measured_ms": float(match[7])}
    return result


def torchrun_command(script: str, flags: list[str], *, nproc: int, launcher: bool, port: int | None = None,
                     nnodes: int = 1, node_rank: int = 0, max_restarts: int = 0) -> list[str]:
    """Without `port` (one node): torchrun's standalone rendezvous, whose store binds a free port itself and is the
    store the workers use (MASTER_PORT), so a launch never races another job for a port it picked earlier.
    Several agents must meet at a port chosen beforehand (`port`); `run_agents` retries them if it was taken."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if max_restarts:   # torchrun's elastic restarts: a failed worker group is started again
        command.append(f"--max-restarts={max_restarts}")
    if port is None:
        if nnodes != 1:
            raise ValueError(f"{nnodes} agents need a port to meet at")
        command.append("--standalone")
    else:
        command += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--master-addr=127.0.0.1",
                    f"--master-port={port}"]
    command += ["-m", "dcp_megatron.launch", script] if launcher else [script]
    return command + flags


def run_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_training(script: str, extra: list[str], *, nproc: int = 2, launcher: bool = True, iters: int = 10,
                 base: tuple[str, ...] | list[str] = LLAMA_TINY, timeout_s: float = 600,
                 cpu_flags: bool = True, env: dict | None = None, max_restarts: int = 0) -> RunResult:
    """`cpu_flags=False`: none of CPU_FLAGS but the timeout (the patched validate_args defaults the others);
    `env`: variables added to the ranks' environment (test hooks); `max_restarts`: torchrun's elastic restarts."""
    cpu = CPU_FLAGS if cpu_flags else CPU_FLAGS[CPU_FLAGS.index("--distributed-timeout-minutes"):]
    flags = list(base) + cpu + ["--train-iters", str(iters)] + list(extra)
    command = torchrun_command(script, flags, nproc=nproc, launcher=launcher, max_restarts=max_restarts)
    proc = subprocess.run(command, cwd=REPO, env={**run_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout_s)
    return parse_output(proc.returncode, proc.stdout + proc.stderr)


_PORT_TAKEN = ("EADDRINUSE", "Address already in use", "address already in use")


def run_agents(script: str, flags: list[str], *, nnodes: int, nproc: int = 1, timeout_s: float = 600,
               tries: int = 3, late_s: float = 0) -> list[RunResult]:
    """`nnodes` torchrun agents on localhost meeting at one port (multi-node on one machine), each agent's result;
    the port is picked before the agents bind it, so a launch whose port another job took in between is run again
    on a new one (at most `tries` launches). `late_s`: the last agent starts that many seconds after the others
    (a node that comes up late; torchrun's static rendezvous waits up to 600 s for it)."""
    import time

    for attempt in range(tries):
        port = free_port()
        agents = []
        for node in range(nnodes):
            if node == nnodes - 1 and late_s:
                time.sleep(late_s)
            agents.append(subprocess.Popen(torchrun_command(script, flags, nproc=nproc, launcher=False, port=port,
                                                            nnodes=nnodes, node_rank=node), cwd=REPO, env=run_env(),
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        results = []
        for agent in agents:
            out, _ = agent.communicate(timeout=timeout_s)
            results.append(parse_output(agent.returncode, out))
        taken = any(r.returncode != 0 and any(t in r.output for t in _PORT_TAKEN) for r in results)
        if not taken or attempt == tries - 1:
            return results
    raise AssertionError("unreachable")


class LazyRuns:
    """A test module's launches, each started on first use and shared (a `-k` selection starts only what its tests
    read). `specs[name]()` runs one; `after(name, run)` runs `name` first (e.g. the checkpoint `run` loads)."""

    def __init__(self, root) -> None:
        self.root = root
        self.specs: dict = {}
        self._done: dict[str, RunResult] = {}

    def __call__(self, name: str) -> RunResult:
        if name not in self._done:
            self._done[name] = self.specs[name]().check()
            (self.root / f"{name}.log").write_text(self._done[name].output)   # for a failure's post-mortem
        return self._done[name]

    def after(self, name: str, run):
        self(name)
        return run()


def read_plan_dumps(directory, *, count: int | None = None) -> list:
    """The StepPlans a --dcp-dump-plans DIR holds, in step order (`count`: exactly that many)."""
    from dcp_megatron.planner.plan import StepPlan

    plans = []
    for path in sorted(glob.glob(os.path.join(str(directory), "step_*.json"))):
        with open(path) as f:
            plans.append(StepPlan.from_json(f.read()))
    assert count is None or len(plans) == count, (directory, len(plans), count)
    return plans


def strip_dcp_lines(source: str, destination: str) -> None:
    """A copy of our script without its two DCP lines: a user's unmodified Megatron script."""
    with open(source) as f:
        text = f.read()
    stripped = text.replace("import dcp_megatron\n\ndcp_megatron.enable()\n", "")
    assert stripped != text, "pretrain_gpt.py no longer has the two lines this helper removes"
    with open(destination, "w") as f:
        f.write(stripped)


def cpu_shims_only_script(source: str, destination: str) -> None:
    """A copy of our script that applies none of dcp-megatron's patches but the CPU shims (patches/compat.py:
    upstream's CUDA calls bound to the CPU; without them upstream cannot run without a GPU at all; among them our
    core attention for the local spec, since megatron-core's local DotProductAttention takes neither packed input
    nor MLA's head dims): megatron-core and megatron.training as upstream ships them otherwise, no --dcp flags."""
    with open(source) as f:
        text = f.read()
    shimmed = text.replace("import dcp_megatron\n\ndcp_megatron.enable()\n",
                           "from patches.compat import cpu_compat_registry\n\ncpu_compat_registry().apply()\n")
    assert shimmed != text, "pretrain_gpt.py no longer has the two lines this helper replaces"
    with open(destination, "w") as f:
        f.write(shimmed)


def microbatches_seen(directory, rank: int, iteration: int, *, chunk: int | None = None) -> list[tuple]:
    """(CP group's global ranks or None, recompute that RAN) of each micro-batch a rank's decoder ran at an
    iteration, from the trace --dcp-dump-plans writes next to the plans (dcp_megatron/core/microbatch_trace.py:
    the recompute is what its backward replayed, not what the model's switches said); `chunk`: that virtual
    pipeline stage's records only."""
    import json

    with open(os.path.join(str(directory), f"microbatches_rank{rank}.jsonl")) as f:
        records = [json.loads(line) for line in f if json.loads(line)["iteration"] == iteration]
    assert not [r for r in records if "unattributed_replays" in r], (rank, iteration, records)
    return [(r["group_ranks"], r["recompute"]) for r in records if chunk is None or r["chunk"] == chunk]


def microbatches_planned(plan, rank: int, *, to_global=lambda domain_rank: domain_rank,
                         name=lambda recompute: str(recompute)) -> list[tuple]:
    """The same as the plan names it for a domain rank; an idle rank runs one filler without a group or recompute.
    `to_global`: a domain rank's global rank at the traced rank's TP/PP coordinate (TP 1, PP 1: the same);
    `name`: what one model chunk replays of a recompute (virtual stages split full recompute over chunks)."""
    expected = [([to_global(r) for r in group.ranks] if group.size > 1 else None, name(mb.recompute))
                for _, group in plan.rank_schedule(rank) for mb in group.microbatches]
    return expected or [(None, "none")]


def flatten_state(state, prefix: str = "") -> dict:
    """A (nested) state dict of tensors, e.g. Megatron's saved wgrads, as {dotted name: float tensor}."""
    import torch

    if isinstance(state, torch.Tensor):
        return {prefix: state.float()}
    out = {}
    for key, value in state.items():
        out.update(flatten_state(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def tiny_local_gpt(*, num_layers: int, max_sequence_length: int, **config_overrides):
    """A tiny megatron-core GPTModel on the local spec (RoPE, no bias, no dropout); model-parallel state must be
    initialised and the patch set applied by the caller. `config_overrides`: further TransformerConfig fields."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    model_parallel_cuda_manual_seed(1)
    fields = dict(num_layers=num_layers, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                  hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False)
    config = TransformerConfig(**{**fields, **config_overrides})
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                    max_sequence_length=max_sequence_length, position_embedding_type="rope")
