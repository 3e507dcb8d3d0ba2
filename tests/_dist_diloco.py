"""One rank of the two-process DiLoCo test (tests/test_diloco.py): ``python _dist_diloco.py OUT_DIR``
with torchrun's variables set by the test. ``BNNoBias``, 1 device × 2 replicas per rank, b = 4, inner
AdamW, DiLoCo with H = 3 over 8 rounds (z checked on every rank every round), the all-reduce in
``CB_SYNC_DTYPE`` (fp32 or bf16, ``Distributed(sync_dtype=...)``): 4 rounds in a first fit that
writes a checkpoint, the other 4 in a second plan that resumes from it. Writes
``rank<r>.pt``: z, zbuf, the outer optimizer's state, or ``error``."""

import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))

import crossbow_graph as cg  # noqa: E402
from crossbow_graph.errors import TaskError  # noqa: E402
from _plans import TinyBN, make_plan, tiny_data  # noqa: E402

ROUNDS, B, M, H = 8, 4, 2, 3


class BNNoBias(TinyBN):
    """TinyBN whose convolution has no bias: a bias before BatchNorm has a zero gradient up to
    rounding, which Adam's normalisation turns into steps of ±η that depend on the summation
    order (threads), so the one-process oracle could not be matched."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, bias=False)


def plan_of(rank: int) -> cg.Plan:
    """This rank's plan (seed=rank: every rank starts from rank 0's model)."""
    return make_plan(BNNoBias, seed=rank, batch_size=B, devices=1, replicas=M, executor="inline",
                     sync=cg.DiLoCo(sync_every=H),
                     optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
                     distributed=cg.Distributed(timeout_s=20.0, checksum_every=1,
                                                sync_dtype=os.environ.get("CB_SYNC_DTYPE", "fp32")))


def main(out: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    data = tiny_data(ROUNDS * B * M * 2)
    ckpt = os.path.join(out, "ckpt")
    result = {}
    try:
        first = plan_of(rank)  # 4 rounds: one outer step, then a round of the next window
        first.fit(data, 1, shuffle=False, progress=False, checkpoint_dir=ckpt, checkpoint_every=4,
                  hooks=[_StopAfter(4)])
        plan = plan_of(rank)
        plan.fit(data, 1, shuffle=False, progress=False, checkpoint_dir=ckpt, resume=True)
        result.update(z=plan.central_weights(), zbuf=plan.states[0].zbuf.clone(),
                      rounds=plan.rounds_done, outer=plan.rounds.sync_state.state_dict())
    except TaskError as exc:
        result.update(error=str(exc))
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


class _StopAfter(cg.Hook):
    def __init__(self, n: int) -> None:
        self.n = n

    def after_round(self, ctx) -> None:
        ctx.stop = ctx.plan.rounds_done >= self.n


if __name__ == "__main__":
    main(sys.argv[1])
