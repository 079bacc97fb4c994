"""What the user typed, as opposed to what argparse defaulted: some checks and mappings apply only to flags given
on the command line (a JSON block and a flag may then disagree, or a flag has no DeepSpeed counterpart)."""

from __future__ import annotations


def flag_given(argv: list[str], flag: str) -> bool:
    """`flag` appears in `argv`, as `--flag value` or `--flag=value`."""
    return any(token == flag or token.startswith(flag + "=") for token in argv)
