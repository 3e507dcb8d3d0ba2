"""The fault-tolerant global sync over torchft: each torchrun job one replica group (one process
or several ranks, each with a torchft ``Manager``); per sync a quorum (a joining group recovers
z and the sync's state from a peer), one all-reduce of ``[Σ contributions [P], Σ buffers [Q],
n]`` whose last entry is k (a group's ranks sum theirs first), and a commit that discards a
failed all-reduce and redoes it over the live groups (docs/distributed.md, "Fault tolerance:
torchft replica groups")."""

from __future__ import annotations

import atexit
import datetime
import hashlib
import logging
import os
import sys
import time
import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...compiler.fingerprint import computation_fingerprint
from ...errors import DistributedError
from ..learning.faults import FaultMonitor
from .lighthouse import Lighthouse
from .membership import Membership, MembershipChange

if TYPE_CHECKING:
    from .comm import Comm, Distributed
    from .host import TransportHost

_log = logging.getLogger("crossbow_graph.ft")

__all__ = ["FaultTolerantSync", "MembershipChange", "import_torchft", "check_fault_tolerant",
           "process_group_for", "group_store"]


def check_fault_tolerant(sync: Any, executor: str, num_learners: int | None) -> None:
    """ValueError when ``compile``'s ``sync``, ``executor`` or this group's learner count
    (``num_learners``, None: chosen by the auto-tuner) cannot run under
    ``Distributed(fault_tolerant=True)``."""
    name = type(sync).__name__
    if not sync.fault_tolerant:
        raise ValueError(f"Distributed(fault_tolerant=True) with sync={name}(): its global step "
                         "is not a sum over replica groups; use SMA, DiLoCo or LocalSGD")
    if executor == "process":
        raise ValueError("Distributed(fault_tolerant=True) with executor='process': a group that "
                         "recovers rewrites every replica during the sync, which the worker "
                         "processes do not wait for; use executor='inline' (or 'auto')")
    if num_learners == 1 and sync.alpha_for(2) > 0:
        raise ValueError(f"Distributed(fault_tolerant=True) with sync={name}(...) and one learner "
                         "in this group: the group's correction needs k > 1 learners of its own; "
                         "use replicas ≥ 2 (or devices ≥ 2)")


def import_torchft() -> Any:
    """The ``torchft`` module, its Rust log at WARNING unless ``RUST_LOG`` is set (read once, at
    the first import). Raises ImportError naming the extra when it is not installed."""
    quiet = "RUST_LOG" not in os.environ and "torchft._torchft" not in sys.modules
    if quiet:
        os.environ["RUST_LOG"] = "warn"  # for torchft's import only: not the processes we start
    try:
        import torchft
        import torchft.manager  # noqa: F401
        import torchft.process_group  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "Distributed(fault_tolerant=True) (--fault-tolerant) runs on torchft, which is not "
            "installed: pip install 'crossbow_graph[ft]' (torchft==0.2.0)") from exc
    finally:
        if quiet:
            del os.environ["RUST_LOG"]
    return torchft


class _QuietTorchft(logging.Filter):
    """torchft's Python loggers that nobody configured (no level, no handler: not its
    OpenTelemetry export) at WARNING, and its warning about NCCL's flight recorder (a torch
    built without it) dropped, until ``restore``."""

    NAMES = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")

    def __init__(self) -> None:
        super().__init__()
        self.quieted = [lg for lg in map(logging.getLogger, self.NAMES)
                        if lg.level == logging.NOTSET and not lg.handlers]
        for lg in self.quieted:
            lg.setLevel(logging.WARNING)
        logging.getLogger("torchft.manager").addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        return "NCCL flight recorder" not in record.getMessage()

    def restore(self) -> None:
        for lg in self.quieted:
            lg.setLevel(logging.NOTSET)
        self.quieted = []
        logging.getLogger("torchft.manager").removeFilter(self)


def process_group_for(device: str) -> tuple[type, torch.device]:
    """torchft's reconfigurable process group for a plan whose first device is ``device``, and
    the device its all-reduce runs on: ``ProcessGroupNCCL`` on that CUDA device, else
    ``ProcessGroupGloo`` on the host."""
    from torchft import process_group

    where = torch.device(device)
    if where.type == "cuda":
        return process_group.ProcessGroupNCCL, where
    return process_group.ProcessGroupGloo, torch.device("cpu")


