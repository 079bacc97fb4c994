"""Multi-latent attention's saved bytes: the planner's count against megatron-core's MLA layer measured on the meta
device (dcp_megatron/core/memcheck.py), with and without a q latent and `--qk-layernorm`; counting the kernel's
values at v's own head dim (megatron-core pads THD values to the q/k head dim) is off.

One subprocess (megatron-core's model-parallel state and the patch set stay out of this test process)."""
from tests.unit.test_memcheck import run_driver

DRIVER = r'''
import json, sys
sys.path.insert(0, "tools")
import memcheck
from dcp_megatron.core.memcheck import measure
from dcp_megatron.planner.costmodel.cluster import cluster_preset
from dcp_megatron.planner.costmodel.cost import CostModel
from dcp_megatron.planner.costmodel.memory_spec import LOCAL_BF16
from dcp_megatron.planner.costmodel.mla import MlaShape
from dcp_megatron.planner.costmodel.model import ModelShape
from dcp_megatron.planner.plan import NO_RECOMPUTE

def shape(q_lora_rank, qk_layernorm):
    mla = MlaShape(q_lora_rank=q_lora_rank, kv_lora_rank=128, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=24,
                   qk_layernorm=qk_layernorm)
    return ModelShape(num_layers=2, hidden_size=256, num_heads=8, num_kv_heads=8, head_dim=32, ffn_hidden_size=512,
                      vocab_size=1024, transformer_impl="local", activations=LOCAL_BF16, mla=mla)

def unpadded(model):
    return property(lambda m: m.value_head_dim)

out = {}
with memcheck.measuring():
    for q, norm in ((96, False), (None, False), (96, True)):
        model = shape(q, norm)
        got = measure(model, NO_RECOMPUTE, documents=[512, 256, 256])
        layer = sum(got.layer_saved) / got.tokens
        counted = CostModel(model, cluster_preset("h200", domain_size=8)).layer_bytes_per_local_token(NO_RECOMPUTE)
        original = type(model).kernel_value_head_dim
        type(model).kernel_value_head_dim = unpadded(model)
        try:
            as_v = CostModel(model, cluster_preset("h200", domain_size=8)).layer_bytes_per_local_token(NO_RECOMPUTE)
        finally:
            type(model).kernel_value_head_dim = original
        out[f"{q}/{norm}"] = [counted / layer - 1, as_v / layer - 1]
print("RESULT" + json.dumps(out))
'''


def test_mla_layers_counted_as_measured_and_padded_values_matter():
    result = run_driver(DRIVER)
    assert len(result) == 3
    for case, (counted, as_v) in result.items():
        assert abs(counted) <= 0.005, (case, counted)
        assert abs(as_v) > 0.02, (case, as_v)
