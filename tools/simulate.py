#!/usr/bin/env python3
"""Thin wrapper: `tools/simulate.py ARGS` is `dcp-simulate ARGS` (see dcp_megatron/simulate.py)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dcp_megatron.simulate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
