#!/usr/bin/env python3
"""Thin wrapper: `tools/profile.py ARGS` is `dcp-profile ARGS` (see dcp_megatron/profile.py)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dcp_megatron.profile import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
