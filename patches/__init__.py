"""Every change dcp-megatron makes to upstream code, one file per upstream module.

Each file lists `Patch` entries (see registry.py); nothing is applied on import. The CPU
shims are collected by `dcp_megatron.megatron.compat` and applied only when no GPU is present.
"""

# The megatron-core releases these patches were written against and tested on.
MEGATRON_CORE_VERSIONS = ">=0.16.1,<0.17"
