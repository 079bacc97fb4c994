"""Switch megatron-core's fine-grained activation offloading per micro-batch (GPU only; docs/megatron.md).

megatron-core 0.19.2 decides offloading per module at construction, from `TransformerConfig.offload_modules`,
into one attribute each module reads at every forward: `Attention.offload_core_attention` ("core_attn": the
inputs q, k, v of core attention), `Attention.offload_attn_proj` ("attn_proj": the input of the output
projection), and on `TEGroupedMLP` experts `offload_expert_fc1` ("expert_fc1") and `offload_moe_act`
("moe_act"). When a flag is on, the module's forward opens an offload group: the tensors autograd saves inside it
go to pinned host memory on a side stream at the group's end and come back before its backward
(pipeline_parallel/fine_grained_activation_offload.py). Once the forward has run, that decision lives in the
autograd graph (the group's start/commit functions and the saved-tensor hooks' tags): backward reads no flag.

So DCP builds the model with every offloadable module's machinery in place (training/checks/offload_checks.py
turns on `--fine-grained-activation-offloading` with `OFFLOAD_MODULES`) and switches the flags per micro-batch:
the plan's `offload` set just for the micro-batch's forward step, every flag off outside it
(`DcpForwardStep`). Off at rest is what a recompute replay in backward must see: the planner never offloads a
module its own micro-batch recomputes (no offload under full recompute, none inside a recomputed MoE layer), so
a replay of any micro-batch offloads nothing, also when (under 1F1B) a later micro-batch's forward ran in
between. The manager's per-step state is patched (patches/pipeline_parallel_fine_grained_activation_offload.py):
every DCP step is its own warm-up, since its micro-batches and their offload sets are new each step.
"""
from __future__ import annotations

from dcp_megatron.core.recompute import decoder_layers

# What DCP builds the layers with (--offload-modules): every offload the planner's menu has (planner/costmodel/relief.py
# ATTENTION_OFFLOADS, MOE_OFFLOADS), the MoE ones only on a MoE model.
ATTENTION_OFFLOAD_MODULES = ("core_attn", "attn_proj")
MOE_OFFLOAD_MODULES = ("expert_fc1", "moe_act")


# The attribute on megatron-core's PipelineOffloadManager singleton that marks it as run by DCP's steps (the patch
# reads it; a manager without it behaves as upstream).
DCP_STEPS_ATTR = "dcp_own_warmup_every_step"


def offload_modules_for(*, is_moe: bool) -> list[str]:
    """The --offload-modules a run whose menu has "offload" is built with."""
    return list(ATTENTION_OFFLOAD_MODULES + (MOE_OFFLOAD_MODULES if is_moe else ()))


def _switches(layers) -> list[tuple[object, str, str]]:
    """(module, attribute, offload name) of every offload switch of these layers that megatron-core reads at
    forward (the layer's own `offload_core_attn` / `offload_attn_proj` are read at construction only)."""
    out = []
    for layer in layers:
        attention = layer.self_attention
        out.append((attention, "offload_core_attention", "core_attn"))
        out.append((attention, "offload_attn_proj", "attn_proj"))
        if getattr(layer, "is_moe_layer", False):
            experts = layer.mlp.experts
            for attribute, name in (("offload_expert_fc1", "expert_fc1"), ("offload_moe_act", "moe_act")):
                if hasattr(experts, attribute):   # TEGroupedMLP only; offload_checks refuses MoE without it
                    out.append((experts, attribute, name))
    return out


def switchable_offloads(layers) -> frozenset[str]:
    """The offload names these layers can switch (every layer alike)."""
    return frozenset(name for _, _, name in _switches(layers))


def apply_offload(model, offload: frozenset[str]) -> None:
    """Offload exactly the modules in `offload` in every layer of `model` (a model chunk); all off for an empty set.

    A name the layers cannot offload (e.g. expert_fc1 on local-spec experts) is an error, not a silent no-op:
    the plan counted its memory as freed."""
    layers = decoder_layers(model)
    switches = _switches(layers)
    missing = set(offload) - {name for _, _, name in switches}
    if missing:
        raise ValueError(f"the plan offloads {sorted(missing)}, which these layers cannot offload (megatron-core "
                         "offloads expert_fc1 / moe_act in TEGroupedMLP experts only)")
    for module, attribute, name in switches:
        setattr(module, attribute, name in offload)


def switch_offload(model_chunks, model_config, offload: frozenset[str]) -> None:
    """Every model chunk's offload switches set to `offload`: a micro-batch's plan set before its forward step,
    the empty set after it. A plan that offloads on a model built without the machinery is an error (upstream
    would run the forward without offloading, silently: the manager has no handler for it)."""
    if not offload_built(model_config):
        if offload:
            raise ValueError(f"the plan offloads {sorted(offload)}, but the model was built without "
                             "--fine-grained-activation-offloading (DCP turns it on at start when --dcp-recompute "
                             "allows offload on a GPU)")
        return
    for chunk in model_chunks:
        apply_offload(chunk, offload)


def offload_on(layers) -> frozenset[str] | None:
    """The offload names every one of `layers` has switched on (None when the layers disagree)."""
    on = [frozenset(name for module, attribute, name in _switches([layer]) if getattr(module, attribute, False))
          for layer in layers]
    if not on:
        return frozenset()
    return on[0] if all(s == on[0] for s in on) else None


def offload_built(model_config) -> bool:
    """Whether the run's layers carry megatron-core's offload machinery (DCP turned it on at start)."""
    return bool(getattr(model_config, "fine_grained_activation_offloading", False))


def own_warmup_every_step() -> None:
    """Put megatron-core's offload manager (created here: CUDA streams, GPU only) into DCP's mode, where every
    step is its own warm-up (patches/pipeline_parallel_fine_grained_activation_offload.py). Idempotent."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager

    manager = PipelineOffloadManager.get_instance()
    setattr(manager, DCP_STEPS_ATTR, True)
    manager.reset()   # marked: drops any layout an earlier forward (evaluation) froze, and warms up afresh
