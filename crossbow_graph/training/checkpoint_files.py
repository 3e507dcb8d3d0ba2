"""Checkpoint files: atomic writes with a checksum, verified reads, the newest good one of a
directory (docs/reliability.md, Checkpoints).

File format: ``MAGIC`` (8 bytes), payload length (8 bytes, little endian), SHA-256 of the payload
(32 bytes), then the payload (``torch.save`` of the state, loaded with ``weights_only=True``);
names ``ckpt-<rounds done, 10 digits>.pt``."""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import io
import logging
import os
import resource
import struct
import tempfile
from typing import Any

import torch

from ..errors import CheckpointError

__all__ = ["save_checkpoint", "load_checkpoint", "load_latest", "list_checkpoints",
           "checkpoint_path", "prune_checkpoints", "remove_temporaries", "MAGIC"]

log = logging.getLogger("crossbow_graph.checkpoint")

MAGIC = b"CBGCKPT1"
_HEADER = struct.Struct("<8sQ32s")  # magic, payload bytes, sha256
_CHUNK = 1 << 20
_PATTERN = "ckpt-" + "[0-9]" * 10 + ".pt"


def checkpoint_path(directory: str, rounds_done: int) -> str:
    """The file of the checkpoint after ``rounds_done`` rounds: ``ckpt-<10 digits>.pt``."""
    return os.path.join(directory, f"ckpt-{rounds_done:010d}.pt")


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(f, data: memoryview) -> None:
    for start in range(0, len(data), _CHUNK):
        f.write(data[start:start + _CHUNK])


def save_checkpoint(path: str, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically (temporary file in the same directory, fsync,
    ``os.replace``, fsync of the directory), with a length and SHA-256 header.

    Raises:
        CheckpointError: the write failed for want of space or of a larger file-size limit
            (ENOSPC, EDQUOT, EFBIG): names the file, the bytes needed, the space free and the
            previous checkpoint, which is intact (the temporary file is removed).
        OSError: any other failure of the file system (the temporary file is removed)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getbuffer()
    header = _HEADER.pack(MAGIC, len(payload), hashlib.sha256(payload).digest())
    directory = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".ckpt-", suffix=".tmp", dir=directory)
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            _write_all(f, payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise _no_room(path, _HEADER.size + len(payload), exc) from exc
        raise
    _fsync_dir(directory)


def _no_room(path: str, needed: int, exc: OSError) -> CheckpointError:
    """The CheckpointError of a write that ran out of space or past the file-size limit."""
    directory = os.path.dirname(os.path.abspath(path))
    if exc.errno == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        room = f"the process's file-size limit (ulimit -f) is {limit:,} bytes"
    else:
        st = os.statvfs(directory)
        room = f"{directory} has {st.f_bavail * st.f_frsize:,} bytes free"
    older = [p for p in list_checkpoints(directory) if p != path]
    intact = (f"the previous checkpoint {older[-1]} is intact" if older
              else "no earlier checkpoint is in the directory")
    return CheckpointError(
        f"cannot write checkpoint {path}: {exc.strerror or exc} (errno {exc.errno}): it needs "
        f"{needed:,} bytes and {room}; {intact} (the partial file was removed). Free space (or "
        "raise the limit) or pass another checkpoint_dir, then resume")


def load_checkpoint(path: str) -> dict[str, Any]:
    """Read and verify one checkpoint file.

    Raises:
        CheckpointError: the file is not a checkpoint, is truncated, or fails its checksum (the
            message says which, with the byte counts)."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < _HEADER.size:
        raise CheckpointError(f"checkpoint {path} is truncated: {len(data)} bytes, shorter than "
                              f"its {_HEADER.size}-byte header")
    magic, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CheckpointError(f"{path} is not a crossbow_graph checkpoint (bad magic {magic!r})")
    payload = memoryview(data)[_HEADER.size:]
    if len(payload) != length:
        raise CheckpointError(f"checkpoint {path} is truncated: {len(payload):,} of {length:,} "
                              "payload bytes (the write was interrupted)")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"checkpoint {path} is corrupt: its SHA-256 checksum does not match")
    try:
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable payload is a corrupt checkpoint
        raise CheckpointError(f"checkpoint {path} cannot be unpickled: {type(exc).__name__}: "
                              f"{exc}") from exc


def _named_like_checkpoints(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(directory), _PATTERN)))


def list_checkpoints(directory: str) -> list[str]:
    """Checkpoint files of ``directory``, oldest first (temporary files, and directories or
    other non-files named like a checkpoint, are ignored)."""
    return [p for p in _named_like_checkpoints(directory) if os.path.isfile(p)]


def load_latest(directory: str) -> tuple[str, dict[str, Any]] | None:
    """The newest checkpoint of ``directory`` that verifies, as ``(path, state)``; None if the
    directory holds none. A bad newer file is skipped with a warning naming it and why, and so is
    a directory (or other non-file) named like a checkpoint.

    Raises:
        CheckpointError: checkpoints exist but none of them can be read (lists each reason)."""
    for odd in sorted(set(_named_like_checkpoints(directory)) - set(list_checkpoints(directory))):
        log.warning("%s is named like a checkpoint but is not a file (a directory?); skipped",
                    odd)
    problems = []
    for path in reversed(list_checkpoints(directory)):
        try:
            state = load_checkpoint(path)
        except CheckpointError as exc:
            problems.append(str(exc))
            log.warning("%s; trying the previous checkpoint", exc)
            continue
        if problems:
            log.warning("resuming from the previous good checkpoint %s", path)
        return path, state
    if problems:
        raise CheckpointError(f"no checkpoint in {directory} can be loaded: " + "; ".join(problems)
                              + ". Delete the directory (or pass resume=False) to start afresh")
    return None


def prune_checkpoints(directory: str, keep: int, spare: str | None = None) -> None:
    """Remove all but the newest ``keep`` checkpoint files and the file named ``spare`` (one
    already gone is skipped)."""
    for old in list_checkpoints(directory)[:-keep]:
        if os.path.basename(old) == spare:
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(old)


def remove_temporaries(directory: str) -> None:
    """Remove the ``.ckpt-*.tmp`` files of writes that were killed (under the directory's lock:
    no other fit writes there)."""
    for stale in glob.glob(os.path.join(glob.escape(directory), ".ckpt-*.tmp")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stale)
