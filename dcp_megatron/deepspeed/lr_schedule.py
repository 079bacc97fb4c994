"""Megatron's learning-rate and weight-decay schedule flags on the DeepSpeed engine: Megatron's own scheduler.

Given any of Megatron's schedule flags (`SCHEDULE_FLAGS`), the script builds megatron.training's
`OptimizerParamScheduler` (its `get_optimizer_param_scheduler`, on the run's args) over the DeepSpeed
optimizer's param groups and hands it to `deepspeed.initialize(lr_scheduler=...)`. The engine steps it after
every applied update, by one global batch (`--global-batch-size` samples, as Megatron's loop increments it),
saves its state in each checkpoint and loads it on resume: a resumed run continues the step count. The rate
of every update is the one Megatron's pretrain_gpt.py uses for the same flags, and the logged learning rate
(after the update, as Megatron logs it) too.

Why not a JSON "scheduler" block: DeepSpeed's WarmupCosineLR runs one update behind Megatron's warm-up
(linear warm-up of 2, peak 3e-3: updates 2-3 at 0 and 1.5e-3, Megatron's at 1.5e-3 and 3e-3; measured), so
no JSON reproduces the flags. A JSON "scheduler" beside a schedule flag is refused (two schedules); without
schedule flags the JSON's scheduler (or none) runs, as DeepSpeed does it.

One setting in one place:
- the peak rate is `--lr` (agreed with the JSON's optimizer "lr" by megatron_flags.py), else the JSON's "lr";
- a constant weight decay (Megatron's default `--weight-decay-incr-style constant`) stays the optimizer's own
  (`--weight-decay` or the JSON's "weight_decay"); `--start-weight-decay`/`--end-weight-decay` with a linear or
  cosine increment set it instead, and a "weight_decay" in the JSON beside them is refused;
- the sample-counted flags (`SAMPLE_FLAGS`) are refused like `--train-samples`: the run counts steps;
- Megatron's `--override-opt_param-scheduler` / `--use-checkpoint-opt_param-scheduler` decide, as there, what a
  resume with changed schedule flags does (neither: refused, naming the setting); without a schedule flag they
  would do nothing, so they are refused.
"""
from __future__ import annotations

import argparse
import contextlib
import copy

from dcp_megatron.config import DcpUsageError
from dcp_megatron.flags.argv import flag_given

SCHEDULE_FLAGS = ("--lr-decay-style", "--lr-decay-iters", "--lr-warmup-iters", "--lr-warmup-fraction",
                  "--lr-warmup-init", "--min-lr", "--lr-wsd-decay-style", "--lr-wsd-decay-iters",
                  "--start-weight-decay", "--end-weight-decay", "--weight-decay-incr-style")
