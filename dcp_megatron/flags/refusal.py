"""A refused start ends the same way whichever way the run came in: one line, exit status 2.

Ways in: `torchrun -m dcp_megatron.launch SCRIPT`, our `pretrain_scripts/pretrain_gpt.py` and any script
with the two `dcp_megatron.enable()` lines run by plain torchrun or python. The launcher could catch a
`DcpUsageError` around the whole script, but a plain-torchrun script has no such frame, so the exception
became a Python traceback on every rank. The seams that raise at start-up (the patched `validate_args`, the
patched `train` for checks that need the built tokenizer) end the process here instead.
"""
from __future__ import annotations

import sys
from typing import NoReturn

REFUSAL_PREFIX = "dcp: error: "
REFUSAL_EXIT_CODE = 2   # argparse's status for a usage error


def exit_refused(err: BaseException) -> NoReturn:
    """Print the refusal as one line on stderr and end the process with status 2 (no traceback)."""
    print(f"{REFUSAL_PREFIX}{err}", file=sys.stderr, flush=True)
    raise SystemExit(REFUSAL_EXIT_CODE) from None
