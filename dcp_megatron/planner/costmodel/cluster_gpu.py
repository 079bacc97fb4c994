"""Datasheet numbers of the GPUs a run picks its cluster preset by (planner/costmodel/cluster.py builds the presets).

Only the H200 preset carries a measured number (its bf16 GEMM rate, ~790 of 989 TFLOP/s on a large GEMM); the
others are datasheet values scaled the same way: achieved GEMM rate = datasheet dense rate x 0.8 (the H200's
measured/datasheet ratio) x 0.75 (what whole layers reach of a large GEMM), attention rates the H200 table scaled
by the dense bf16 ratio, and none measured. `dcp-profile` measures a device's rates into a profile
(`--dcp-profile`), which overrides every number here. Sources (NVIDIA datasheets, dense = half the sparse figure):

- H100 SXM5 80 GB: "NVIDIA H100 Tensor Core GPU" datasheet: bf16 989 TFLOP/s, FP8 1,979, HBM3 80 GB, NVLink
  900 GB/s, PCIe Gen5 (64 GB/s a direction).
- H100 PCIe 80 GB: same datasheet, PCIe column: bf16 756 TFLOP/s, FP8 1,513, HBM2e 80 GB, NVLink bridge 600 GB/s
  (between two cards only: pairs), PCIe Gen5.
- H200 SXM 141 GB: "NVIDIA H200 Tensor Core GPU" datasheet: bf16 989, FP8 1,979, HBM3e 141 GB, NVLink 900 GB/s.
- A100 SXM4 40 GB / 80 GB: "NVIDIA A100 Tensor Core GPU" datasheet: bf16 312 TFLOP/s, no FP8, HBM2 40 GB /
  HBM2e 80 GB, NVLink 600 GB/s, PCIe Gen4 (32 GB/s a direction); DGX A100: one 200 Gb/s HDR port per GPU.
- B200 (HGX B200): "NVIDIA DGX B200" datasheet: 72 PFLOP/s FP8 training over 8 GPUs with sparsity, i.e.
  4.5 PFLOP/s dense FP8 and 2.25 dense bf16 per GPU; 1,440 GB HBM3e over 8 (180 GB); NVLink 5 1.8 TB/s per GPU;
  ConnectX-7 400 Gb/s per GPU.

Inter-node bandwidth: one 400 Gb/s InfiniBand port per GPU (50 GB/s) unless noted. Host link (activation offload):
~80% of the PCIe datasheet rate a direction, an estimate.
"""
from __future__ import annotations

H200_GEMM_RATIO = 790.0 / 989.0   # measured / datasheet bf16 GEMM rate on an H200 (cluster.py _h200)
LAYER_SHARE = 0.75                # what whole layers reach of a large GEMM's rate

# name: (datasheet dense bf16 FLOP/s, dense FP8 FLOP/s (0: none), memory bytes, NVLink bytes/s per GPU both ways,
#        inter-node bytes/s per GPU, host link bytes/s one way)
GPU_DATASHEETS: dict[str, tuple[float, float, int, float, float, float]] = {
    "h100-sxm": (989e12, 1979e12, 80 * 10 ** 9, 900e9, 400e9 / 8, 50e9),
    "h100-pcie": (756e12, 1513e12, 80 * 10 ** 9, 600e9, 400e9 / 8, 50e9),
    "a100-40gb": (312e12, 0.0, 40 * 10 ** 9, 600e9, 200e9 / 8, 25e9),
    "a100-80gb": (312e12, 0.0, 80 * 10 ** 9, 600e9, 200e9 / 8, 25e9),
    "b200": (2250e12, 4500e12, 180 * 10 ** 9, 1800e9, 400e9 / 8, 50e9),
}
H200_BF16_FLOPS = 989e12   # the H200 preset's datasheet rate, for scaling its attention table
