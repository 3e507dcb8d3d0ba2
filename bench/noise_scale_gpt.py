"""The gradient noise scale of W4's GPT along plain AdamW's run to the target (docs/benchmarking.md,
W4): B_noise = tr Σ / |G|², in windows of 128 bytes (McCandlish et al. 2018's simple noise scale),
by the engine's two-batch estimate (crossbow_graph/tuning/metrics.py ``two_batch_estimate``) from
``--windows`` single-window gradients drawn at random from the training split, at the weights of
plain AdamW at its best batch (b = 4 windows, lr 1e-3, W4's schedule) every ``--every`` tokens.

The summary holds every seed's estimates and, per measurement, the median over seeds of the
validation loss and of B_noise (design §2, What it does not reach).

    nice -n 19 python bench/noise_scale_gpt.py --out bench/results/noise_scale_gpt.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)

import crossbow_graph as cg  # noqa: E402
from crossbow_graph.tuning.metrics import two_batch_estimate  # noqa: E402
from lm_baselines import SCHEDULE_TOKENS, VAL_WINDOWS, _data, lr_factor, val_loss  # noqa: E402

def noise_scale(model: torch.nn.Module, train, windows: int, gen: torch.Generator) -> dict:
    """The two-batch estimate from ``windows`` single-window gradients of ``model`` (unchanged):
    |G|², tr Σ and B_noise in windows."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    small_sq = 0.0
    x, y = train.tensors
    for i in torch.randint(len(x), (windows,), generator=gen).tolist():
        grads = torch.autograd.grad(cg.models.lm_loss(model(x[i:i + 1]), y[i:i + 1]), params)
        small_sq += sum(float(g.pow(2).sum()) for g in grads)
        for t, g in zip(total, grads):
            t.add_(g)
    large_sq = sum(float(t.div(windows).pow(2).sum()) for t in total)
    est = two_batch_estimate(small_sq / windows, large_sq, 1, windows)
    return dict(grad_sq=est.grad_sq, trace_sigma=est.trace_sigma, b_noise=est.noise_scale)


def run(seed: int, windows: int, every: int, cap: int) -> list[dict]:
    """Plain AdamW at b = 4 (W4's best batch) to ``cap`` tokens, the estimate every ``every``."""
    torch.manual_seed(seed)
    model = cg.models.gpt().train()
    train, val = _data(model.block_size, VAL_WINDOWS)
    b, gen = 4, torch.Generator().manual_seed(seed + 1)
    per_step = b * model.block_size
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, SCHEDULE_TOKENS // per_step))
    rows = []
    for step in range(cap // per_step + 1):
        tokens = step * per_step
        if tokens % every < per_step:
            rows.append(dict(tokens=tokens, val_loss=val_loss(model, val),
                             **noise_scale(model, train, windows, gen)))
            print(json.dumps(dict(seed=seed, **rows[-1])), flush=True)
        idx = order[step * b:(step + 1) * b]
        loss = cg.models.lm_loss(model(train.tensors[0][idx]), train.tensors[1][idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--windows", type=int, default=256, help="single-window gradients per estimate")
    p.add_argument("--every", type=int, default=2**16, help="tokens between estimates")
    p.add_argument("--cap-tokens", type=int, default=786_432, help="plain AdamW's tokens at most")
    p.add_argument("--out", default=None, help="JSON summary (default: print only)")
    args = p.parse_args(argv)
    if args.windows < 2:
        p.error(f"--windows {args.windows}: the two-batch estimate needs at least 2")
    torch.set_num_threads(1)
    runs = {str(seed): run(seed, args.windows, args.every, args.cap_tokens) for seed in args.seeds}
    median = [dict(tokens=rows[0]["tokens"],
                   val_loss=statistics.median(r["val_loss"] for r in rows),
                   b_noise=statistics.median(r["b_noise"] for r in rows))
              for rows in zip(*runs.values())]
    summary = dict(
        command="python bench/noise_scale_gpt.py" + "".join(
            f" --{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items() if k != "out" and v != p.get_default(k)),
        note="B_noise = tr Σ / |G|² in windows of 128 bytes along plain AdamW (b = 4, lr 1e-3, "
             "W4's schedule), the two-batch estimate from single-window gradients; median: per "
             "measurement, over the seeds",
        windows=args.windows, median=median, runs=runs)
    for m in median:
        print(f"{m['tokens']:>9,} tokens  loss {m['val_loss']:.3f}  B_noise {m['b_noise']:.1f} windows")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
