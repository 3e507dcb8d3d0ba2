"""The torchft Lighthouse a fault-tolerant replica group syncs through: whether it answers, and
what a group says when no quorum comes (docs/distributed.md, "Fault tolerance: torchft replica
groups")."""

from __future__ import annotations

import dataclasses
import logging
import re
import socket
import urllib.parse

__all__ = ["Lighthouse"]

_log = logging.getLogger("crossbow_graph.ft")


@dataclasses.dataclass(frozen=True)
class Lighthouse:
    """A Lighthouse's address, ``http://HOST:PORT`` (``Distributed.lighthouse``)."""

    url: str

    @property
    def port(self) -> int:
        parts = urllib.parse.urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)

    def listening(self) -> bool:
        """Whether something accepts a TCP connection at its host and port (1 s at most)."""
        host = urllib.parse.urlsplit(self.url).hostname or "localhost"
        try:
            with socket.create_connection((host, self.port), timeout=1.0):
                return True
        except OSError:
            return False

    def why_no_quorum(self, exc: BaseException, timeout_s: float, group: str) -> str:
        """Why replica group ``group`` got no quorum, in words: nothing listening at the address,
        or torchft's reason (gRPC's message only; its whole text at DEBUG)."""
        _log.debug("replica group %s: no quorum: %s", group, exc)
        if not self.listening():
            return (f"the Lighthouse at {self.url} does not answer: nothing listens there (it "
                    "stopped, or was never started there)")
        said = re.search(r'message: "([^"]*)"', str(exc))
        return (f"no quorum from the Lighthouse at {self.url} within {timeout_s:g} s "
                f"({said.group(1) if said else str(exc).splitlines()[0][:120]})")

    def advice(self, attempts: int, timeout_s: float, min_replicas: int) -> str:
        """What to do when a sync did not commit in ``attempts`` quorums."""
        if not self.listening():
            return (f"Restart the Lighthouse there (torchft_lighthouse --min_replicas 1 --bind "
                    f"[::]:{self.port}), then this group from its checkpoint (resume=True, "
                    "--resume): it recovers z from a live peer, if any. A Lighthouse back within "
                    f"the {attempts} attempts of {timeout_s:g} s (ft_attempts × timeout_s, "
                    "--dist-timeout) lets the groups go on")
        return (f"With fewer live groups than min_replicas={min_replicas}, start the others (a "
                "Lighthouse started with --min_replicas N makes quorums wait for N groups)")
