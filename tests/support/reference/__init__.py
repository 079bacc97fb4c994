"""The test harness's reference training: a small pure-torch GPT and an engine that runs it through the
planned-step loop users run, for gradient parity and runtime speed (tests, tools/check_parity.py,
tools/bench_runtime.py, tools/profile_cpu.py). It imports the product; the product never imports it.

tiny_gpt.py        TinyGPT: Llama-shaped, its core attention a callable, recompute switched per micro-batch
recompute.py       a micro-batch's `Recompute` set on (and read back from) TinyGPT's switches
loss.py            per-token loss over a step and its deferred gradient reduction
stats.py           every rank's measured step timings next to the plan's prediction
engine.py          `ReferenceEngine`: the loop's `StepEngine` for TinyGPT
single_process.py  random layouts, seeded tokens, the single-device reference step, gradient comparison
parity.py          `ReferenceRun` (TinyGPT over global batches through the loop) and `parity_case`
"""
