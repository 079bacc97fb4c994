"""--dcp-policy-setting: a baseline's run-wide setting from the command line, checked at start, planned with.

One process: the flag parsed by the --dcp group's own parser, DcpConfig's refusals, the start-up check, and the
plan a run makes at run time (core/planning.py) with the setting vs the policy's default.
"""
import argparse
import json

import pytest

from dcp_megatron.config import DcpConfig, DcpUsageError
from dcp_megatron.core.planning import build_cost_model, check_longest_fits, plan_global_batch
from dcp_megatron.flags.dcp_flags import add_dcp_arguments, dcp_config_from_args
from dcp_megatron.planner.costmodel.memory_spec import CPU_FP32
from dcp_megatron.planner.costmodel import ModelShape
from dcp_megatron.planner.plan import Recompute
from dcp_megatron.planner.baselines.settings import DynamicSetting, StaticSetting, setting_from_json

SEQ = 2048
# the demo's model (tools/demo.py) on 2 CPU ranks with its 0.033 GiB budget, counted as the CPU run keeps it
SHAPE = ModelShape(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, ffn_hidden_size=384,
                   vocab_size=384, transformer_impl="local", activations=CPU_FP32)


def config_of(*flags: str) -> DcpConfig:
    parser = add_dcp_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--dcp", "--dcp-memory-budget-gb", "0.033", "--dcp-no-refine", *flags])
    args.seq_length, args.log_interval, args.train_iters = SEQ, 1, 10
    return dcp_config_from_args(args)


def test_the_flag_parses_into_the_policys_setting_and_back():
    dynamic = config_of("--dcp-policy", "megatron-dynamic", "--dcp-policy-setting",
                        '{"token_cap": 512, "min_cp_size": 2, "recompute": {"full_layers": 2}}')
    assert dynamic.policy_setting == DynamicSetting(token_cap=512, min_cp_size=2, recompute=Recompute("full", 2))
    assert setting_from_json(json.loads(json.dumps(dynamic.policy_setting.to_json()))) == dynamic.policy_setting
    static = config_of("--dcp-policy", "static", "--dcp-policy-setting", '{"cp_size": 2, "recompute": "selective"}')
    assert static.policy_setting == StaticSetting(cp_size=2, recompute=Recompute("selective"))
    assert config_of("--dcp-policy", "megatron-dynamic").policy_setting is None   # the default setting
    # min_cp_size is optional (1)
    assert config_of("--dcp-policy", "megatron-hybrid", "--dcp-policy-setting",
                     '{"token_cap": 512, "recompute": "none"}').policy_setting.min_cp_size == 1


@pytest.mark.parametrize("flags, says", [
    (["--dcp-policy-setting", '{"token_cap": 512, "recompute": "none"}'], "takes no setting"),   # dcp
    (["--dcp-policy", "dcp", "--dcp-policy-setting", '{"cp_size": 2, "recompute": "none"}'], "takes no"),
    (["--dcp-policy", "static", "--dcp-policy-setting", '{"token_cap": 512, "recompute": "none"}'],
     "got keys ['recompute', 'token_cap']"),                                   # a dynamic setting for static
    (["--dcp-policy", "megatron-dynamic", "--dcp-policy-setting", '{"token_cap": 512, "recompute": "none", '
      '"cap": 3}'], "got keys"),                                               # an unknown key
    (["--dcp-policy", "megatron-dynamic", "--dcp-policy-setting", '{"token_cap": 512}'], "got keys"),  # missing
    (["--dcp-policy", "megatron-dynamic", "--dcp-policy-setting", '{"token_cap": 512, "recompute": "most"}'],
     "recompute must be"),
    (["--dcp-policy", "megatron-dynamic", "--dcp-policy-setting", '{"token_cap": 0, "recompute": "none"}'],
     "token_cap must be a positive int"),
    (["--dcp-policy", "static", "--dcp-policy-setting", "cp_size=2"], "Expecting value"),   # not JSON
])
def test_a_bad_setting_is_refused_naming_the_flag(flags, says):
    with pytest.raises(DcpUsageError, match="--dcp-policy-setting") as err:
        config_of(*flags)
    assert says in str(err.value)


