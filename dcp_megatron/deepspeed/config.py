"""The DeepSpeed side of a run's configuration: the `"dcp"` block, the `--dcp*` flags, the ZeRO checks.

A DeepSpeed user turns DCP on with `--dcp` or with a `"dcp"` block in the DeepSpeed JSON:

    "dcp": {"enabled": true, "max_cp_size": 4, "recompute": ["none", "selective", "full"],
            "memory_budget_gb": 60, "dump_plans": "plans/"}

(keys are the `--dcp-*` flag names with `_`; a flag given on the command line wins over the block).
`prepare_deepspeed_config` checks the block and the ZeRO settings against what DCP can run, removes the
block (DeepSpeed does not know it) and sets what the planned step needs of the engine:

- `"train_batch_size"` is the global batch (`--global-batch-size` when that is not given; the two must agree);
- `train_micro_batch_size_per_gpu: 1`, `gradient_accumulation_steps: 1`: the plan, not the config,
  decides how many micro-batches each rank runs per step; the engine's step is the accumulation
  boundary (`engine_step.py`), so a config that asks for another accumulation count is refused;
- ZeRO stage 0-3. Stage 3 all-gathers every layer's parameters over the data-parallel group (the DCP
  domain) in every forward and backward, so ranks running different numbers of micro-batches would
  issue different numbers of gathers and hang (measured on 0.19.8, 2 CPU ranks: 1 vs 3 forwards time
  out, with and without `coalesce_grad_reduction`): the planner plans stage 3 in lockstep (one
  micro-batch per group per wave, a masked filler on idle ranks; planner/costmodel/param_sharding.py) with one relief
  per wave that every micro-batch of it, fillers included, runs (`ModelShape.wave_uniform_relief`; the
  engine step checks it, engine_step.check_wave_reliefs); what stage 3 cannot run is refused
  (`stage3_recompute`).
"""
from __future__ import annotations

import copy
import json
import os

from dcp_megatron.config import RECOMPUTE_CHOICES, DcpConfig, DcpUsageError, local_world_size
from dcp_megatron.flags.start_checks import DEEPSPEED, DcpStart, check_dcp_start

STAGE3_REFUSED = ("offload",)   # reliefs ZeRO-3 does not run (stage3_recompute)

# "dcp" block key -> (DcpConfig field, expected JSON type(s)).
_BLOCK_KEYS = {
    "enabled": (None, bool),
    "policy": ("policy", str),
    "max_cp_size": ("max_cp_size", int),
    "memory_budget_gb": ("memory_budget_gb", (int, float)),
    "device_memory_gb": ("device_memory_gb", (int, float)),
    "recompute": ("recompute", list),
    "profile": ("profile", str),
    "dump_plans": ("dump_plans", str),
    "check_plans": ("check_plans", bool),
    "gpus_per_node": ("gpus_per_node", int),
    "plan_ahead": ("plan_ahead", bool),
    "plan_part_ranks": ("plan_part_ranks", int),
    "refine": ("refine", bool),
    "memory_refine": ("memory_refine", bool),
    "memory_refine_steps": ("memory_refine_steps", int),
    "cp_attention": ("cp_attention", list),
}
# Under DeepSpeed the planner may pick Ulysses per micro-batch unless told otherwise.
DEFAULT_CP_ATTENTION = ("allgather", "ulysses")