# what ``LocalOptimizer.describe()`` says of how the optimizer runs, not of what it computes:
# it may differ between groups on a CUDA device and on the host
_HOW = ("kernel", "stacked", "foreach", "fused", "capturable", "differentiable")


def hyper_parameters(optimizer: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """The hyper-parameters of a group that every group of a quorum must share: the optimizer's
    class and its param groups' settings (``optimizer``: ``LocalOptimizer.describe()``; lr,
    momentum, weight decay, betas, …, the parameters' count) and b, samples per learner."""
    groups = [{k: v for k, v in g.items() if k not in _HOW} for g in optimizer["groups"]]
    return {"optimizer": optimizer["class"].rsplit(".", 1)[-1], "param groups": groups,
            "batch_size": batch_size}


def _digest_words(facts: Any) -> list[int]:
    """A 60-bit digest of ``repr(facts)`` as three integers below 2^20."""
    digest = int(hashlib.sha256(repr(facts).encode()).hexdigest()[:15], 16)
    return [(digest >> (20 * i)) & 0xFFFFF for i in range(3)]


def agreement_words(host: "TransportHost", hyper: dict[str, Any]) -> list[list[int]]:
    """What the replica groups of a quorum must share, as integers below 2^20 (exact in a float64
    sum and its squares), in two parts: (1) P, Q and a digest of the model's tensors, its
    computation (compiler/fingerprint.py), the sync, the precision and the rows' channels-last
    weights; (2) a digest of ``hyper`` (``hyper_parameters``)."""
    s0 = host.states[0]
    model = [(n, tuple(t.shape), str(t.dtype)) for n, t in
             [*s0.template.named_parameters(), *s0.template.named_buffers()]]
    facts = (model, computation_fingerprint(s0.template, None, host.loss_fn).lines,
             host.describe_sync(), s0.precision, sorted(s0.params.channels_last))
    P, Q = s0.z.shape[0], s0.buf.shape[1]
    sizes = [(x >> (20 * i)) & 0xFFFFF for x in (P, Q) for i in range(2)]
    return [_digest_words(facts) + sizes, _digest_words(hyper)]


def _say(hyper: dict[str, Any]) -> str:
    """``hyper_parameters`` in words: ``SGD(lr=0.05, momentum=0.9, …), b = 4``."""
    groups = "; ".join(", ".join(f"{k}={v}" for k, v in g.items() if k != "params")
                       for g in hyper.get("param groups", []))
    return f"{hyper.get('optimizer')}({groups}), b = {hyper.get('batch_size')}"


def group_store(world_size: int, replica_group: str) -> tuple[Any, str, int]:
    """The store a replica group's Managers meet in, as torchft's HSDP examples: a new one of this
    process for a one-process group (it, its address and port), torchrun's
    (MASTER_ADDR:MASTER_PORT) for several (None, address, port)."""
    if world_size == 1:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        return store, "127.0.0.1", store.port
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise ValueError(f"Distributed(fault_tolerant=True) with {world_size} processes in "
                         f"replica group {replica_group!r}: their Managers meet in torchrun's "
                         "store, but MASTER_ADDR or MASTER_PORT is not set; launch the group "
                         "with torchrun")
    return None, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


class FaultTolerantSync:
    """This process's part of its replica group in a torchft run: its Manager and the sync's
    all-reduce.

    Args:
        settings: ``Distributed`` with ``fault_tolerant=True``: ``lighthouse`` (or the
            ``TORCHFT_LIGHTHOUSE`` variable), ``replica_group``, ``min_replicas``, ``timeout_s``
            (collectives, recovery, and the quorum's wait).
        device: the plan's first device (``process_group_for``: NCCL on CUDA, else gloo).
        comm: the group's torchrun ``Comm`` when the group is several processes (each rank has
            a Manager on torchrun's store, MASTER_ADDR:MASTER_PORT), else None.

    Attributes:
        members: the live membership of its syncs (``Membership``: k of the last committed sync,
            α(k) of the next round's local updates; every ``MembershipChange``).
        replica_group: this group's name (the Lighthouse sees it with a unique suffix).

    Raises:
        ImportError: torchft is not installed (names the ``ft`` extra).
        ValueError: no Lighthouse address, not a URL, none answering there, or a group of
            several processes without MASTER_ADDR/MASTER_PORT."""

    def __init__(self, settings: "Distributed", device: str = "cpu",
                 comm: "Comm | None" = None) -> None:
        import_torchft()
        from torchft.manager import Manager

        lighthouse = settings.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not lighthouse:
            raise ValueError("Distributed(fault_tolerant=True): no Lighthouse address; start "
                             "`torchft_lighthouse --min_replicas 1 --bind [::]:29510` and pass "
                             "lighthouse='http://HOST:29510' (--lighthouse), or set "
                             "TORCHFT_LIGHTHOUSE")
        if not lighthouse.startswith(("http://", "https://")):
            raise ValueError(f"Distributed(fault_tolerant=True): lighthouse={lighthouse!r} is not "
                             "a URL; pass it as http://HOST:PORT (--lighthouse), the port "
                             "torchft_lighthouse's --bind names")
        self.lighthouse, self.timeout_s = Lighthouse(lighthouse), settings.timeout_s
        self.replica_group = settings.replica_group or os.environ.get("REPLICA_GROUP_ID", "0")
        self.attempts, self.min_replicas = settings.ft_attempts, settings.min_replicas
        self.comm = comm
        self.rank, self.world_size = (comm.rank, comm.world_size) if comm else (0, 1)
        timeout = datetime.timedelta(seconds=settings.timeout_s)
        process_group, self.device = process_group_for(device)
        if self.device.type == "cuda":  # torchft's NCCL group sets it itself, with a warning
            os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(settings.timeout_s))
        self._store, store_addr, store_port = group_store(self.world_size, self.replica_group)
        self._quiet = _QuietTorchft()  # a fit prints membership changes, not every sync
        try:
            self.manager = Manager(
                pg=process_group(timeout=timeout), min_replica_size=settings.min_replicas,
                load_state_dict=self._load, state_dict=self._save, use_async_quorum=False,
                init_sync=False,  # the groups start from the same seeded model; a joiner recovers
                replica_id=self.replica_group, store_addr=store_addr, store_port=store_port,
                rank=self.rank, world_size=self.world_size, lighthouse_addr=lighthouse,
                timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout)
        except RuntimeError as exc:  # torchft's connect, after connect_timeout
            self._quiet.restore()
            raise ValueError(f"replica group {self.replica_group}: no Lighthouse answered at "
                             f"{lighthouse} within {settings.timeout_s:g} s ({str(exc)[:200]}); "
                             "start torchft_lighthouse there, or pass its address (--lighthouse)"
                             ) from None
        self.hyper: dict[str, Any] = {}  # hyper_parameters of this group (``expect``)
        self._agreed_quorum: int | None = None  # the quorum whose groups were found to agree
        self._discarded = ""  # why the last attempt was discarded
        self.members = Membership(self.replica_group, self.world_size, self.rank)
        self.host: TransportHost | None = None  # the engine whose state a recovering peer receives
        self._fault_count: torch.Tensor | None = None
        self._recovered = False
        atexit.register(self.close)

    def attach(self, host: "TransportHost") -> None:
        """Serve ``host``: its states are what a recovering peer receives and this group's sum."""
        self.host = host

    def take_fault_count(self) -> torch.Tensor | None:
        """The group's ranks' count of unshared fault events its last sum carried, once."""
        count, self._fault_count = self._fault_count, None
        return count

    def expect(self, optimizer: dict[str, Any], batch_size: int) -> None:
        """The hyper-parameters this group was compiled with (``hyper_parameters``), which every
        group of a quorum must share: checked with the computation in each new quorum."""
        self.hyper = hyper_parameters(optimizer, batch_size)


    # -- recovery (torchft calls these in its quorum; _load on the main thread) ---------------

    def _save(self) -> dict[str, Any]:
        s0 = self.host.states[0]
        return {"z": s0.z.detach().cpu().clone(), "z_prev": s0.z_prev.detach().cpu().clone(),
                "zbuf": s0.zbuf.detach().cpu().clone(),
                "sync_state": self.host.sync_state.state_dict()}

    @torch.no_grad()
    def _load(self, saved: dict[str, Any]) -> None:
        if saved["z"].shape != self.host.states[0].z.shape:
            raise DistributedError(
                f"replica group {self.replica_group}: the live groups' z has "
                f"{saved['z'].shape[0]:,} parameters, this group's {self.host.states[0].z.shape[0]:,}"
                ": every replica group must compile the same model", task_id="global_sync",
                device=f"group {self.replica_group}", round_index=-1)
        for s in self.host.states:
            s.z.copy_(saved["z"])
            s.z_prev.copy_(saved["z_prev"])
            s.zbuf.copy_(saved["zbuf"])
            FaultMonitor.reset(s, list(range(s.m)))  # w ← z, zero momentum, fresh state
        self.host.sync_state.load_state_dict(saved["sync_state"])
        self._recovered = True

    # -- the global sync ------------------------------------------------------------------------

    def all_reduce(self, total: torch.Tensor, bufs: list[torch.Tensor],
                   round_index: int) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """Σ over the live groups of ``total [P]`` (this process's contribution; in a group of
        several processes first summed over its ranks) and of the replicas' float buffers
        (``bufs``: ``[m_d, Q]`` per device), committed by torchft.

        Returns:
            (the sum ``[P]`` on ``total``'s device, the mean buffers over the k learners ``[Q]``
            or None, k: the learners of the groups that contributed).

        Raises:
            DistributedError: no sync committed in ``ft_attempts`` quorums (fewer live groups
                than ``min_replicas``, or the Lighthouse is gone); the groups of a new quorum
                differ (``_agree``)."""
        host = self.host
        P, Q = total.shape[0], bufs[0].shape[1]
        sent = torch.empty(P + Q + 1, dtype=total.dtype, device=self.device)  # [P + Q + 1]
        sent[:P].copy_(total)
        if Q:
            torch.sum(torch.cat([b.to(self.device, total.dtype) for b in bufs]), dim=0,
                      out=sent[P:P + Q])
        sent[P + Q] = sum(s.m for s in host.states)
        if self.comm is not None:
            self._group_sum(sent, round_index)
        start = time.perf_counter()
        self._recovered = False  # set by _load, in any of the attempts
        for failed in range(self.attempts):
            flat = self._attempt(sent)
            if flat is None and self.rank == 0:
                _log.warning("replica group %s: round %d: sync attempt %d of %d discarded (%s)",
                             self.replica_group, round_index, failed + 1, self.attempts,
                             self._discarded)
            if flat is not None:
                k = int(round(flat[P + Q].item()))
                self.members.record(round_index, self.manager.num_participants(), k,
                                    recovered=self._recovered, failed=failed,
                                    seconds=time.perf_counter() - start)
                mean_buf = flat[P:P + Q].div_(k).to(host.states[0].buf.dtype) if Q else None
                return flat[:P].to(total.device), mean_buf, k
        raise DistributedError(
            f"replica group {self.replica_group}: the global sync of round {round_index} did not "
            f"commit in {self.attempts} attempts ({time.perf_counter() - start:.0f} s); the last: "
            f"{self._discarded}. "
            + self.lighthouse.advice(self.attempts, self.timeout_s, self.min_replicas),
            task_id="global_sync", device=f"group {self.replica_group}", round_index=round_index)

    def _group_sum(self, sent: torch.Tensor, round_index: int) -> None:
        """``sent [P + Q + 1]`` ← its sum over the group's ranks, in place (torchrun's process
        group, on the first device), with the ranks' unshared fault events counted and shared
        as a torchrun run does (transports.py ``Torchrun``)."""
        host = self.host
        flat = torch.cat([sent, sent.new_tensor([host.pending_faults()])])  # [P + Q + 2]
        flat = flat.to(host.states[0].torch_device)
        self.comm.all_reduce_sum_(flat, round_index)
        self._fault_count = flat[-1:]  # the backend shares them (``take_fault_count``)
        sent.copy_(flat[:-1])

    def _attempt(self, sent: torch.Tensor) -> torch.Tensor | None:
        """One quorum, all-reduce and commit of ``sent``; the sum, or None when discarded."""
        manager = self.manager
        with torch.accelerator.device_index(self.device.index):  # NCCL's device (None: the host)
            try:
                with warnings.catch_warnings():  # torch's, on the checkpoint torchft streams in
                    warnings.filterwarnings("ignore", message="The given buffer is not writable")
                    manager.start_quorum()  # may recover this group's state from a peer (_load)
            except DistributedError:
                raise  # this group's model is not the live groups' (_load)
            except (TimeoutError, RuntimeError) as exc:  # no quorum in timeout_s (e.g. the
                # Lighthouse still sees a group whose rank died, its rank 0 lingering), or no
                manager._quorum_future = None  # Lighthouse; torchft would raise this failed
                self._discarded = self.lighthouse.why_no_quorum(  # quorum again next time
                    exc, self.timeout_s, self.replica_group)
                return None
            if self._recovered:  # (again after a failed attempt: sent stays zero)
                sent.zero_()  # taken against the stale z: this group joins from the next sync
            agreed = manager._quorum_id == self._agreed_quorum or self._agree(manager)
            flat = sent.clone()
            manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
            if agreed and manager.should_commit():
                return flat
            live = manager.num_participants()
            if live >= self.min_replicas:
                self._discarded = f"a collective failed: {str(manager.errored())[:200]}"
                return None
            self._discarded = f"{live} live group(s), fewer than min_replicas={self.min_replicas}"
            time.sleep(1.0)  # the others may be starting: wait attempts × 1 s for them
            return None

    def _agree(self, manager: Any) -> bool:
        """In a new quorum, check that every group runs the same computation and holds the same
        z (after recovery): two all-reduces, of ``agreement_words`` and of z. Returns False when
        a collective failed (the attempt is discarded).

        Raises:
            DistributedError: the groups differ (a model, loss, sync or layout; the optimizer,
                its settings or b they were compiled with; z: another seed)."""
        computation, hyper = agreement_words(self.host, self.hyper)
        words = torch.tensor(computation + hyper, dtype=torch.float64, device=self.device)
        n = manager.num_participants()
        sums = torch.cat([words.new_ones(1), words, words * words])  # [1 + 2W], exact integers
        manager.allreduce(sums, reduce_op=dist.ReduceOp.SUM).wait()
        if manager.errored() is not None or sums[0].item() != n:
            return False
        W = len(words)
        same = (sums[1:W + 1] == n * words) & (sums[W + 1:] == n * words * words)  # [W]
        if not bool(same[:len(computation)].all()):
            self._differ("run another computation (the model, its forward, loss, sync, precision "
                         "or the flat rows' layout: channels-last weights on one kind of device only)")
        if not bool(same[len(computation):].all()):
            self._differ(f"were compiled with other hyper-parameters: the optimizer, its settings "
                         f"(lr, momentum, weight decay, …) or the batch size (this group's: "
                         f"{_say(self.hyper)})")
        z = self.host.states[0].z.to(self.device, torch.float64)
        mean = z.clone()
        manager.allreduce(mean, reduce_op=dist.ReduceOp.SUM).wait()
        if manager.errored() is not None:
            return False
        gap = (mean.div_(n) - z).abs().max().item() if z.numel() else 0.0
        if gap > 1e-4 * (1.0 + z.abs().max().item()):
            self._differ(f"hold another z (largest difference from the groups' mean {gap:.3g}): "
                         "every group must compile with the same seed (fit's and compile's)")
        self._agreed_quorum = manager._quorum_id
        return True

    def _differ(self, what: str) -> None:
        raise DistributedError(
            f"replica group {self.replica_group}: the {self.manager.num_participants()} replica "
            f"groups of this quorum {what}; start every group with the same model and options",
            task_id="global_sync", device=f"group {self.replica_group}", round_index=-1)

    def close(self) -> None:
        """Shut the Manager down (its servers and threads); torchft's loggers as they were."""
        self.manager.shutdown(wait=False)
        self._quiet.restore()