SAMPLE_FLAGS = ("--lr-decay-samples", "--lr-warmup-samples", "--lr-wsd-decay-samples")
RESUME_FLAGS = ("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                "--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler")


def given_schedule_flags(argv: list[str]) -> tuple[str, ...]:
    """The schedule flags on the command line; refuses the sample-counted ones and resume flags without them."""
    samples = [flag for flag in SAMPLE_FLAGS if flag_given(argv, flag)]
    if samples:
        raise DcpUsageError(f"{', '.join(samples)}: the DeepSpeed script counts its run in --train-iters steps; give "
                            "the iteration flags instead (--lr-decay-iters, --lr-warmup-iters, --lr-wsd-decay-iters)")
    given = tuple(flag for flag in SCHEDULE_FLAGS if flag_given(argv, flag))
    resume = [flag for flag in RESUME_FLAGS if flag_given(argv, flag)]
    if resume and not given:
        raise DcpUsageError(f"{', '.join(resume)}: only Megatron's scheduler reads it, and it runs under DeepSpeed only "
                            f"with a schedule flag ({SCHEDULE_FLAGS[0]}, ...); the JSON's \"scheduler\" resumes as "
                            "DeepSpeed saved it (see --override-optimizer-config)")
    return given


@contextlib.contextmanager
def _megatron_global_args(args: argparse.Namespace):
    """megatron.training's get_optimizer_param_scheduler reads its global args; set for the call, then restored."""
    from megatron.training import global_vars

    previous = global_vars._GLOBAL_ARGS
    global_vars.set_args(args)
    try:
        yield
    finally:
        global_vars.set_args(previous)


class _ParamGroups:
    """A stand-in optimizer for the start-up check: the scheduler only reads and writes param_groups."""

    def __init__(self, weight_decay: float):
        self.param_groups = [{"lr": 0.0, "weight_decay": weight_decay}]


class MegatronScheduleStep:
    """What DeepSpeed's engine steps (`lr_scheduler.step()` after each applied update), saves and loads: Megatron's
    scheduler, advanced by one global batch of samples per update."""

    def __init__(self, scheduler, *, samples_per_update: int):
        self.scheduler = scheduler
        self.samples_per_update = samples_per_update

    def step(self) -> None:
        self.scheduler.step(increment=self.samples_per_update)

    def reapply(self) -> None:
        """Write the scheduler's rate and weight decay into the param groups again (after a checkpoint's optimizer
        state replaced them)."""
        self.scheduler.step(increment=0)

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or "num_steps" not in state:
            raise DcpUsageError("--load: the checkpoint's scheduler state is not Megatron's (it was saved with the "
                                "DeepSpeed config's \"scheduler\" block); resume it with that block, without "
                                "Megatron's schedule flags")
        try:
            self.scheduler.load_state_dict(state)
        except AssertionError as err:   # Megatron's check that the flags match the checkpoint
            raise DcpUsageError(f"--load: Megatron's schedule flags changed since the checkpoint ({err}); add "
                                "--override-opt_param-scheduler to follow the flags, --use-checkpoint-opt_param-scheduler "
                                "to keep the checkpoint's schedule, or give the old values") from None

    def __repr__(self) -> str:
        return f"Megatron's OptimizerParamScheduler ({self.scheduler.lr_decay_style}) over {self.samples_per_update}" \
               " samples per update"


class MegatronSchedule:
    """Megatron's schedule for a DeepSpeed run: `build(optimizer)` is what `deepspeed.initialize` gets as its
    `lr_scheduler` (DeepSpeed calls it with the optimizer it built from the JSON)."""

    def __init__(self, args: argparse.Namespace, *, flags: tuple[str, ...], weight_decay_from_optimizer: bool):
        self.args = args   # the run's, with the peak rate resolved (build copies it: Megatron writes into it)
        self.flags = flags
        self.weight_decay_from_optimizer = weight_decay_from_optimizer

    def build(self, optimizer) -> MegatronScheduleStep:
        from megatron.training.training import get_optimizer_param_scheduler

        args = copy.copy(self.args)
        if self.weight_decay_from_optimizer:   # constant: the optimizer's own weight decay (--weight-decay or JSON)
            decays = {group.get("weight_decay", 0.0) for group in optimizer.param_groups}
            args.start_weight_decay = args.end_weight_decay = decays.pop() if len(decays) == 1 else args.weight_decay
        try:
            with _megatron_global_args(args):
                scheduler = get_optimizer_param_scheduler(optimizer)
        except AssertionError as err:   # Megatron's bare checks (min-lr above lr, warm-up not below decay)
            raise DcpUsageError(f"{', '.join(self.flags)}: Megatron's scheduler refused them "
                                f"({err or 'min-lr <= lr, warm-up shorter than the decay'})") from None
        return MegatronScheduleStep(scheduler, samples_per_update=args.global_batch_size)


def megatron_schedule(args: argparse.Namespace, ds_config: dict) -> MegatronSchedule | None:
    """None without schedule flags (the JSON's scheduler, or none, runs); else Megatron's schedule, checked
    against the JSON (one setting in one place: module docstring) and built once on a stand-in optimizer, so
    a bad setting stops the run before any process group."""
    flags = tuple(getattr(args, "deepspeed_schedule_flags", ()))
    if not flags:
        return None
    if ds_config.get("scheduler"):
        raise DcpUsageError(f"{', '.join(flags)} and the DeepSpeed config's \"scheduler\" block "
                            f"({ds_config['scheduler'].get('type', '?')}) both set the learning-rate schedule: give one "
                            "(the flags run Megatron's own scheduler on DeepSpeed; remove the block, or the flags)")
    params = (ds_config.get("optimizer") or {}).get("params") or {}
    peak_lr = args.lr if args.lr is not None else params.get("lr")
    if peak_lr is None:
        raise DcpUsageError(f"{', '.join(flags)}: give --lr (the peak learning rate Megatron's scheduler shapes)")
    if args.min_lr > peak_lr or args.lr_warmup_init > peak_lr:
        flag, value = ("--min-lr", args.min_lr) if args.min_lr > peak_lr else ("--lr-warmup-init", args.lr_warmup_init)
        raise DcpUsageError(f"{flag} {value} is above the peak learning rate {peak_lr} (--lr, or the DeepSpeed "
                            f"config's optimizer \"lr\"): lower {flag} or raise --lr")
    from dcp_megatron.flags.flag_checks import check_warmup_below_decay

    check_warmup_below_decay(args)   # named as on the Megatron path (Megatron's own check is a bare assert)
    weight_decay_from_optimizer = args.weight_decay_incr_style == "constant"
    if not weight_decay_from_optimizer and "weight_decay" in params:
        raise DcpUsageError(f"--weight-decay-incr-style {args.weight_decay_incr_style} sets the weight decay from "
                            "--start-weight-decay/--end-weight-decay, and the DeepSpeed config's optimizer "
                            f"\"weight_decay\": {params['weight_decay']} (or --weight-decay) sets it too: give one")
    schedule_args = copy.copy(args)
    schedule_args.lr = float(peak_lr)
    schedule = MegatronSchedule(schedule_args, flags=flags, weight_decay_from_optimizer=weight_decay_from_optimizer)
    schedule.build(_ParamGroups(params.get("weight_decay", args.weight_decay)))   # Megatron's checks, at start
    return schedule
