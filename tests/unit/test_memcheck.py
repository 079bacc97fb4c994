"""tools/memcheck.py: the planner's count of every relief within 2% of megatron-core's stack measured on the meta
device, and off by more when a term of the count is dropped (the v view of the qkv block, the torch norm's fp32
copies, the output layer's per-token bytes, the backward's gradients, megatron-core's offload margin).

One subprocess (megatron-core's model-parallel state and the patch set stay out of this test process)."""
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

DRIVER = r'''
import contextlib, json, sys
sys.path.insert(0, "tools")
import memcheck
from dcp_megatron.planner.costmodel import activations, cost_memory, relief

def dropping(module, name, replace):
    @contextlib.contextmanager
    def patched():
        original = getattr(module, name)
        setattr(module, name, replace(original))
        try:
            yield
        finally:
            setattr(module, name, original)
    return patched

def without(tensor):
    return dropping(activations, "spec_layer_tensors",
                    lambda f: lambda m, s: {k: v for k, v in f(m, s).items() if k != tensor})

MUTATIONS = {
    "counted": contextlib.nullcontext,
    "no v view": without("core_attn_in"),
    "no norm copies": without("attn_norm_in"),
    "no output per token": dropping(cost_memory, "spec_output_bytes", lambda f: lambda m, s: (f(m, s)[0], 0.0)),
    "no gradients": dropping(relief, "spec_gradient_bytes", lambda f: lambda m, s: (0.0, 0.0)),
    "no offload margin": dropping(relief, "OFFLOAD_KEPT_LAYERS", lambda v: 0),
}
SOME = ("none", "none+offload(core_attn)", "full3")
out = {}
with memcheck.measuring():
    for preset, names in (("llama3-8b", list(MUTATIONS)), ("mixtral-8x7b", ["counted", "no gradients"])):
        for name in names:
            with MUTATIONS[name]():     # a mutation on the reliefs it changes
                rows = memcheck.check_preset(preset, 3, [1024, 512, 512], unfused_swiglu=False,
                                             only=None if name == "counted" else SOME)
            out[f"{preset}/{name}"] = [max(abs(r["saved_error"]), abs(r["peak_error"])) for r in rows if "not_run" not in r]
print("RESULT" + json.dumps(out))
'''


def run_driver(driver: str) -> dict:
    """The driver's RESULT line, run in a subprocess of the worktree."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", driver], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("RESULT", 1)[1])


def test_counted_within_two_percent_of_measured_and_each_term_matters():
    result = run_driver(DRIVER)
    for preset in ("llama3-8b", "mixtral-8x7b"):
        counted = result[f"{preset}/counted"]
        assert len(counted) >= 8 and max(counted) <= 0.02, (preset, counted)
    for name in ("no v view", "no norm copies", "no output per token", "no offload margin"):
        assert max(result[f"llama3-8b/{name}"]) > 0.02, (name, result[f"llama3-8b/{name}"])
    assert max(result["mixtral-8x7b/no gradients"]) > 0.02, result["mixtral-8x7b/no gradients"]


def test_probes_count_each_storage_once_and_the_peak_between_operators():
    """A view of a saved tensor and the tensor saved twice are one allocation; the live-bytes peak holds what was
    alive together and forgets a weight gradient from its birth on."""
    import torch

    from dcp_megatron.runtime.memory_probe import LiveBytes, SavedBytes

    weight = torch.ones(8, 8, requires_grad=True)
    x = torch.ones(16, 8, requires_grad=True)
    saved = SavedBytes(exclude=[weight])
    with saved:
        y = x * 2.0                                       # saves nothing of x (a constant factor)
        z = y[:, :4] * y[:, 4:]                           # saves two views of y: one storage
        out = (z @ weight[:4, :4]).sum()                  # saves z (the weight excluded)
    assert saved.bytes_by_bucket() == {"outside": 16 * 8 * 4 + 16 * 4 * 4}
    live = LiveBytes()
    with live:
        a = torch.ones(1000)                              # 4,000 B
        b = a * 2                                         # before it: a
        del a
        c = b + 1                                         # before it: b
        grad = torch.ones(5000)                           # 20,000 B, then known to be a weight's gradient
        d = c * 3                                         # before it: b, c and grad, 28,000 B
        live.forget(grad)                                 # never counted: b and c, 8,000 B before d
    assert live.peak == 12000 and out.requires_grad and d.numel() == 1000   # b, c and d at the end
