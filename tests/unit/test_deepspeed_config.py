"""The DeepSpeed "dcp" block, the ZeRO checks and the flag precedence (no process group, no DeepSpeed import)."""
from __future__ import annotations

import pytest

from dcp_megatron.deepspeed.config import dcp_block_settings, dcp_config, prepare_deepspeed_config
from dcp_megatron.config import DcpUsageError

NO_FLAGS = {"policy": None, "max_cp_size": None, "recompute": None}


def _config(block=None, *, flag=False, domain_size=None, **cli):
    ds = {"zero_optimization": {"stage": 1}}
    if block is not None:
        ds["dcp"] = block
    return dcp_config(ds, cli={**NO_FLAGS, **cli}, seq_length=1024, train_iters=10, log_interval=1, dcp_flag=flag,
                      domain_size=domain_size)


def test_block_turns_dcp_on_and_flags_win_over_it():
    config = _config({"enabled": True, "max_cp_size": 4, "recompute": ["none", "full"], "refine": False},
                     max_cp_size=2)
    assert config.max_cp_size == 2 and config.recompute == ("none", "full") and config.refine is False
    assert _config(flag=True, max_cp_size=2).max_cp_size == 2
    assert _config() is None and _config({"enabled": False}) is None


@pytest.mark.parametrize("block, message", [
    ({"enabled": True, "max_cp": 2}, "unknown key(s) ['max_cp']"),
    ({"enabled": "yes"}, '"enabled": "yes"'),
    ({"enabled": True, "max_cp_size": 2.5}, '"max_cp_size": 2.5'),
    ({"enabled": True, "max_cp_size": True}, '"max_cp_size": true'),
    ({"enabled": True, "recompute": ["none", "everything"]}, "non-empty list"),
    ({"enabled": True, "recompute": []}, "non-empty list"),
    ({"enabled": True, "recompute": ["none", "offload"]}, "runs on GPU only"),   # megatron.training --dcp only
    ({"enabled": True, "memory_budget_gb": -1}, "--dcp-memory-budget-gb must be a positive"),
    ({"enabled": True, "device_memory_gb": 0}, "--dcp-device-memory-gb must be a positive"),
    ({"enabled": True, "policy": "fastest"}, "is not one of"),
    ({"enabled": True, "profile": "/nonexistent/profile.json"}, "no such file"),
    ([1, 2], 'must be an object'),
])
def test_bad_blocks_are_refused_with_the_key(block, message):
    with pytest.raises(DcpUsageError) as err:
        _config(block)
    assert message in str(err.value)


def test_dcp_settings_without_dcp_are_refused():
    with pytest.raises(DcpUsageError, match="only take effect with --dcp"):
        _config(max_cp_size=2)
    with pytest.raises(DcpUsageError, match="only take effect with --dcp"):
        _config({"max_cp_size": 2})


def test_block_values_pass_through():
    assert dcp_block_settings(None) == {}
    assert dcp_block_settings({"memory_budget_gb": 60, "dump_plans": "plans"}) == {
        "memory_budget_gb": 60, "dump_plans": "plans"}


@pytest.mark.parametrize("ds, message", [
    ({"zero_optimization": {"stage": 7}}, "is not a ZeRO stage"),
    ({"zero_optimization": "1"}, "must be an object"),
    ({"gradient_accumulation_steps": 8}, '"gradient_accumulation_steps": 8'),
    ({"train_micro_batch_size_per_gpu": 4}, '"train_micro_batch_size_per_gpu": 4'),
    ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, '"bf16" and "fp16" are both enabled'),
])
def test_unsupported_engine_settings_are_refused(ds, message):
    with pytest.raises(DcpUsageError) as err:
        prepare_deepspeed_config(ds)
    assert message in str(err.value)


def test_zero3_runs_recompute_shared_by_each_wave():
    """ZeRO-3 is prepared as given (lockstep plans carry it); recompute runs (the planner gives each wave one relief,
    ModelShape.wave_uniform_relief): the default menu when --dcp-recompute is not given, the kinds as given; what
    stage 3 does not run (activation offloading) is refused naming the flag (config.stage3_recompute)."""
    ds = {"zero_optimization": {"stage": 3}, "dcp": {"enabled": True}}
    assert prepare_deepspeed_config(ds)["zero_optimization"] == {"stage": 3}

    def config(**cli):
        return dcp_config(ds, cli={**NO_FLAGS, **cli}, seq_length=1024, train_iters=10, log_interval=1,
                          dcp_flag=False, stage=3)

    assert config().recompute == ("none", "selective", "full", "mlp")   # the default menu, as at other stages
    assert config(recompute=("none", "full")).recompute == ("none", "full")
    with pytest.raises(DcpUsageError, match="--dcp-recompute \\(or \"dcp\" recompute\\) none,offload: drop 'offload' "
                                            "\\(ZeRO stage 3"):
        config(recompute=("none", "offload"))
    assert _config(flag=True).recompute == ("none", "selective", "full", "mlp")


def test_prepared_config_runs_one_micro_batch_per_engine_step():
    user = {"zero_optimization": {"stage": 2}, "train_batch_size": 64, "dcp": {"enabled": True},
            "gradient_accumulation_steps": 1}
    prepared = prepare_deepspeed_config(user)
    assert "dcp" not in prepared and "train_batch_size" not in prepared
    assert prepared["train_micro_batch_size_per_gpu"] == 1 and prepared["gradient_accumulation_steps"] == 1
    assert user["dcp"] == {"enabled": True}, "the user's dict must not be changed"


