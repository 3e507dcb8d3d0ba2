"""One rank of the multi-process tests (tests/test_distributed.py): ``python _dist_worker.py
SCENARIO OUT_DIR`` with torchrun's variables (RANK, WORLD_SIZE, ...) set by the test.

Scenarios: ``train`` (TinyBN, 1 device × 2 replicas per rank, shuffle=False, z checked every
round; saves z, zbuf and the digest), ``mismatch_batch`` / ``mismatch_model`` (rank 1 compiles
another plan), ``diverge`` (rank 1 changes its z after round 3), ``kill`` (rank 1 SIGKILLs itself
after round 3; rank 0 writes a checkpoint every round). Writes ``rank<r>.pt`` (a dict: ``error``
with the DistributedError's message, or the results) into OUT_DIR.
"""

import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

import crossbow_graph as cg  # noqa: E402
from crossbow_graph.errors import DistributedError  # noqa: E402
from crossbow_graph.runtime.comm import z_digest  # noqa: E402
from crossbow_graph.runtime.hooks import Hook  # noqa: E402
from _runtime_helpers import TinyBN, TinyNet, compile_tiny, tiny_data  # noqa: E402

ROUNDS = 8
B, M = 4, 2


class _AtRound(Hook):
    def __init__(self, round_: int, action) -> None:
        self.round, self.action = round_, action

    def after_round(self, ctx) -> None:
        if ctx.plan.rounds_done == self.round:
            self.action(ctx.plan)


def main(scenario: str, out: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    model_cls = TinyNet if scenario == "mismatch_model" and rank == 1 else TinyBN
    batch = 8 if scenario == "mismatch_batch" and rank == 1 else B
    settings = cg.Distributed(timeout_s=float(os.environ.get("CB_TIMEOUT_S", "20")), checksum_every=1)
    result = {}
    try:
        plan = compile_tiny(model_cls, seed=rank, batch_size=batch, devices=1, replicas=M,
                            executor="inline", distributed=settings)  # seed=rank: rank 0's init wins
        data = tiny_data(ROUNDS * B * M * 2)
        hooks, kw = [], {}
        if scenario == "diverge" and rank == 1:
            hooks.append(_AtRound(3, lambda plan: plan.states[0].z.add_(1e-3)))
        if scenario == "kill":
            if rank == 1:
                hooks.append(_AtRound(3, lambda plan: os.kill(os.getpid(), signal.SIGKILL)))
            kw = dict(checkpoint_dir=os.path.join(out, "ckpt"), checkpoint_every=1)
        plan.fit(data, 1, shuffle=False, progress=False, hooks=hooks, **kw)
        result.update(z=plan.central_weights(), zbuf=plan.states[0].zbuf.clone(),
                      digest=z_digest(plan.states[0].z), rounds=plan.rounds_done)
    except DistributedError as exc:
        result["error"] = str(exc)
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