def load_deepspeed_config(path: str) -> dict:
    """The DeepSpeed JSON at `path`, with a message naming the file when it cannot be read."""
    if not os.path.isfile(path):
        raise DcpUsageError(f"--deepspeed-config {path}: no such file")
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as err:
        raise DcpUsageError(f"--deepspeed-config {path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise DcpUsageError(f"--deepspeed-config {path}: expected a JSON object, got {type(config).__name__}")
    return config


def dcp_block_settings(block) -> dict:
    """The `"dcp"` block as DcpConfig keyword arguments (plus "enabled"); every key and type checked."""
    if block is None:
        return {}
    if not isinstance(block, dict):
        raise DcpUsageError(f'the DeepSpeed config\'s "dcp" block must be an object, got {type(block).__name__}')
    unknown = sorted(set(block) - set(_BLOCK_KEYS))
    if unknown:
        raise DcpUsageError(f'unknown key(s) {unknown} in the DeepSpeed config\'s "dcp" block; known keys: '
                            f'{sorted(_BLOCK_KEYS)}')
    settings = {}
    for key, value in block.items():
        field, kinds = _BLOCK_KEYS[key]
        bad_type = not isinstance(value, kinds) or (isinstance(value, bool) and kinds is not bool)
        if value is not None and bad_type:
            names = "/".join(k.__name__ for k in (kinds if isinstance(kinds, tuple) else (kinds,)))
            raise DcpUsageError(f'"dcp": {{"{key}": {json.dumps(value)}}} must be a {names}')
        if key == "cp_attention" and value is not None:
            value = tuple(value)
        if key == "recompute" and value is not None:
            value = tuple(value)
            if not value or any(r not in RECOMPUTE_CHOICES for r in value):
                raise DcpUsageError(f'"dcp": {{"recompute": {json.dumps(list(value))}}}: give a non-empty list from '
                                    f'{list(RECOMPUTE_CHOICES)}')
        settings["enabled" if field is None else field] = value
    return settings


def zero_stage(ds_config: dict) -> int:
    zero = ds_config.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise DcpUsageError(f'"zero_optimization" must be an object, got {type(zero).__name__}')
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
        raise DcpUsageError(f'"zero_optimization": {{"stage": {json.dumps(stage)}}} is not a ZeRO stage (0-3)')
    return stage


def prepare_deepspeed_config(ds_config: dict) -> dict:
    """A copy of the user's DeepSpeed config that the planned step can run (see the module docstring)."""
    config = copy.deepcopy(ds_config)
    config.pop("dcp", None)
    if config.get("activation_checkpointing"):
        raise DcpUsageError('the DeepSpeed config\'s "activation_checkpointing" block configures deepspeed.checkpointing, '
                            "which megatron-core's GPTModel never calls (the block would be ignored): remove it; "
                            "under --dcp the planner chooses recompute per micro-batch (--dcp-recompute, e.g. "
                            "none,selective,full), without --dcp give Megatron's --recompute-granularity")
    stage = zero_stage(config)
    for key in ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu"):
        if config.get(key, 1) != 1:
            raise DcpUsageError(
                f'"{key}": {json.dumps(config[key])}: the step plan decides how many micro-batches each rank runs '
                f'and what each holds (the batch is --global-batch-size samples); remove "{key}" or set it to 1')
    # The batch is --global-batch-size (batch_size_of_config made a "train_batch_size" agree with it);
    # DeepSpeed's own count is world size x 1 x 1, which it derives.
    config.pop("train_batch_size", None)
    if (config.get("bf16") or {}).get("enabled") and (config.get("fp16") or {}).get("enabled"):
        raise DcpUsageError('"bf16" and "fp16" are both enabled in the DeepSpeed config (DeepSpeed asserts on '
                            'it after start-up): enable one of them')
    config["train_micro_batch_size_per_gpu"] = 1
    config["gradient_accumulation_steps"] = 1
    refuse_bf16_optimizer(config, stage=stage)
    if config.get("managed_gradient_accumulation") is False:
        raise DcpUsageError('"managed_gradient_accumulation": false: the planned step coalesces each rank\'s '
                            "gradient reduction itself (engine_step.py); remove the key")
    return config


def check_precision_runs_here(config: dict, *, has_gpu: bool, cpu_has_fp16: bool | None = None) -> None:
    """DeepSpeed's CPU accelerator runs fp16 only where oneDNN has fp16 kernels (0.19.8, cpu_accelerator.
    is_fp16_supported); elsewhere the engine raises "Type fp16 is not supported on your device" once the model is
    built. `cpu_has_fp16`: that answer (None: ask torch as DeepSpeed does)."""
    if has_gpu or not (config.get("fp16") or {}).get("enabled"):
        return
    if cpu_has_fp16 is None:
        cpu_has_fp16 = _cpu_has_fp16()
    if not cpu_has_fp16:
        raise DcpUsageError('"fp16" is enabled in the DeepSpeed config (or by --fp16), and this machine has no GPU '
                            "and no CPU fp16 kernels (DeepSpeed would stop after building the engine: \"Type fp16 is "
                            'not supported on your device"): on CPU use "bf16": {"enabled": true} (--bf16) or fp32')


def _cpu_has_fp16() -> bool:
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def batch_size_of_config(ds_config: dict, *, global_batch_size: int | None) -> int | None:
    """One source of truth for the batch: the JSON's "train_batch_size" (samples per step, as in DeepSpeed) is
    --global-batch-size when the flag is not given, and must equal it when it is."""
    value = ds_config.get("train_batch_size")
    if value is None:
        return global_batch_size
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DcpUsageError(f'"train_batch_size": {json.dumps(value)} must be a positive integer (samples per step)')
    if global_batch_size is not None and global_batch_size != value:
        raise DcpUsageError(f'"train_batch_size": {value} in the DeepSpeed config disagrees with --global-batch-size '
                            f"{global_batch_size}: both give the samples per step; give one of them, or the same "
                            "value in both")
    return value


def refuse_bf16_optimizer(config: dict, *, stage: int) -> None:
    """bf16 with fp32 gradient accumulation under ZeRO-1 selects DeepSpeed's BF16_Optimizer (0.19.8,
    engine._do_optimizer_sanity_check), whose `coalesce_grad_reduction` raises NotImplementedError; without
    ZeRO that dtype mix is refused by DeepSpeed itself. Say so at start, with the settings that run."""
    bf16 = bool((config.get("bf16") or {}).get("enabled"))
    accumulate = str((config.get("data_types") or {}).get("grad_accum_dtype", "")).lower()
    if bf16 and accumulate in ("fp32", "float32", "float") and stage in (0, 1):
        runs = ("runs DeepSpeed's BF16_Optimizer, which cannot defer the gradient reduction of a rank's unequal "
                "micro-batch count" if stage == 1 else "is a dtype mix DeepSpeed does not run without ZeRO")
        raise DcpUsageError(f'"bf16" with "data_types": {{"grad_accum_dtype": "{accumulate}"}} under ZeRO stage '
                            f'{stage} {runs}; use ZeRO stage 2, or remove "grad_accum_dtype" (bf16 accumulation)')


def torch_adam_params(optimizer: dict, *, has_gpu: bool) -> dict:
    """The optimizer block with torch's Adam(W) instead of DeepSpeed's fused Adam, which JIT-compiles its op
    (nvcc on GPU, a C++ build on CPU); on GPU torch's fused kernel (`fused: true`, no compiler needed)."""
    if str(optimizer.get("type", "")).lower() not in ("adam", "adamw"):
        return optimizer
    params = optimizer.setdefault("params", {})
    params.setdefault("torch_adam", True)
    if has_gpu and params["torch_adam"] and "foreach" not in params:
        params.setdefault("fused", True)
    return optimizer


def check_schedule_length(ds_config: dict, *, train_iters: int) -> None:
    """A scheduler that ends before the run does would train the last steps at a rate nobody asked for."""
    scheduler = ds_config.get("scheduler") or {}
    total = (scheduler.get("params") or {}).get("total_num_steps")
    if isinstance(total, int) and train_iters > total:
        kind = scheduler.get("type", "the scheduler")
        rate = "learning rate 0" if kind == "WarmupDecayLR" else "the schedule's final rate"
        raise DcpUsageError(f'--train-iters {train_iters} runs past the scheduler\'s "total_num_steps": {total}: '
                            f"{kind} would train steps {total + 1}-{train_iters} at {rate}; raise total_num_steps "
                            f"to at least {train_iters} or lower --train-iters")


def dcp_config(ds_config: dict, *, cli: dict, seq_length: int, train_iters: int, log_interval: int,
               dcp_flag: bool, default_cp_attention: tuple[str, ...] = DEFAULT_CP_ATTENTION,
               domain_size: int | None = None, stage: int = 0, timeout_minutes: float | None = None,
               has_gpu: bool = False) -> DcpConfig | None:
    """The run's DcpConfig from the `"dcp"` block and the flags given on the command line (`cli`: DcpConfig
    keyword arguments, None where a flag was not given), or None when DCP is off, after the start checks both
    engines share (flags/start_checks.py: `domain_size`, the world size, bounds max_cp_size; `timeout_minutes`,
    the collective timeout); `stage`: the ZeRO stage (3 refuses what it cannot run, stage3_recompute)."""
    settings = dcp_block_settings(ds_config.get("dcp"))
    enabled = bool(dcp_flag or settings.pop("enabled", False))
    settings.pop("enabled", None)
    given = {key: value for key, value in cli.items() if value is not None}
    names = tuple(sorted(given) + sorted(f'"dcp" block key {key}' for key in settings))
    settings.update(given)
    check_dcp_start(DcpStart(wording=DEEPSPEED, enabled=enabled, given=names, settings=settings,
                             domain_size=domain_size, timeout_minutes=timeout_minutes, has_gpu=has_gpu))
    if not enabled:
        return None
    if settings.get("memory_probe"):
        raise DcpUsageError("--dcp-memory-probe: the memory probe before step 1 runs under megatron.training only; "
                            "the DeepSpeed script corrects the count from its first steps' readings instead "
                            "(--dcp-memory-refine, on by default on GPU): drop --dcp-memory-probe")
    if stage == 3 and settings.get("recompute") is not None:
        settings["recompute"] = stage3_recompute(settings["recompute"])
    if settings.get("cp_attention") is None:
        settings["cp_attention"] = default_cp_attention
    if settings.get("gpus_per_node") is None:
        settings["gpus_per_node"] = local_world_size()
    return DcpConfig(seq_length=seq_length, train_iters=train_iters, log_interval=log_interval, **settings)


def stage3_recompute(kinds: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """ZeRO-3's recompute choices. Every rank of the domain must run the same modules in the same order: full
    recompute replays a layer's forward in backward, whose pre-forward hook gathers the layer's weights again
    (gloo aborts when only some ranks do: "Received data size doesn't match expected size"), and DeepSpeed checks
    that every rank recorded the same module order (partitioned_param_coordinator.reset_step: "Detected a
    disagreement on list length", measured on 2 CPU ranks when selective recompute differed). So the planner gives
    every wave one relief that all its micro-batches, fillers included, run (`ModelShape.wave_uniform_relief`), and
    recompute runs: the kinds as given (None: the default menu). Refused: activation offloading (STAGE3_REFUSED;
    not run under ZeRO-3)."""
    other = [kind for kind in kinds or () if kind in STAGE3_REFUSED]
    if other:
        raise DcpUsageError(f"--dcp-recompute (or \"dcp\" recompute) {','.join(kinds)}: drop "
                            f"{', '.join(repr(k) for k in other)} (ZeRO stage 3: activation offloading is not run "
                            f"under sharded weights)")
    return kinds
