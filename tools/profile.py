#!/usr/bin/env python3
"""Thin wrapper: `tools/profile.py ARGS` is `dcp-profile ARGS` (see dcp_megatron/profile.py)."""
import os
import sys

if __name__ != "__main__":
    # Imported as `profile` because tools/ is on sys.path (every `python tools/X.py` puts it first): the
    # standard library's cProfile, which torch.distributed.checkpoint imports, needs the real module.
    import importlib.util
    import sysconfig

    _spec = importlib.util.spec_from_file_location("profile", os.path.join(sysconfig.get_paths()["stdlib"], "profile.py"))
    _stdlib_profile = importlib.util.module_from_spec(_spec)
    sys.modules["profile"] = _stdlib_profile
    _spec.loader.exec_module(_stdlib_profile)
else:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    from dcp_megatron.profile import main

    sys.exit(main())
