"""Learning-rate sweep behind the CLI's default lr: SMA on W1 (LeNet-5/MNIST), b=16, 2×2 learners.

Prints one JSON line per (lr, seed): epochs and training seconds to 99.0% test accuracy (evaluated
4 times per epoch, at most 5 epochs) and every evaluation. One intra-op thread, as measured.

    python bench/lr_sweep_w1.py --lrs 0.01 0.02 0.03 --seeds 0 1 2 > bench/results/lr_sweep_w1.jsonl
"""

import argparse
import json
import time

import torch

import crossbow_graph as cg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.01, 0.02, 0.03])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    train, test = cg.datasets.mnist(True), cg.datasets.mnist(False)
    for lr in args.lrs:
        for seed in args.seeds:
            torch.manual_seed(seed)
            plan = cg.compile(cg.models.lenet5(), (train.images[:1],), torch.nn.functional.cross_entropy,
                              batch_size=16, devices=2, replicas=2, optimizer=cg.SGD(lr=lr, momentum=0.9),
                              sync=cg.SMA(central_momentum=0.9))
            start = time.time()
            h = plan.fit(train, args.epochs, eval_dataset=test, evals_per_epoch=4, progress=False, seed=seed,
                         target_accuracy=0.99)
            print(json.dumps(dict(lr=lr, seed=seed, tta=h.time_to_accuracy_s, eta=h.epochs_to_accuracy,
                                  accs=[round(e.test_accuracy, 4) for e in h.evals],
                                  wall=time.time() - start)), flush=True)


if __name__ == "__main__":
    main()
