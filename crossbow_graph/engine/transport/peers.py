"""What a failed collective or start-up says about the other ranks: a peer that left, one that
did not answer, ranks that never arrived (docs/distributed.md, "Faults")."""

from __future__ import annotations

import re

from ...errors import DistributedError

__all__ = ["lost_peer", "join_failed"]

_CLOSED = ("closed by peer", "reset by peer", "broken pipe", "remote process exited",
           "connection refused", "end of file")
_TIMED_OUT = ("timed out", "timeout")


def lost_peer(rank: int, world_size: int, what: str, round_index: int, timeout_s: float,
              exc: BaseException) -> DistributedError:
    """The DistributedError of ``rank`` whose collective ``what`` of round ``round_index`` (−1:
    start-up) failed with ``exc``: a peer left, did not answer within ``timeout_s``, or either."""
    peer = _peer(rank, world_size)
    when = "during start-up" if round_index < 0 else f"in round {round_index}"
    cause = _cause(exc)
    if cause == "closed":
        head = (f"{peer} left the process group {when}, during {what}: it died, or stopped on an "
                "error of its own")
        look = (f"Look at {peer}'s output for why it stopped (torchrun's summary names the rank "
                "that failed first)")
    elif cause == "timeout":
        head = (f"{peer} did not answer within {timeout_s:g} s {when}, during {what}: it hangs, is "
                "stopped, or is far slower than this one")
        look = "Look at the other ranks' output for where they stand"
    else:
        head = (f"{what} {when} failed: another rank died or did not answer within "
                f"{timeout_s:g} s")
        look = "Look at the other ranks' output"
    then = ("then start every rank again" if round_index < 0 else
            "then restart every rank with --resume (fit(..., resume=True)): rank 0's last "
            "checkpoint is intact, and fewer ranks can resume it (docs/distributed.md)")
    return DistributedError(
        f"rank {rank} of {world_size}: {head} ({_said(exc)}); stopping. {look}, {then}",
        task_id="start-up" if round_index < 0 else "global_sync", device=f"rank {rank}",
        round_index=round_index)


def join_failed(rank: int, world_size: int, address: str, timeout_s: float,
                exc: BaseException) -> DistributedError:
    """The DistributedError of ``rank`` whose ``init_process_group`` at ``address`` failed with
    ``exc``: ranks that never arrived, a peer that left, rank 0 unreachable, or another failure."""
    text = _said(exc)
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if joined:
        came, wanted = int(joined.group(1)), int(joined.group(2))
        head = (f"only {came} of {wanted} ranks joined the process group at {address} within "
                f"{timeout_s:g} s: the other {wanted - came} never arrived. They did not start or "
                "died during start-up (look at their output), or were launched with another "
                "--master-addr/--master-port")
    elif _cause(exc) == "closed":
        head = (f"{_peer(rank, world_size)} left while the process group at {address} was set up: "
                "it died during start-up (look at its output)")
    elif "connect" in text and rank != 0:
        head = (f"rank 0 could not be reached at {address} within {timeout_s:g} s: it did not "
                "start or died during start-up (look at its output), or the ranks were launched "
                "with different --master-addr/--master-port")
    elif _cause(exc) == "timeout":
        head = (f"not every rank joined the process group at {address} within {timeout_s:g} s: "
                "a rank did not start, died during start-up (look at its output) or hangs, or "
                "the ranks were launched with different --master-addr/--master-port")
    else:
        head = (f"could not join the process group at {address}: launch every rank with the same "
                "--master-addr and a free --master-port (torchrun does)")
    return DistributedError(f"rank {rank} of {world_size}: {head} ({text}); start every rank again",
                            task_id="start-up", device=f"rank {rank}", round_index=-1)


def _peer(rank: int, world_size: int) -> str:
    return f"rank {1 - rank}" if world_size == 2 else "a peer rank"


def _cause(exc: BaseException) -> str:
    """``"closed"`` (a peer's sockets closed), ``"timeout"`` or ``"unknown"``."""
    text = str(exc).lower()
    if any(s in text for s in _CLOSED):
        return "closed"
    return "timeout" if any(s in text for s in _TIMED_OUT) else "unknown"


def _said(exc: BaseException) -> str:
    """``exc``'s type and first line, without gloo's source location and advice."""
    lines = str(exc).strip().splitlines()
    line = re.sub(r"^\[[^\]]*\]\s*", "", lines[0] if lines else "")
    return f"{type(exc).__name__}: {line.split(' This is typically')[0]}"