def test_dcp_config_refuses_a_setting_of_the_wrong_kind_or_for_dcp():
    dynamic = DynamicSetting(token_cap=512, recompute=Recompute())
    with pytest.raises(DcpUsageError, match="not of --dcp-policy static"):
        DcpConfig(policy="static", seq_length=SEQ, policy_setting=dynamic)
    with pytest.raises(DcpUsageError, match="takes no setting"):
        DcpConfig(policy="dcp", seq_length=SEQ, policy_setting=dynamic)
    with pytest.raises(DcpUsageError, match="must be a run-wide setting"):
        DcpConfig(policy="megatron-dynamic", seq_length=SEQ, policy_setting={"token_cap": 512})


def test_a_setting_that_cannot_run_a_full_length_document_is_refused_at_start():
    for flags in (["--dcp-policy", "static", "--dcp-policy-setting", '{"cp_size": 1, "recompute": "none"}'],
                  ["--dcp-policy", "megatron-dynamic", "--dcp-policy-setting", '{"token_cap": 256, "recompute": '
                   '"none"}']):   # 2048 tokens on one rank / a cap under the document's share of CP 2
        config = config_of(*flags)
        cost = build_cost_model(config, SHAPE, domain_size=2, has_gpu=False)
        with pytest.raises(DcpUsageError, match="--dcp-policy-setting .* cannot run a --seq-length 2048"):
            check_longest_fits(config, cost)


def microbatches(plan):
    return [mb for wave in plan.waves for group in wave.groups for mb in group.microbatches]


def test_the_run_time_plan_follows_the_setting():
    batch = [(i, n) for i, n in enumerate([2048, 700, 600, 300, 300, 200, 200, 120, 100, 90, 80, 60, 50, 40])]
    more = ("--dcp-memory-budget-gb", "0.1")   # the default: cap 1822 tokens per rank, no recompute
    default = config_of("--dcp-policy", "megatron-dynamic", *more)
    cost = build_cost_model(default, SHAPE, domain_size=2, has_gpu=False)
    check_longest_fits(default, cost)
    cap = 1024   # the document's share of CP 2 still fits, so the setting runs
    tuned = config_of("--dcp-policy", "megatron-dynamic", *more, "--dcp-policy-setting",
                      json.dumps({"token_cap": cap, "min_cp_size": 1, "recompute": "selective"}))
    check_longest_fits(tuned, cost)
    before, after = plan_global_batch(default, batch, cost), plan_global_batch(tuned, batch, cost)
    assert {mb.recompute for mb in microbatches(before)} == {Recompute()}
    assert {mb.recompute for mb in microbatches(after)} == {Recompute("selective")}   # the setting's recompute
    assert len(microbatches(after)) > len(microbatches(before))             # the smaller cap: more micro-batches
    static = config_of("--dcp-policy", "static", *more, "--dcp-policy-setting", '{"cp_size": 2, "recompute": '
                       '{"full_layers": 4}}')
    plan = plan_global_batch(static, batch, cost)
    assert {mb.recompute for mb in microbatches(plan)} == {Recompute("full", 4)}


def test_the_deepspeed_script_carries_the_setting_too():
    from dcp_megatron.deepspeed.config import dcp_config

    setting = DynamicSetting(token_cap=1024, recompute=Recompute("selective"))
    common = dict(seq_length=SEQ, train_iters=10, log_interval=1, dcp_flag=True, domain_size=2)
    config = dcp_config({"dcp": {"policy": "megatron-dynamic"}}, cli={"policy_setting": setting}, **common)
    assert config.policy_setting == setting
    with pytest.raises(DcpUsageError, match="not of --dcp-policy dcp"):   # the block's policy: dcp takes none
        dcp_config({"dcp": {"policy": "dcp"}}, cli={"policy_setting": setting}, **common)
