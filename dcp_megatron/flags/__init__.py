"""Megatron's flags as both engines read them (both parse Megatron's arguments): the `--dcp*` group and the run's
`DcpConfig` from them (`dcp_flags.py`), and the start-up checks both run: data files, run paths, flags this machine
cannot run, FP8 alignment, CPU defaults, and the one-line refusal that ends a start."""
