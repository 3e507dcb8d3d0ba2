"""Adam on a parameter whose true gradient is 0 (docs/optimizers.md, Which implementation): the
key bias of ``nn.MultiheadAttention`` (softmax is unchanged when all of a query's scores shift by
the same amount) gets rounding noise only, and Adam's normalisation turns that noise into steps
of about ±η. Two runs that round differently — a k = 1 plan (torch's fused AdamW on its one row)
and eager ``torch.optim.AdamW`` with torch's default implementation — then part in that
parameter only.

The job: Embedding(20, 16) → MultiheadAttention(16, 2 heads) → mean over 6 tokens → Linear(16,
20), AdamW lr 0.01, ``--steps`` steps of b = 8 random token sequences (seeded). Prints, per
parameter, the relative difference ‖plan − eager‖/‖eager‖ and the largest absolute one.

Run from the repository root:  python bench/adam_zero_grad.py [--steps 24]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crossbow_graph as cg  # noqa: E402

__all__ = ["Attention", "main"]
E = 16


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, E)
        self.att = nn.MultiheadAttention(E, 2, batch_first=True)
        self.out = nn.Linear(E, 20)

    def forward(self, ids):
        h = self.emb(ids)
        return self.out(self.att(h, h, h, need_weights=False)[0].mean(1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = Attention()
    eager = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 20, (8 * args.steps, 6), generator=g)
    y = ids[:, 0]
    plan = cg.compile(model, (ids[:2],), F.cross_entropy, batch_size=8, devices=1, replicas=1,
                      optimizer=torch.optim.AdamW(model.parameters(), lr=0.01))
    opt = torch.optim.AdamW(eager.parameters(), lr=0.01)
    for t in range(args.steps):
        opt.zero_grad()
        F.cross_entropy(eager(ids[8 * t:8 * t + 8]), y[8 * t:8 * t + 8]).backward()
        opt.step()
    plan.fit(torch.utils.data.TensorDataset(ids, y), 1, shuffle=False, progress=False,
             metrics_every=None)
    ours = dict(plan.central_model().named_parameters())
    rows = []
    for name, p in eager.named_parameters():
        parts = ([(f"{name}[{q}]", slice(i * E, (i + 1) * E)) for i, q in enumerate("qkv")]
                 if name == "att.in_proj_bias" else [(name, slice(None))])
        for label, sl in parts:
            a, b = ours[name].detach()[sl], p.detach()[sl]
            rows.append((label, float((a - b).norm() / b.norm()), float((a - b).abs().max())))
    for label, rel, most in rows:
        print(f"{label:28s} relative {rel:.2e}  largest {most:.2e}")


if __name__ == "__main__":
    main()
