"""One fit at a time in a checkpoint directory: an exclusive lock held while a fit writes there
(docs/reliability.md, One fit per directory).

``DirectoryLock(directory).acquire()`` takes a non-blocking ``fcntl.flock`` on
``<directory>/.crossbow_graph.lock`` with the holder's pid, host and start time; the OS drops it
when the process ends (forked children close their copy of the descriptor at once). A second fit
there gets a ``CheckpointError`` naming the directory, the holder and the fix, before any round."""

from __future__ import annotations

import fcntl
import os
import socket
import time
import weakref

from ..errors import CheckpointError

__all__ = ["DirectoryLock", "LOCK_NAME"]

LOCK_NAME = ".crossbow_graph.lock"

_HELD: "weakref.WeakSet[DirectoryLock]" = weakref.WeakSet()  # locks this process holds


def _forget_in_child() -> None:
    """In a forked child: close the inherited lock descriptors (the parent keeps its locks)."""
    for lock in list(_HELD):
        if lock._fd is not None:
            os.close(lock._fd)
            lock._fd = None
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_in_child)


class DirectoryLock:
    """The lock of one checkpoint directory (module docstring); a context manager.

    Args:
        directory: the checkpoint directory (it exists: ``check_writable_dir`` made it)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self) -> "DirectoryLock":
        """Take the lock, or raise.

        Raises:
            CheckpointError: another fit holds it (names the directory, the holder's pid, host
                and start time, and the fix)."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise CheckpointError(
                    f"checkpoint_dir={self.directory!r} is in use by another fit ({holder}, "
                    f"which holds {self.path}); two fits in one directory would overwrite and "
                    "delete each other's checkpoints. Pass another checkpoint_dir, or wait until "
                    "that fit ends (or stop it) and resume") from None
            if self._same_file(fd):
                break
            os.close(fd)  # its last holder removed it between our open and flock: again
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        self._fd = fd
        _HELD.add(self)
        return self

    def _same_file(self, fd: int) -> bool:
        try:
            return os.fstat(fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            return False

    def release(self) -> None:
        """Remove the lock file and let go (nothing when not held)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        _HELD.discard(self)
        try:
            if self._same_file(fd):
                os.unlink(self.path)
        finally:
            os.close(fd)  # closing the last descriptor drops the flock

    def __enter__(self) -> "DirectoryLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
