"""Megatron's optimizer, clipping and precision flags onto the DeepSpeed JSON: one setting, two spellings.

A flag given on the command line writes its JSON key where the JSON does not set it, and must agree with the
JSON where it does (else refused, naming both); a flag not given leaves the JSON as it is (Megatron's defaults
do not override the JSON):

| flag | JSON |
|---|---|
| `--optimizer adam` / `sgd` | `"optimizer": {"type": "AdamW"}` / `"SGD"` (Megatron's Adam decouples weight decay, as DeepSpeed's AdamW and its Adam with `adam_w_mode` do); SGD also takes `"momentum"` from `--sgd-momentum` (Megatron's default 0.9) where the JSON has none |
| `--lr` | `"optimizer": {"params": {"lr"}}`: the peak rate; the JSON's `"scheduler"` block or Megatron's schedule flags (lr_schedule.py) shape it |
| `--adam-beta1`, `--adam-beta2`, `--adam-eps`, `--weight-decay` | `"betas"`, `"eps"`, `"weight_decay"` of the optimizer's params |
| `--clip-grad` | `"gradient_clipping"` |
| `--bf16` / `--fp16` | `"bf16"` / `"fp16"`: `{"enabled": true}` |

An optimizer block is created from the flags when the JSON has none (type from `--optimizer`, default adam).
Megatron's learning-rate and weight-decay schedule flags (`--lr-decay-style`, `--lr-warmup-*`,
`--lr-decay-iters`, `--min-lr`, `--*-weight-decay*`) are not written into the JSON: they run Megatron's own
`OptimizerParamScheduler` on the engine (lr_schedule.py; DeepSpeed's WarmupCosineLR runs one update behind
Megatron's warm-up, so no JSON "scheduler" reproduces them). `--use-distributed-optimizer` stays refused
(arguments.py: ZeRO's stage is the JSON's). Not the same across the engines: DeepSpeed
applies `weight_decay` to every weight, Megatron not to biases and norms.
"""
from __future__ import annotations

import copy
import json

from dcp_megatron.config import DcpUsageError
from dcp_megatron.flags.argv import flag_given

# flag -> the args attribute holding its value
MAPPED_FLAGS = {"--optimizer": "optimizer", "--lr": "lr", "--adam-beta1": "adam_beta1", "--adam-beta2": "adam_beta2",
                "--adam-eps": "adam_eps", "--weight-decay": "weight_decay", "--clip-grad": "clip_grad",
                "--sgd-momentum": "sgd_momentum", "--bf16": "bf16", "--fp16": "fp16"}
_OPTIMIZER_TYPES = {"adam": "AdamW", "sgd": "SGD"}
_MEGATRON_BETAS = (0.9, 0.999)   # megatron.training's --adam-beta1 / --adam-beta2 defaults


def _agree(flag: str, value, where: str, current):
    """`value` where the JSON has nothing, else the JSON's value if equal; a disagreement is refused."""
    if current is None or current == value:
        return value
    raise DcpUsageError(f"{flag} {value} disagrees with the DeepSpeed config's {where}: {json.dumps(current)}; both set "
                        "the same thing: give one of them, or the same value in both")


def _optimizer_type(flag_value: str, block: dict) -> str:
    if flag_value not in _OPTIMIZER_TYPES:
        raise DcpUsageError(f"--optimizer {flag_value}: the DeepSpeed script maps only adam and sgd onto the JSON's "
                            '"optimizer" block; set other optimizers there')
    wanted = _OPTIMIZER_TYPES[flag_value]
    current = block.get("type")
    if current is None:
        return wanted
    kind = str(current).lower()
    decoupled = kind == "adamw" or (kind == "adam" and (block.get("params") or {}).get("adam_w_mode", True))
    if (flag_value == "adam" and decoupled) or (flag_value == "sgd" and kind == "sgd"):
        return current
    raise DcpUsageError(f'--optimizer {flag_value} disagrees with the DeepSpeed config\'s "optimizer": {{"type": '
                        f'{json.dumps(current)}}}; give one of them, or the same optimizer in both')


def apply_megatron_flags(ds_config: dict, given: dict, *, sgd_momentum: float = 0.9) -> dict:
    """A copy of `ds_config` with the given Megatron flags (`given`: flag -> value, module docstring) written in;
    `sgd_momentum`: Megatron's (--sgd-momentum's value, given or default), for an SGD the flags choose."""
    config = copy.deepcopy(ds_config)
    optimizer_flags = [f for f in given if f not in ("--clip-grad", "--bf16", "--fp16")]
    if optimizer_flags:
        block = config.setdefault("optimizer", {})
        block["type"] = _optimizer_type(given.get("--optimizer", "adam"), block)
        params = block.setdefault("params", {})
        where = '"optimizer" "params"'
        if "--lr" in given:
            params["lr"] = _agree("--lr", given["--lr"], f'{where} "lr"', params.get("lr"))
            schedule = (config.get("scheduler") or {}).get("params") or {}
            if "warmup_max_lr" in schedule:   # WarmupLR / WarmupDecayLR set the rate from it, not from "lr"
                _agree("--lr", given["--lr"], '"scheduler" "params" "warmup_max_lr"', schedule["warmup_max_lr"])
        for flag, key in (("--adam-eps", "eps"), ("--weight-decay", "weight_decay")):
            if flag in given:
                params[key] = _agree(flag, given[flag], f'{where} "{key}"', params.get(key))
        for i, flag in enumerate(("--adam-beta1", "--adam-beta2")):
            if flag in given:
                betas = list(params.get("betas") or _MEGATRON_BETAS)
                current = params["betas"][i] if params.get("betas") else None
                betas[i] = _agree(flag, given[flag], f'{where} "betas"[{i}]', current)
                params["betas"] = betas
        if block["type"].lower() == "sgd" and ("--optimizer" in given or "--sgd-momentum" in given):
            if "--sgd-momentum" in given:
                params["momentum"] = _agree("--sgd-momentum", given["--sgd-momentum"], f'{where} "momentum"',
                                            params.get("momentum"))
            elif "momentum" not in params:
                params["momentum"] = sgd_momentum   # Megatron's default, as its SGD would use
    if "--clip-grad" in given:
        config["gradient_clipping"] = _agree("--clip-grad", given["--clip-grad"], '"gradient_clipping"',
                                             config.get("gradient_clipping"))
    for flag, key, other in (("--bf16", "bf16", "fp16"), ("--fp16", "fp16", "bf16")):
        if flag in given:
            if (config.get(other) or {}).get("enabled"):
                raise DcpUsageError(f'{flag} disagrees with the DeepSpeed config\'s "{other}": {{"enabled": true}}; '
                                    "enable one precision, in one place")
            config[key] = dict(config.get(key) or {}, enabled=True)
    return config


def given_megatron_flags(argv: list[str], args) -> dict:
    """flag -> parsed value of the mapped flags given on the command line."""
    return {flag: getattr(args, attr) for flag, attr in MAPPED_FLAGS.items()
            if flag_given(argv, flag)}
