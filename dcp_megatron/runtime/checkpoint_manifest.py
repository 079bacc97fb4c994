"""A checksum manifest for every checkpoint a `--dcp` run writes, checked before it is loaded.

Neither Megatron's torch_dist checkpoints nor DeepSpeed's carry checksums: bytes flipped in a tensor load
silently, and a truncated or empty file fails deep inside torch without naming the file. After a save,
each rank hashes its share of the checkpoint's files (file i goes to rank i mod world size, so a large
checkpoint is hashed in parallel), the digests are gathered, and rank 0 writes `dcp_checkpoint.json`
beside them (atomically: a reader sees the whole manifest or none). It also records the run settings
that must match on resume (the learning-rate schedule), so a changed flag is found at start-up.

Before loading, each rank checks sizes of every file and the hash of its own share, and names the
first bad file. A checkpoint without a manifest (written without `--dcp`, or by a release without manifests) is loaded
as the framework would, with a note that it was not verified.
"""
from __future__ import annotations

import hashlib
import json
import os

MANIFEST_FILE = "dcp_checkpoint.json"
_FORMAT = 1
_CHUNK_BYTES = 8 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted or cannot be resumed as asked (the message says which file/flag)."""


def checkpoint_files(directory: str) -> list[str]:
    """Paths (relative to `directory`, sorted) of the regular files a checkpoint holds, manifest excluded."""
    paths = []
    for root, _, names in os.walk(directory):
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), directory)
            if relative != MANIFEST_FILE and not name.endswith(".dcp_tmp"):
                paths.append(relative)
    return sorted(paths)


def share_of(paths: list[str], *, rank: int, world_size: int) -> list[str]:
    return paths[rank::world_size]


def file_digest(path: str) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return {"size": os.path.getsize(path), "sha256": digest.hexdigest()}


def digests_of(directory: str, relative_paths: list[str]) -> dict[str, dict]:
    return {p: file_digest(os.path.join(directory, p)) for p in relative_paths}


def write_atomically(path: str, text: str) -> None:
    """A reader sees the old file or the whole new one."""
    temporary = path + ".dcp_tmp"
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def write_manifest(directory: str, digests: dict[str, dict], settings: dict) -> str:
    path = os.path.join(directory, MANIFEST_FILE)
    write_atomically(path, json.dumps({"format": _FORMAT, "files": dict(sorted(digests.items())), "settings": settings},
                                      indent=1))
    return path


def read_manifest(directory: str) -> dict | None:
    """The manifest of a checkpoint directory, None if it has none; a malformed one is an error."""
    path = os.path.join(directory, MANIFEST_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
        files, settings = manifest["files"], manifest.get("settings", {})
        if manifest.get("format") != _FORMAT or not isinstance(files, dict) or not isinstance(settings, dict):
            raise ValueError("unexpected layout")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: unreadable checksum manifest ({err}); the checkpoint cannot be verified. "
                              "Resume from an earlier iteration, or delete the manifest to load it unverified") from err
    return manifest


def verify(directory: str, manifest: dict, *, rank: int, world_size: int) -> None:
    """Every file the manifest lists exists with its size; this rank's share also has its hash."""
    files = manifest["files"]
    listed = sorted(files)
    for relative in listed:
        path = os.path.join(directory, relative)
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint {directory}: {relative} is missing (the manifest lists it)")
        size = os.path.getsize(path)
        if size != files[relative]["size"]:
            raise CheckpointError(f"checkpoint {directory}: {relative} has {size} bytes, {files[relative]['size']} "
                                  "were saved (truncated or overwritten); resume from an earlier iteration")
    for relative in share_of(listed, rank=rank, world_size=world_size):
        if file_digest(os.path.join(directory, relative))["sha256"] != files[relative]["sha256"]:
            raise CheckpointError(f"checkpoint {directory}: {relative} does not match its saved checksum (corrupted "
                                  "on disk); resume from an earlier iteration")


def read_and_verify(directory: str, *, rank: int, world_size: int) -> dict | None:
    """The checkpoint's manifest after `verify` passed on this rank; None if it has none."""
    manifest = read_manifest(directory)
    if manifest is not None:
        verify(directory, manifest, rank=rank, world_size=world_size)
    return manifest


def record(directory: str, settings: dict) -> None:
    """After a save every rank has finished: hash in parallel, rank 0 writes the manifest (a collective)."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    paths = checkpoint_files(directory)
    mine = digests_of(directory, share_of(paths, rank=rank, world_size=world_size))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        digests = {}
        for part in gathered:
            digests.update(part)
        write_manifest(directory, digests, settings)
    dist.barrier()
