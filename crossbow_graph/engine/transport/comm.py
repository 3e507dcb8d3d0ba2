"""Global synchronisation across processes over torch.distributed under torchrun: the
hierarchical all-reduce of ``[C_p, Σ buf, n]`` per sync, the start-up agreement (``Comm.agree``),
rank 0's settings (``Comm.broadcast_floats``; training/rank_sync.py), z's checksum
(``Comm.check_z``), every collective under ``Distributed.timeout_s`` (docs/distributed.md;
docs/design-overview.md §2, §5)."""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import hashlib
import os
from typing import Any, Callable, Literal, get_args

import torch
import torch.distributed as dist

if dist.is_available():
    # torch.distributed.nn.functional's collectives take ``group=group.WORLD`` as a default, read
    # when the module is first imported (torch.optim imports it, through torch._dynamo): imported
    # after init_process_group it holds the default group for ever, so that destroy_process_group
    # cannot close the group's sockets, and a rank that stops on an error is seen by the others
    # only at their timeout. Imported before any process group exists, the default is None.
    import torch.distributed.nn.functional  # noqa: F401

from ...compiler.fingerprint import Fingerprint, first_difference
from ...errors import DistributedError, DivergenceError, is_count
from .peers import join_failed, lost_peer

__all__ = ["Distributed", "Comm", "torchrun_env", "z_digest", "SyncDtype", "DistBackend",
           "AGREE_EVERY_ROUNDS"]

SyncDtype = Literal["fp32", "bf16", "fp16"]  # the corrections' dtype in the all-reduce
DistBackend = Literal["auto", "gloo", "nccl"]
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Distributed:
    """Settings of multi-process training (used when torchrun's environment is present).

    Attributes:
        timeout_s: seconds any collective may wait for a peer before the others stop with
            DistributedError (the process group's timeout), > 0. Default 60.
        checksum_every: rounds between checks that z is identical on every rank (≥ 1).
        backend: ``"auto"`` (NCCL when the devices are GPUs, else gloo), ``"gloo"`` or ``"nccl"``.
        sync_dtype: the dtype the global sync's all-reduce carries the corrections in: ``"fp32"``
            (exact), or ``"bf16"``/``"fp16"`` (half the bytes; each rank keeps the float32
            rounding error of what it sent and adds it to its next sum, error feedback:
            ``Comm.all_reduce_sum_``). Buffer sums and the fault count stay float32.
        fault_tolerant: every torchrun job (one process or several) is one torchft replica
            group and the global sync's sum goes through torchft's Manager (engine/transport/ft.py;
            docs/distributed.md, "Fault tolerance"): a group that dies or hangs is left out, one
            that starts joins. Needs the ``ft`` extra (torchft).
        lighthouse: the torchft Lighthouse's address (``http://HOST:PORT``); None: the
            ``TORCHFT_LIGHTHOUSE`` variable.
        replica_group: this group's name (None: ``REPLICA_GROUP_ID``, else ``"0"``).
        min_replicas: the fewest live groups a sync commits with (≥ 1).
        ft_attempts: quorums a sync tries before DistributedError (≥ 1).

    Raises:
        ValueError: a value outside its range."""

    timeout_s: float = 60.0
    checksum_every: int = 100
    backend: DistBackend = "auto"
    sync_dtype: SyncDtype = "fp32"
    fault_tolerant: bool = False
    lighthouse: str | None = None
    replica_group: str | None = None
    min_replicas: int = 1
    ft_attempts: int = 10

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"Distributed(timeout_s={self.timeout_s}): must be > 0 seconds, e.g. 60")
        if not is_count(self.checksum_every):
            raise ValueError(f"Distributed(checksum_every={self.checksum_every!r}): must be an "
                             "integer number of rounds ≥ 1")
        if self.backend not in get_args(DistBackend):
            raise ValueError(f"Distributed(backend={self.backend!r}): use 'auto', 'gloo' or 'nccl'")
        if self.sync_dtype not in get_args(SyncDtype):
            raise ValueError(f"Distributed(sync_dtype={self.sync_dtype!r}): use one of "
                             f"{get_args(SyncDtype)} (the corrections' dtype in the all-reduce)")
        for name in ("min_replicas", "ft_attempts"):
            if not is_count(getattr(self, name)):
                raise ValueError(f"Distributed({name}={getattr(self, name)!r}): must be an integer ≥ 1")
        if self.fault_tolerant and self.sync_dtype != "fp32":
            raise ValueError(f"Distributed(fault_tolerant=True, sync_dtype={self.sync_dtype!r}): "
                             "the fault-tolerant sync sends float32; use sync_dtype='fp32'")

    def sync_bytes(self, num_parameters: int, num_float_buffers: int) -> int:
        """Bytes one process hands to the all-reduce per sync: the P corrections in
        ``sync_dtype``, the Q buffer sums and the fault count in float32."""
        return SYNC_DTYPES[self.sync_dtype].itemsize * num_parameters + 4 * (num_float_buffers + 1)


