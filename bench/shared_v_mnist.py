"""One second moment per device against each learner's own on a small image job (design §2, "One
second moment per device"): LeNet-5 on the first 2,048 MNIST training images, k learners of
b = 16 at each ``--k`` on one device (inline), ``torch.optim.AdamW`` at each ``--lrs`` with a
cosine over the epochs, SMA's defaults, ``SMA(share_second_moment=False)`` and ``True``; the test
accuracy on 512 test images after each epoch, per seed, and the summary as JSON.

    python bench/shared_v_mnist.py --out bench/results/shared_v_mnist.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crossbow_graph as cg  # noqa: E402


def run(share: bool, lr: float, k: int, epochs: int, seed: int, train, test) -> list[float]:
    """Test accuracy after each epoch of one fit."""
    torch.manual_seed(seed)
    model = cg.models.lenet5()
    plan = cg.compile(model, (train[0][0].unsqueeze(0),), torch.nn.functional.cross_entropy,
                      batch_size=16, devices=1, replicas=k, executor="inline",
                      optimizer=torch.optim.AdamW(model.parameters(), lr=lr),
                      sync=cg.SMA(share_second_moment=share))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(plan.optimizer, T_max=epochs)
    h = plan.fit(train, epochs=epochs, eval_dataset=test, lr_scheduler=sched, progress=False,
                 seed=seed)
    return [e.test_accuracy for e in h.epochs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    p.add_argument("--k", type=int, nargs="+", default=[4, 8], help="learners on the one device")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default=None, help="JSON summary (default: print only)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    train = torch.utils.data.Subset(cg.datasets.mnist(train=True), range(2048))
    test = torch.utils.data.Subset(cg.datasets.mnist(train=False), range(512))
    rows = []
    for k in args.k:
        for lr in args.lrs:
            for share in (False, True):
                acc = {str(s): run(share, lr, k, args.epochs, s, train, test) for s in args.seeds}
                final = [a[-1] for a in acc.values()]
                rows.append(dict(k=k, lr=lr, share_second_moment=share, accuracy=acc,
                                 final_median=statistics.median(final),
                                 final_range=[min(final), max(final)]))
                print(f"k {k}  lr {lr:g}  share_second_moment={share!s:5}  final test accuracy "
                      f"{statistics.median(final):.3f} ({min(final):.3f}–{max(final):.3f})",
                      flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(command="python bench/shared_v_mnist.py", epochs=args.epochs,
                           rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