def test_max_cp_size_over_the_world_is_refused_not_clamped():
    with pytest.raises(DcpUsageError, match='"dcp" max_cp_size\\) 3 exceeds the DCP domain of 2 ranks'):
        _config({"enabled": True, "max_cp_size": 3}, domain_size=2)
    with pytest.raises(DcpUsageError, match="3 exceeds the DCP domain of 2 ranks"):
        _config(flag=True, max_cp_size=3, domain_size=2)
    assert _config({"enabled": True, "max_cp_size": 2}, domain_size=2).max_cp_size == 2


def test_train_batch_size_and_global_batch_size_are_one_setting():
    from dcp_megatron.deepspeed.config import batch_size_of_config

    assert batch_size_of_config({"train_batch_size": 16}, global_batch_size=None) == 16
    assert batch_size_of_config({"train_batch_size": 16}, global_batch_size=16) == 16
    assert batch_size_of_config({}, global_batch_size=8) == 8 and batch_size_of_config({}, global_batch_size=None) is None
    with pytest.raises(DcpUsageError, match='"train_batch_size": 16 in the DeepSpeed config disagrees with '
                                            '--global-batch-size 8'):
        batch_size_of_config({"train_batch_size": 16}, global_batch_size=8)
    with pytest.raises(DcpUsageError, match="must be a positive integer"):
        batch_size_of_config({"train_batch_size": "16"}, global_batch_size=None)


def test_resume_of_zero_partitions_on_another_world_size_is_refused(tmp_path):
    from dcp_megatron.deepspeed.checkpoint import check_zero_world_size

    tag = tmp_path / "iter_0000002"
    tag.mkdir()
    for rank in range(2):
        (tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"x")
    stage1 = {"zero_optimization": {"stage": 1}}
    with pytest.raises(DcpUsageError, match="partitioned over 2 data-parallel ranks and this run has 1"):
        check_zero_world_size(str(tmp_path), str(tag), stage1, world_size=1)
    check_zero_world_size(str(tmp_path), str(tag), stage1, world_size=2)
    # ZeRO-3's weights and optimizer states are partitioned alike (saved as the same per-rank files)
    with pytest.raises(DcpUsageError, match="partitioned over 2 data-parallel ranks and this run has 1"):
        check_zero_world_size(str(tmp_path), str(tag), {"zero_optimization": {"stage": 3}}, world_size=1)
    check_zero_world_size(str(tmp_path), str(tag), {"zero_optimization": {"stage": 0}}, world_size=1)


def test_megatron_optimizer_flags_are_written_into_the_json():
    """megatron_flags.py: a given flag writes its key where the JSON has none, agrees where it has one."""
    from dcp_megatron.deepspeed.megatron_flags import apply_megatron_flags

    user = {"zero_optimization": {"stage": 1}, "scheduler": {"type": "WarmupCosineLR", "params": {}}}
    config = apply_megatron_flags(user, {"--lr": 2e-4, "--adam-beta2": 0.95, "--weight-decay": 0.1,
                                         "--clip-grad": 0.5, "--bf16": True})
    assert config["optimizer"] == {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}}
    assert config["gradient_clipping"] == 0.5 and config["bf16"] == {"enabled": True}
    assert "optimizer" not in user, "the user's dict must not be changed"
    # the same value in both: accepted; the JSON's Adam (decoupled by default) is Megatron's adam
    same = {"optimizer": {"type": "Adam", "params": {"lr": 2e-4, "betas": [0.9, 0.95]}}, "gradient_clipping": 1.0}
    assert apply_megatron_flags(same, {"--lr": 2e-4, "--adam-beta1": 0.9, "--clip-grad": 1.0, "--optimizer": "adam"}) == same
    # --optimizer sgd takes Megatron's momentum where the JSON has none
    sgd = apply_megatron_flags({}, {"--optimizer": "sgd", "--lr": 0.1}, sgd_momentum=0.9)
    assert sgd["optimizer"] == {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
    assert apply_megatron_flags(same, {}) == same   # no flag: the JSON as it is


@pytest.mark.parametrize("ds, flags, message", [
    ({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}, {"--lr": 1e-3},
     '--lr 0.001 disagrees with the DeepSpeed config\'s "optimizer" "params" "lr": 0.0003'),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95]}}}, {"--adam-beta2": 0.999}, '"betas"[1]: 0.95'),
    ({"gradient_clipping": 1.0}, {"--clip-grad": 0.0}, '--clip-grad 0.0 disagrees with the DeepSpeed config\'s '
                                                       '"gradient_clipping": 1.0'),
    ({"optimizer": {"type": "SGD"}}, {"--optimizer": "adam"}, '--optimizer adam disagrees'),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, {"--optimizer": "adam"}, '"type": "Adam"'),
    ({}, {"--optimizer": "lion"}, "maps only adam and sgd"),
    ({"fp16": {"enabled": True}}, {"--bf16": True}, '--bf16 disagrees with the DeepSpeed config\'s "fp16"'),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3}}}, {"--lr": 2e-3}, '"warmup_max_lr": 0.001'),
])
def test_megatron_flags_that_disagree_with_the_json_are_refused(ds, flags, message):
    from dcp_megatron.deepspeed.megatron_flags import apply_megatron_flags

    with pytest.raises(DcpUsageError) as err:
        apply_megatron_flags(ds, flags)
    assert message in str(err.value)
