"""The memory probe's micro-batches: one per relief kind on the menu, each the largest the planner allows."""
import pytest

from dcp_megatron.planner.costmodel import CostModel, cluster_preset, model_preset
from dcp_megatron.planner.padding import local_tokens
from dcp_megatron.training.memory_probe_run import ProbeRow, probe_lengths, probe_line, probe_reliefs

COST = CostModel(model_preset("llama3-8b"), cluster_preset("h200", domain_size=8),
                 allowed_recompute=("none", "selective", "mlp", "full"))


def test_each_light_relief_and_full_recompute_of_every_layer_is_probed():
    names = [str(r) for r in probe_reliefs(COST)]
    assert names[0] == "none" and names[-1] == f"full{COST.layers_per_stage}"
    assert {"selective", "mlp"} <= set(names) and sum(n.startswith("full") for n in names) == 1


@pytest.mark.parametrize("max_local, seq_length, expected", [
    (20_001, 8192, (8192, 8192, 3616)), (8192, 8192, (8192,)), (5, 8192, (4,)), (1, 8192, ()),
    (100, 33, (32, 32, 32, 4))])
def test_probe_documents_fill_the_planners_largest_micro_batch_at_cp1(max_local, seq_length, expected):
    lengths = probe_lengths(max_local, seq_length)
    assert lengths == expected
    assert sum(int(local_tokens(n, 1)) for n in lengths) <= max_local


def test_the_largest_allowed_micro_batch_fits_and_two_more_tokens_would_not():
    for relief in probe_reliefs(COST):
        lengths = probe_lengths(COST.max_local_tokens(relief), 131_072)
        assert COST.microbatch_memory(list(lengths), 1, recompute=relief) <= COST.cluster.mem_budget_bytes
        assert COST.microbatch_memory([*lengths, 2], 1, recompute=relief) > COST.cluster.mem_budget_bytes, relief


def test_the_probe_line_names_the_relief_counted_measured_and_factor():
    line = probe_line(ProbeRow("mlp", (1024, 512), counted_bytes=2 * 1024 ** 3, measured_bytes=3 * 1024 ** 3),
                      worst_ratio=1.6, factor=1.68, kind="peak")
    assert line == (" dcp memory probe | relief mlp | 2 documents, 1536 tokens at CP 1 | peak above the static state: "
                    "counted 2.0000 GiB, measured 3.0000 GiB on this rank (x1.50; worst rank x1.60) | factor x1.68")


def test_a_probe_that_ran_out_of_memory_raises_its_relief_and_says_so():
    """The probe's own out-of-memory (training/memory_probe_run.py): its relief reads as counted x a raise above
    1/0.95 (on an emulated device, how far its activations went past the room beside the model states), and the
    line says the run goes on."""
    from dcp_megatron.core.out_of_memory import LIMIT_HEADROOM
    from dcp_megatron.runtime.device_ceiling import DeviceCeiling
    from dcp_megatron.training.memory_probe_run import ProbeRow, out_of_memory_ratio, probe_line

    assert out_of_memory_ratio(None, None) == pytest.approx(1 / LIMIT_HEADROOM)
    ceiling = DeviceCeiling(1000, existing=[])
    ceiling.attempted_bytes = 1300
    # static 400: room 600, the activations reached 900: x1.5, with the headroom
    assert out_of_memory_ratio(ceiling, 400) == pytest.approx(1.5 / LIMIT_HEADROOM)
    ceiling.attempted_bytes = 950    # (a reading below the room)
    assert out_of_memory_ratio(ceiling, 400) == pytest.approx(1 / LIMIT_HEADROOM)   # never below the floor
    row = ProbeRow(relief="none", lengths=(1024, 954), counted_bytes=100.0, measured_bytes=150.0, out_of_memory=True)
    line = probe_line(row, worst_ratio=1.5, factor=1.58, kind="saved")
    assert "relief none" in line and "out of memory on this rank: its count raised x1.50" in line
    assert "the run goes on" in line
