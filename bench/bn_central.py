"""The central model's BatchNorm: z's eval loss with the replicas' mean statistics against
statistics re-estimated for z (training/batchnorm.py), at 1 × 1 and 2 × 2 devices × replicas.

``python bench/bn_central.py [--net mobilenet|small] [--epochs E] [--same epochs|rounds]
[--out FILE]`` trains, the same data and epochs in both configurations (``--same rounds``: 2 × 2
trains 4× the epochs, as many rounds as 1 × 1), SGD(momentum 0.9):

* ``mobilenet`` (default): a MobileNetV2-style net (inverted residual blocks: 1×1 expansion, 3×3
  depthwise, 1×1 projection, each with BatchNorm; 0.1 M parameters) on the first 3,200 MNIST
  training images at b = 16, lr 0.1, 4 epochs; z evaluated on 2,000 MNIST test images;
* ``small``: two 3×3 conv + BatchNorm layers on synthetic 1×8×8 images whose class is their
  brighter quadrant (512 train, 256 test; tests/test_bn_recalibration.py's net), b = 8, lr 0.1,
  8 epochs;

and evaluates z:

* ``mean``: with the replicas' mean running statistics (``bn_recalibration_batches=0``);
* ``recalibrated N``: statistics re-estimated on N training batches of b (the default N = 20),
  with the seconds one re-estimation takes;
* ``learners``: every replica with its own statistics, the mean of their eval losses.

One thread (the host is shared; torch's default two threads run the MobileNet 10× slower when
the other core is busy). docs/design-overview.md §2 (BatchNorm) quotes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Subset, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crossbow_graph as cg  # noqa: E402

__all__ = ["MobileNetV2Style", "SmallBN", "quadrants", "run", "main"]


def _conv_bn(cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1,
             act: bool = True) -> nn.Sequential:
    layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, nn.ReLU6()) if act else nn.Sequential(*layers)


class _InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        self.residual = stride == 1 and cin == cout
        self.body = nn.Sequential(_conv_bn(cin, hidden, 1), _conv_bn(hidden, hidden, 3, stride, hidden),
                                  _conv_bn(hidden, cout, 1, act=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) if self.residual else self.body(x)


class MobileNetV2Style(nn.Module):
    """A small MobileNetV2 for ``[N, 1, 28, 28]`` images → 10 classes."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            _conv_bn(1, 16), _InvertedResidual(16, 16, 1, 1), _InvertedResidual(16, 24, 2, 4),
            _InvertedResidual(24, 24, 1, 4), _InvertedResidual(24, 32, 2, 4),
            _InvertedResidual(32, 32, 1, 4), _conv_bn(32, 64, 1))
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.adaptive_avg_pool2d(self.features(x), 1).flatten(1))


class SmallBN(nn.Module):
    """Two 3×3 conv + BatchNorm2d + ReLU layers, mean-pooled, → 4 classes, on 1×8×8 images."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))))
        return self.fc(x.mean((2, 3)))


def quadrants(n: int, seed: int) -> TensorDataset:
    """n images ``[1, 8, 8]`` of N(0, 0.5²) noise, one quadrant brighter by 1; its index the label."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    x = torch.randn(n, 1, 8, 8, generator=g) * 0.5
    for q in range(4):
        r, c = divmod(q, 2)
        x[y == q, :, 4 * r:4 * r + 4, 4 * c:4 * c + 4] += 1.0
    return TensorDataset(x, y)


NETS = {  # name → (model, train set, test set, b, lr, epochs at 1 × 1)
    "mobilenet": (MobileNetV2Style, lambda: Subset(cg.datasets.mnist(train=True), range(3200)),
                  lambda: Subset(cg.datasets.mnist(train=False), range(2000)), 16, 0.1, 4),
    "small": (SmallBN, lambda: quadrants(512, 0), lambda: quadrants(256, 1), 8, 0.1, 8),
}


def _learners_loss(plan: cg.Plan, test) -> float:
    """The mean eval loss of the replicas, each with its own running statistics."""
    x = torch.stack([test[i][0] for i in range(len(test))])
    y = torch.tensor([int(test[i][1]) for i in range(len(test))])
    losses = []
    with torch.no_grad():
        for state in plan.states:
            for replica in state.replicas:
                replica.eval()
                losses.append(float(F.cross_entropy(replica(x), y)))
                replica.train()
    return sum(losses) / len(losses)


def run(net: str, devices: int, replicas: int, *, epochs: int,
        sweep: tuple[int, ...] = (0, 5, 20, 50)) -> dict:
    """Train ``net`` (a NETS name) in one configuration for ``epochs`` epochs and evaluate z every
    way (see the module)."""
    make, make_train, make_test, batch_size, lr, _ = NETS[net]
    train, test = make_train(), make_test()
    torch.manual_seed(0)
    plan = cg.compile(make(), (train[0][0].unsqueeze(0),), F.cross_entropy,
                      batch_size=batch_size, devices=devices, replicas=replicas,
                      optimizer=cg.SGD(lr=lr, momentum=0.9))
    t0 = time.perf_counter()
    plan.fit(train, epochs, progress=False, metrics_every=None)
    row = {"net": net, "devices": devices, "replicas": replicas, "rounds": plan.rounds_done,
           "epochs": epochs, "train_s": time.perf_counter() - t0,
           "learners": _learners_loss(plan, test)}
    for n in sweep:
        plan.bn_recalibration.batches = n
        t0 = time.perf_counter()
        plan.central_model()  # one re-estimation (cached for the evaluation below)
        seconds = time.perf_counter() - t0
        acc, loss = plan.evaluate(test)
        row["mean" if n == 0 else f"recalibrated {n}"] = {"loss": loss, "accuracy": acc,
                                                          "seconds": seconds}
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--net", choices=sorted(NETS), default="mobilenet")
    parser.add_argument("--epochs", type=int, default=None, help="epochs at 1 x 1 (default: the net's)")
    parser.add_argument("--same", choices=("epochs", "rounds"), default="epochs",
                        help="2 x 2 trains as many epochs as 1 x 1, or as many rounds (4x the epochs)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    base = args.epochs or NETS[args.net][5]
    rows = []
    for devices, replicas in ((1, 1), (2, 2)):
        epochs = base * (devices * replicas if args.same == "rounds" else 1)
        rows.append(run(args.net, devices, replicas, epochs=epochs))
        print(json.dumps(rows[-1]), flush=True)
    one, four = rows
    ratios = {key: four[key]["loss"] / one[key]["loss"] for key in ("mean", "recalibrated 20")}
    for key, ratio in ratios.items():
        print(f"{key}: z's eval loss at 2x2 / at 1x1 = {ratio:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "load_average_1min": os.getloadavg()[0],
                       "command": " ".join(["python bench/bn_central.py",
                                            *(sys.argv[1:] if argv is None else argv)]),
                       "ratio_2x2_to_1x1": ratios, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