SYNC_DTYPES: dict[SyncDtype, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16,
                                             "fp16": torch.float16}


AGREE_EVERY_ROUNDS = 16  # rounds between agreements of rank 0's settings when no hook decides


def torchrun_env() -> dict[str, str] | None:
    """torchrun's variables when this process was launched by it (WORLD_SIZE > 1), else None.

    Raises:
        ValueError: WORLD_SIZE > 1 without one of RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1 and not dist.is_initialized():
        return None
    if dist.is_initialized():
        return {"RANK": str(dist.get_rank()), "WORLD_SIZE": str(dist.get_world_size()),
                "LOCAL_RANK": os.environ.get("LOCAL_RANK", "0")}
    missing = [k for k in _ENV if k not in os.environ]
    if missing:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {', '.join(missing)} "
                         "is not set; launch with torchrun (it sets them), e.g. "
                         "torchrun --nproc-per-node 2 -m crossbow_graph train")
    return {k: os.environ[k] for k in _ENV}


def z_digest(z: torch.Tensor) -> str:
    """A printable checksum of z's bits: the first 16 hex digits of SHA-256 of ``z [P]`` (float32)."""
    return hashlib.sha256(z.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def _bit_checksum(z: torch.Tensor) -> torch.Tensor:
    """Two exact int64 checksums of z's bit pattern, ``[2]``: Σ bits_i and Σ (i mod 65521 + 1)·bits_i
    (wrapping on overflow, identically on every rank); any changed bit changes the first."""
    bits = z.detach().contiguous().view(torch.int32).to(torch.int64)  # [P]
    weights = torch.arange(bits.numel(), device=bits.device) % 65521 + 1
    return torch.stack([bits.sum(), (bits * weights).sum()])


class Comm:
    """This process's place in the process group and the collectives crossbow_graph uses.

    Attributes:
        rank, world_size, local_rank: from torchrun's environment (or the initialised group).
        local_world_size: the ranks on this host (torchrun's ``LOCAL_WORLD_SIZE``).
        backend: ``"gloo"`` or ``"nccl"``.
        settings: the Distributed settings.
        is_main: rank 0 (writes checkpoints and logs, shows the progress bar, decides)."""

    def __init__(self, settings: Distributed, *, on_cuda: bool) -> None:
        env = torchrun_env()
        assert env is not None, "Comm needs torchrun's environment (see Comm.from_env)"
        self.settings = settings
        self.bytes_reduced = 0  # handed to the global sync's all-reduces so far
        self._residual: torch.Tensor | None = None  # error feedback of a low sync_dtype, [P]
        self._finite_after: int | None = None  # the round of the last check that found z finite
        self.rank, self.world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        self.local_rank = int(env.get("LOCAL_RANK", "0"))
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # ranks on this host
        backend = settings.backend if settings.backend != "auto" else ("nccl" if on_cuda else "gloo")
        self._owned = False
        if not dist.is_initialized():
            if backend == "nccl":
                torch.cuda.set_device(self.local_rank)
            try:
                dist.init_process_group(backend=backend, init_method="env://", rank=self.rank,
                                        world_size=self.world_size,
                                        timeout=datetime.timedelta(seconds=settings.timeout_s))
            except Exception as exc:  # DistStoreError: a rank never came, or the address is wrong
                raise join_failed(self.rank, self.world_size,
                                  f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}", settings.timeout_s,
                                  exc) from exc
            self._owned = True
            atexit.register(self.close)
        self.backend = dist.get_backend()
        # objects, barriers and small control tensors travel over gloo (CPU) even next to NCCL
        self._ctrl = None if self.backend == "gloo" else dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=settings.timeout_s))

    @staticmethod
    def from_env(settings: Distributed | None = None, *, on_cuda: bool = False) -> "Comm | None":
        """The Comm of a process started by torchrun (the process group is initialised if it is
        not yet), or None in a single process (no torchrun environment): nothing changes then."""
        if torchrun_env() is None:
            return None
        return Comm(settings or Distributed(), on_cuda=on_cuda)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        """Destroy the process group if this Comm created it (peers then see it gone at once)."""
        if self._owned and dist.is_initialized():
            self._owned = False
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - already broken: nothing left to release
                pass

    # -- errors -------------------------------------------------------------------------------

    def _call(self, what: str, round_index: int, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except DistributedError:
            raise
        except Exception as exc:  # DistBackendError, DistNetworkError, RuntimeError from gloo
            raise lost_peer(self.rank, self.world_size, what, round_index,
                            self.settings.timeout_s, exc) from exc

    # -- the global sync ------------------------------------------------------------------------

    def all_reduce_sum_(self, flat: torch.Tensor, round_index: int,
                        num_parameters: int | None = None) -> None:
        """Sum ``flat [P + Q + 1]`` (this process's corrections, buffer sums and new fault count)
        over every rank, in place. Raises DistributedError when a peer died or timed out.

        With ``sync_dtype`` bf16/fp16: the corrections plus this rank's float32 residual e ``[P]``
        are rounded to the low dtype and summed, e keeps what the rounding lost (error feedback:
        Seide et al. 2014; Karimireddy et al. 2019); the other Q + 1 values go in a float32
        all-reduce. ``bytes_reduced`` counts the bytes handed to the all-reduces."""
        low = SYNC_DTYPES[self.settings.sync_dtype]
        if num_parameters is None or low is torch.float32 or flat.dtype != torch.float32:
            self._call("the all-reduce of the global sync", round_index,
                       lambda: dist.all_reduce(flat, op=dist.ReduceOp.SUM))
            self.bytes_reduced += flat.numel() * flat.element_size()
            return
        P = num_parameters
        head, tail = flat[:P], flat[P:]
        if self._residual is None or self._residual.shape != head.shape:
            self._residual = torch.zeros_like(head)
        head.add_(self._residual)
        sent = head.to(low)
        self._residual.copy_(head).sub_(sent.float())  # e ← (C + e) − round(C + e)
        self._call("the all-reduce of the global sync", round_index,
                   lambda: dist.all_reduce(sent, op=dist.ReduceOp.SUM))
        self._call("the all-reduce of the global sync's buffers", round_index,
                   lambda: dist.all_reduce(tail, op=dist.ReduceOp.SUM))
        head.copy_(sent)
        self.bytes_reduced += sent.numel() * sent.element_size() + tail.numel() * 4

    def check_z(self, z: torch.Tensor, round_index: int) -> None:
        """Raise unless ``z [P]`` is finite and bit-identical on every rank.

        One all-reduce (max) of ``[c, −c, f]``: exact checksums c (``_bit_checksum``; equal iff
        max = min) and a per-rank NaN/Inf flag (a NaN spreads to every rank's z with the same
        bits, which checksums cannot see), read in one copy to the host.

        Raises:
            DivergenceError: z holds NaN/Inf on some rank (names the ranks and the round).
            DistributedError: the copies of z differ, or a peer died or timed out."""
        c = _bit_checksum(z)  # [2]
        flags = torch.zeros(self.world_size, dtype=torch.int64, device=z.device)  # [W]
        flags[self.rank] = (~torch.isfinite(z)).any()
        both = torch.cat([c, -c, flags]).cpu()  # [4 + W], one copy to the host
        mine = int(both[0])
        self._call("the z checksum all-reduce", round_index,
                   lambda: dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self._ctrl))
        hi, lo, flags = both[:2], -both[2:4], both[4:]
        if flags.any():
            raise self._not_finite(flags.nonzero().flatten().tolist(), round_index)
        self._finite_after = round_index
        if not torch.equal(hi, lo):
            raise DistributedError(
                f"rank {self.rank} of {self.world_size}: the copies of the central model z differ "
                f"between ranks after round {round_index} (checksum {mine} here, between "
                f"{lo[0].item()} and {hi[0].item()} over the ranks); a hook or policy changed the "
                "model on one rank only, or the ranks run different code. Stopping",
                task_id="global_sync", device=f"rank {self.rank}", round_index=round_index)

    def _not_finite(self, ranks: list[int], round_index: int) -> DivergenceError:
        """The error of ``check_z`` when the ranks ``ranks`` hold NaN/Inf in z."""
        names = ", ".join(str(r) for r in ranks)
        good = self._finite_after
        since, which = ("", "the last checkpoints") if good is None else (
            f"; it was finite on every rank at the check after round {good}",
            f"checkpoints written after round {good}")
        return DivergenceError(
            f"rank {self.rank} of {self.world_size}: the central model z holds NaN/Inf on "
            f"rank{'s' if len(ranks) > 1 else ''} {names} after round {round_index} (z is "
            f"checked every {self.settings.checksum_every} round(s){since}). A NaN/Inf written "
            "into one rank's z (by a hook, a policy, or memory corrupted outside training) "
            "reaches every rank's z at the next global sync. Stopping; "
            f"{which} may hold it too: restart every rank with --resume from one whose z is "
            "finite",
            task_id="global_sync", device=f"rank {self.rank}", round_index=round_index)

    # -- agreement -------------------------------------------------------------------------------

    def agree(self, facts: dict[str, Any], what: str) -> None:
        """Check that every rank has the same ``facts`` (plain, picklable values, or a
        Fingerprint: its digest travels, and its lines only when the digests differ).

        Raises:
            DistributedError: a fact differs, naming it and its value on each rank (a
                Fingerprint: each rank's first line that differs from rank 0's); or a rank did
                not arrive within the timeout."""
        sent = {k: v.digest if isinstance(v, Fingerprint) else v for k, v in facts.items()}
        step = f"the start-up check of {what}"
        gathered = self.all_gather_object(sent, step, -1)
        for key, fact in facts.items():
            values = [g.get(key) for g in gathered]
            if all(v == values[0] for v in values[1:]):
                continue
            if isinstance(fact, Fingerprint):  # every rank sees the difference: all gather again
                said = first_difference(self.all_gather_object(fact.lines, step, -1))
            else:
                said = "; ".join(f"rank {r}: {_short(v, values[0])}" for r, v in enumerate(values))
            raise DistributedError(
                f"the ranks disagree about {what}: '{key}' differs ({said}). Launch every rank "
                "with the same model, code, loss function, devices, replicas, batch size, "
                "settings and dataset sizes (each rank's own data may differ)",
                task_id="start-up", device=f"rank {self.rank}", round_index=-1)

    def all_gather_object(self, obj: Any, what: str, round_index: int) -> list[Any]:
        """Every rank's ``obj`` (pickled), in rank order, on every rank; ``what`` names the
        collective in the DistributedError raised when a peer died or timed out."""
        gathered: list[Any] = [None] * self.world_size
        self._call(what, round_index, lambda: dist.all_gather_object(gathered, obj, group=self._ctrl))
        return gathered

    def broadcast_floats(self, values: list[float], round_index: int) -> list[float]:
        """Rank 0's ``values`` on every rank (one broadcast of a float64 tensor)."""
        t = torch.tensor(values, dtype=torch.float64)
        self._call("the broadcast of rank 0's decisions", round_index,
                   lambda: dist.broadcast(t, src=0, group=self._ctrl))
        return t.tolist()

    def sum_floats(self, values: list[float], round_index: int) -> list[float]:
        """``values`` summed over every rank (an all-reduce of a float64 tensor)."""
        t = torch.tensor(values, dtype=torch.float64)
        self._call("the all-reduce of the epoch's losses", round_index,
                   lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._ctrl))
        return t.tolist()

    def any_rank(self, flag: bool, round_index: int) -> bool:
        """Whether ``flag`` is True on some rank (an all-reduce, max)."""
        t = torch.tensor([int(flag)])
        self._call("the all-reduce of a flag", round_index,
                   lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._ctrl))
        return bool(t.item())

    def broadcast_tensor_(self, t: torch.Tensor, round_index: int) -> None:
        """Overwrite ``t`` with rank 0's ``t``, in place (rank 0's device tensor, any shape)."""
        self._call("the broadcast of rank 0's tensors", round_index,
                   lambda: dist.broadcast(t, src=0))

    def broadcast_object(self, obj: Any, round_index: int) -> Any:
        """Rank 0's ``obj`` on every rank (pickled)."""
        box = [obj]
        self._call("the broadcast of rank 0's state", round_index,
                   lambda: dist.broadcast_object_list(box, src=0, group=self._ctrl))
        return box[0]

    def gather_object(self, obj: Any, what: str, round_index: int) -> list[Any] | None:
        """Every rank's ``obj`` (pickled), in rank order, on rank 0; None on the other ranks.
        ``what`` names the collective in the DistributedError raised when a peer died or timed
        out."""
        gathered: list[Any] | None = [None] * self.world_size if self.is_main else None
        self._call(what, round_index,
                   lambda: dist.gather_object(obj, gathered, dst=0, group=self._ctrl))
        return gathered

    def scatter_object(self, objs: list[Any] | None, what: str, round_index: int) -> Any:
        """Rank r's entry of rank 0's ``objs`` (one per rank, pickled) on rank r; the other
        ranks pass None. ``what`` names the collective in the DistributedError."""
        box: list[Any] = [None]
        self._call(what, round_index,
                   lambda: dist.scatter_object_list(box, objs if self.is_main else None, src=0,
                                                    group=self._ctrl))
        return box[0]


def _short(value: Any, first: Any) -> str:
    """A fact for an error message; a model fingerprint as its class, tensor count, digest and its
    first tensor that differs from rank 0's (``first``)."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], list):
        name, entries = value
        digest = hashlib.sha256(repr(entries).encode()).hexdigest()[:8]
        text = f"{name} with {len(entries)} tensors (fingerprint {digest})"
        ref = first[1]
        for i in range(max(len(entries), len(ref))):
            mine = entries[i] if i < len(entries) else None
            theirs = ref[i] if i < len(ref) else None
            if mine != theirs:
                def say(e):
                    return f"{e[0]} {list(e[1])} {e[2]}" if e else "none"
                return f"{text}; its tensor #{i} is {say(mine)}" + (
                    f" where rank 0 has {say(theirs)}" if mine is not None or theirs is not None else "")
        return text
    return repr(value)

