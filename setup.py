from setuptools import find_packages, setup

setup(
    name="dcp-megatron",
    version="0.1.0",
    description="Data-Centric Parallel training for Megatron-core and DeepSpeed",
    python_requires=">=3.12",
    packages=find_packages(include=["dcp_megatron", "dcp_megatron.*", "patches", "patches.*"]),
    install_requires=["numpy>=1.24"],
    extras_require={
        # torch itself is installed first, pinned (see Makefile): an unpinned torch pulls CUDA.
        "megatron": ["megatron-core==0.19.2"],
        "deepspeed": ["deepspeed==0.19.8"],
        # The GPU path as written against megatron-core 0.19.2 (Megatron-LM core_v0.19.0 is tested with TE 2.17.1),
        # for torch 2.13's CUDA 13 wheels; transformer_engine_torch builds against the installed torch:
        # `pip install --no-build-isolation .[gpu]`. No flash-attn (TE's own fused attention runs THD + CP);
        # apex is not on PyPI (build NVIDIA/apex with its CUDA extensions, or run without: --dcp turns
        # gradient-accumulation fusion off when apex's kernel is missing).
        "gpu": ["transformer-engine[pytorch,core_cu13]>=2.17.1,<2.18"],
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist>=3.5", "hypothesis>=6", "matplotlib>=3.7", "highspy>=1.7",
                 "tensorboard>=2.14"],   # reads back the DCP scalars a --dcp run writes
    },
    entry_points={"console_scripts": ["dcp-simulate=dcp_megatron.simulate:main",
                                     "dcp-profile=dcp_megatron.profile:main"]},
)
