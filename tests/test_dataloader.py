"""The user's DataLoader: its collate_fn per learner batch, its workers, worker_init_fn and
generator, determinism and resume through it, and the settings the plan refuses."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import random
import re
import signal
import warnings
from collections import namedtuple

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import (BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler,
                              WeightedRandomSampler)

import crossbow_graph as cg
from crossbow_graph.engine.batches import LearnerBatches
from crossbow_graph.engine.shipping import BY_DESCRIPTOR_BYTES, BatchPipe
from crossbow_graph.training.data import BatchSchedule
from crossbow_graph.training.hooks import Hook

from _plans import make_plan
from _reference import eager_steps, flat, reference_sma

VOCAB = 30
Pair = namedtuple("Pair", "tokens lengths")  # a batch may hold any picklable structure
COLLATES = mp.Value("i", 0)  # in shared memory: a DataLoader's forked workers count here too
INITS = mp.Array("q", 16)    # worker_init_fn: [calls, then per call torch.initial_seed()]


class Sequences(Dataset):
    """``n`` token sequences of 2–11 tokens (1 … VOCAB−1; 0 pads) and a label: whether the first
    token is in the upper half. With ``noise``, every read drops a token at random (from NumPy,
    Python's and torch's global RNGs: an augmentation, drawn where the sample is read)."""

    def __init__(self, n: int = 96, noise: bool = False) -> None:
        g = torch.Generator().manual_seed(1)
        lengths = torch.randint(2, 12, (n,), generator=g)
        self.tokens = [torch.randint(1, VOCAB, (int(n_),), generator=g) for n_ in lengths]
        self.labels = torch.tensor([int(t[0] >= VOCAB // 2) for t in self.tokens])
        self.noise = noise

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int):
        x = self.tokens[i]
        if self.noise and len(x) > 2:
            drop = (int(np.random.randint(len(x))) + random.randrange(len(x))
                    + int(torch.randint(len(x), ()))) % len(x)
            x = torch.cat([x[:drop], x[drop + 1:]])
        return x, self.labels[i]


def pad(samples):
    """Pads a batch to its own longest sequence: ``(tokens [n, L], labels [n])``."""
    with COLLATES.get_lock():
        COLLATES.value += 1
    tokens = nn.utils.rnn.pad_sequence([x for x, _ in samples], batch_first=True)
    return tokens, torch.stack([y for _, y in samples])


def count_init(worker_id: int) -> None:
    assert len(torch.utils.data.get_worker_info().dataset.tokens) == 96  # the user's dataset's
    with INITS.get_lock():
        INITS[0] += 1
        INITS[INITS[0]] = torch.initial_seed()


class MeanBag(nn.Module):
    """Embedding, the mean over every position (padding included: the padded length changes the
    output, so a batch padded to another length gives other numbers), a linear classifier."""

    def __init__(self, padding_idx: int | None = 0) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8, padding_idx=padding_idx)
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc(self.emb(x).mean(dim=1))


# the plans of these tests: MeanBag on token ids [N, T] on 2 devices × 2 replicas, SGD(0.2, momentum 0.9)
bag_plan = functools.partial(make_plan, model=MeanBag, example=torch.ones(1, 5, dtype=torch.long), devices=2,
                             replicas=2, optimizer=cg.SGD(lr=0.2, momentum=0.9),
                             sync=cg.SMA(central_momentum=0.9))


def loader(ds=None, **kw) -> DataLoader:
    kw.setdefault("batch_size", 4)
    return DataLoader(Sequences() if ds is None else ds, collate_fn=pad, **kw)


def test_one_learner_through_a_padding_dataloader_trains_as_torch_sgd_does():
    """k = 1: the plan's learner gets batch t of the dataset's order, collated by collate_fn as
    the DataLoader collates it, and its training is torch.optim.SGD's on those batches."""
    ds = Sequences()
    plan = bag_plan(devices=1, replicas=1)
    COLLATES.value = 0
    h = plan.fit(loader(ds, num_workers=2), 2, shuffle=False, progress=False,
                 eval_dataset=loader(ds))
    rounds = 2 * (len(ds) // 4)
    # every learner batch once, the first-batch checks (train, eval), one evaluation per epoch
    assert COLLATES.value == rounds + 2 + 2

    torch.manual_seed(0)
    model = MeanBag()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    eager_steps(model, opt, 2 * list(DataLoader(ds, batch_size=4, collate_fn=pad, shuffle=False)))
    torch.testing.assert_close(flat(plan.central_model().parameters()), flat(model.parameters()),
                               rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # evaluation collates its batch (all 96 samples) with collate_fn too
        x, y = pad([ds[i] for i in range(len(ds))])
        want = F.cross_entropy(plan.central_model()(x), y).item()
    assert h.evals[-1].test_loss == pytest.approx(want, rel=1e-5)


def test_every_learner_gets_its_own_collated_batch_whatever_the_executor_and_workers():
    """k = 4 (2 devices × 2): the SMA reference on learner j's samples of round t, padded on their
    own (not a slice of the round's batch, which would pad to the round's longest), gives z;
    the DataLoader's workers with the process executor, no workers with it, and no workers
    inline give the same numbers."""
    ds = Sequences()
    fits = {}
    for workers, executor in ((2, "process"), (0, "process"), (0, "inline")):
        plan = bag_plan(executor=executor)
        plan.fit(loader(ds, num_workers=workers, shuffle=True), 1, seed=3, progress=False)
        fits[workers, executor] = plan.central_weights()
    order = BatchSchedule(len(ds), shuffle=True, seed=3).order(0).tolist()
    rounds = len(ds) // 16
    batches = [pad([ds[i] for i in order[s:s + 4]]) for s in range(0, rounds * 16, 4)]
    torch.manual_seed(0)
    z, _ = reference_sma(MeanBag(), batches, k=4, rounds=rounds, lr=0.2, momentum=0.9,
                         central_momentum=0.9)
    for got in fits.values():
        torch.testing.assert_close(got, flat(z), rtol=1e-5, atol=1e-6)
    assert torch.equal(fits[2, "process"], fits[0, "process"])
    assert torch.equal(fits[2, "process"], fits[0, "inline"])


def test_worker_init_fn_generator_and_persistent_workers_are_honoured():
    gen = torch.Generator().manual_seed(123)
    base = torch.empty((), dtype=torch.int64).random_(generator=torch.Generator().manual_seed(123))
    for persistent, calls in ((False, 4), (True, 2)):  # 2 epochs × 2 workers, or the 2 kept
        INITS[0] = 0
        plan = bag_plan()
        plan.fit(loader(num_workers=2, worker_init_fn=count_init, generator=gen.manual_seed(123),
                        persistent_workers=persistent), 2, progress=False)
        assert INITS[0] == calls
        # the first epoch's workers are seeded as plain PyTorch seeds them from the generator
        assert sorted(INITS[1:3]) == [int(base) + 0, int(base) + 1]
        assert mp.active_children() == []  # the fit stopped the DataLoader's workers


class StopAfter(Hook):
    def __init__(self, n: int) -> None:
        self.n = n

    def after_round(self, ctx) -> None:
        ctx.stop = ctx.plan.rounds_done >= self.n


def test_fits_through_a_dataloader_are_deterministic_and_resume_bit_identically(tmp_path):
    """Augmentation drawn in the DataLoader's workers: seeded per learner batch from (seed,
    round, learner), so two fits agree and a fit resumed in the middle of an epoch continues
    as the uninterrupted one."""
    def fit(**kw) -> cg.Plan:
        plan = bag_plan(executor="process")
        plan.fit(loader(Sequences(noise=True), num_workers=2), 2, seed=5, progress=False, **kw)
        return plan

    full, again = fit(), fit()
    ckpt = str(tmp_path / "ckpt")
    fit(hooks=[StopAfter(4)], checkpoint_dir=ckpt, checkpoint_every=1)  # 6 rounds per epoch
    resumed = fit(checkpoint_dir=ckpt, checkpoint_every=1, resume=True)
    assert resumed.rounds_done == full.rounds_done == 12
    for other in (again, resumed):
        for a, b in zip(full.states, other.states):
            for key in ("z", "z_prev", "w", "v"):
                assert torch.equal(getattr(a, key), getattr(b, key)), key
    clean = bag_plan(executor="process")
    clean.fit(loader(Sequences(), num_workers=2), 2, seed=5, progress=False)
    assert not torch.equal(clean.central_weights(), full.central_weights())  # the noise is drawn


class Stream(IterableDataset):
    def __iter__(self):
        return iter(Sequences())


@pytest.mark.parametrize("data, message", [
    (lambda ds: DataLoader(ds, batch_size=4, collate_fn=pad,
                           sampler=WeightedRandomSampler(torch.ones(len(ds)), len(ds))),
     r"sampler \(WeightedRandomSampler\).*the plan draws every learner's batch"),
    (lambda ds: DataLoader(ds, batch_sampler=BatchSampler(RandomSampler(ds), 4, False),
                           collate_fn=pad),
     r"batch_sampler \(BatchSampler\).*without batch_sampler"),
    (lambda ds: DataLoader(ds, batch_size=4, collate_fn=pad,
                           sampler=RandomSampler(ds, replacement=True)),
     r"sampler \(RandomSampler\)"),
    (lambda ds: DataLoader(ds, batch_size=None), r"batch_size=None.*give it a batch_size"),
    (lambda ds: DataLoader(Stream(), batch_size=4, collate_fn=pad), r"IterableDataset.*no indices"),
])
def test_a_dataloader_that_chooses_the_samples_is_refused_before_training(data, message):
    plan = bag_plan()
    with pytest.raises(ValueError, match=message):
        plan.fit(data(Sequences()), 1, progress=False)
    assert plan.rounds_done == 0


def test_a_collate_fn_that_returns_no_pair_is_a_clear_error():
    plan = bag_plan()
    with pytest.raises(ValueError, match="collate_fn returned a list of 4 items for a batch of 4 "
                                         "samples, not an"):
        plan.fit(DataLoader(Sequences(), batch_size=4, collate_fn=list), 1, progress=False)


def test_fused_learners_given_batches_of_their_own_lengths_run_one_replica_at_a_time():
    """vmap needs one stacked batch; a group whose batches differ in length learns replica by
    replica (the same numbers, with a warning naming per_replica). (No padding_idx: vmap's
    embedding backward does not keep the padding row's gradient at zero.)"""
    weights = {}
    for mode in ("fused", "per_replica"):
        torch.manual_seed(0)
        plan = bag_plan(devices=1, replicas=2, learner_mode=mode, executor="inline",
                        model=MeanBag(padding_idx=None))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan.fit(loader(), 1, progress=False)
        weights[mode] = plan.central_weights()
        said = [str(w.message) for w in caught if "one replica at a time" in str(w.message)]
        assert bool(said) == (mode == "fused") and all("per_replica" in m for m in said)
    torch.testing.assert_close(weights["fused"], weights["per_replica"], rtol=1e-5, atol=1e-6)

class Indexed(Dataset):
    """Sequences whose target is the sample's index (what the loss records)."""

    def __init__(self, n: int = 96) -> None:
        self.base = Sequences(n)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        return self.base[i][0], torch.tensor(i)


class Recorder:
    def __init__(self) -> None:
        self.seen = []

    def __call__(self, out, y):
        self.seen.append(y)
        return out.pow(2).mean()


class Change(Hook):
    """After the rounds of ``changes``, their Adjustment (as policies and the auto-tuner change
    b and m between rounds); records every round's indices."""

    mutates_replicas = False  # the process executor learns the next round ahead

    def __init__(self, changes=None) -> None:
        self.rounds = []
        self.changes = changes or {2: cg.Adjustment(batch_size=3),
                                   4: cg.Adjustment(replicas_per_device=1)}

    def after_round(self, ctx) -> None:
        self.rounds.append(ctx.batch_indices.clone())
        if ctx.plan.rounds_done in self.changes:
            ctx.plan.adjust(self.changes[ctx.plan.rounds_done])


def test_changes_of_b_and_m_between_rounds_keep_the_learners_on_the_plans_samples():
    record, change = Recorder(), Change()
    torch.manual_seed(0)
    plan = cg.compile(MeanBag(), (torch.ones(1, 5, dtype=torch.long),), record, batch_size=4,
                      devices=2, replicas=2, executor="inline")  # the recorder is in this process
    plan.fit(loader(Indexed(), num_workers=2), 1, progress=False, hooks=[change])
    seen = torch.cat(record.seen)
    assert torch.equal(seen, torch.cat(change.rounds))  # learner by learner, round by round
    assert len(set(seen.tolist())) == len(seen) == 2 * 16 + 2 * 12 + 6 * 6  # disjoint; 4 left
    weights = []
    for workers in (2, 0):  # worker processes: shipped the loader's batches, or fetching their own
        plan = bag_plan(executor="process")
        plan.fit(loader(num_workers=workers), 1, seed=1, progress=False, hooks=[Change()])
        weights.append(plan.central_weights())
    assert torch.equal(weights[0], weights[1])


def test_the_batch_pipe_carries_any_batch_to_a_forked_worker_as_views_of_shared_memory():
    """The coordinator → worker path of loaded rounds (engine/shipping.py): structure, dtypes,
    shapes and values arrive unchanged; the arena grows for a larger batch; a large tensor in
    shared memory travels by descriptor."""
    g = torch.Generator().manual_seed(0)
    batches = [
        LearnerBatches([(torch.randn(4, 3, generator=g), torch.arange(4)),
                        ((torch.ones(4, 2, dtype=torch.float16), torch.tensor(True)),
                         torch.zeros(4, dtype=torch.uint8))], 4),
        LearnerBatches([({"x": torch.randn(4, 7, 5, generator=g), "names": ["a", "b"]},
                         Pair(torch.randint(0, 9, (4, 7), generator=g), torch.empty(0)))], 4),
        LearnerBatches([(torch.randn(64, 1024, generator=g), torch.arange(64))], 64),  # grows
        [torch.randn(BY_DESCRIPTOR_BYTES // 4 + 1, generator=g).share_memory_(), torch.ones(2)],
    ]
    ctx = mp.get_context("fork")
    pipe, back, finished = BatchPipe(ctx), ctx.SimpleQueue(), ctx.Event()

    def worker():
        for _ in batches:
            got = pipe.receive()
            back.put(got.batches if isinstance(got, LearnerBatches) else got)
        finished.wait(10)  # alive until the last answer's tensors were taken (their descriptors)

    proc = ctx.Process(target=worker, daemon=True)
    proc.start()
    try:
        for sent in batches:
            pipe.send(sent)
            got = back.get()
            want = sent.batches if isinstance(sent, LearnerBatches) else sent
            torch.utils._pytree.tree_map(
                lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0)
                if isinstance(a, torch.Tensor) else None, want, got)
            assert type(got) is type(want) and repr(type(got[0])) == repr(type(want[0]))
        finished.set()
        proc.join(timeout=10)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        pipe.close()


def test_a_round_past_the_loaders_last_batch_is_loaded_too():
    """k = 3 × b = 4 ends its loader at sample 96 of 100; m 3 → 1 after round 8 makes a ninth
    round of the last 4 samples."""
    record, change = Recorder(), Change({8: cg.Adjustment(replicas_per_device=1)})
    torch.manual_seed(0)
    plan = cg.compile(MeanBag(), (torch.ones(1, 5, dtype=torch.long),), record, batch_size=4,
                      devices=1, replicas=3, executor="inline")
    plan.fit(loader(Indexed(100), num_workers=2), 1, shuffle=False, progress=False,
             hooks=[change])
    assert torch.equal(torch.cat(record.seen), torch.arange(100))
    assert [len(r) for r in change.rounds] == [12] * 8 + [4]


class LostSample(Sequences):
    def __getitem__(self, i: int):
        if i == 50:
            raise OSError("sample 50: the disk is gone")
        return super().__getitem__(i)


@pytest.mark.parametrize("executor", ["process", "inline"])
def test_a_sample_that_fails_in_a_loader_worker_stops_the_fit_and_every_process(executor):
    plan = bag_plan(executor=executor)
    with pytest.raises(OSError, match="sample 50: the disk is gone"):
        plan.fit(loader(LostSample(), num_workers=2), 1, shuffle=False, progress=False)
    assert mp.active_children() == []  # the loader's workers and the learner processes


def test_samples_of_different_sizes_without_a_collate_fn_are_a_clear_error():
    class Ragged(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return torch.ones(4 + i % 3), i % 2

    plan = cg.compile(nn.Linear(4, 2), (torch.ones(2, 4),), nn.functional.cross_entropy, batch_size=4,
                      devices=1, replicas=2)
    with pytest.raises(ValueError, match="collate_fn that pads"):
        plan.fit(Ragged(), progress=False)
    assert plan.rounds_done == 0


class Points(Dataset):
    """``n`` points of 6 features and a binary label, read one by one (not a TensorDataset, so
    that a DataLoader with workers loads them)."""

    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 6, generator=torch.Generator().manual_seed(n))
        self.y = (self.x[:, 0] > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class SetReplicas(Hook):
    """``plan.set_replicas(m)`` after the rounds of ``changes`` (round → m), as the auto-tuner
    changes m between rounds; with ``ahead``, worker processes learn the next round while it
    runs (``mutates_replicas = False``; the auto-tuner's is True)."""

    def __init__(self, changes: dict[int, int], ahead: bool = False) -> None:
        self.changes = changes
        self.mutates_replicas = not ahead

    def after_round(self, ctx) -> None:
        m = self.changes.get(ctx.plan.rounds_done)
        if m is not None:
            ctx.plan.set_replicas(m)


@contextlib.contextmanager
def deadline(seconds: int, what: str):
    """Fails the test with TimeoutError when the block runs past ``seconds`` (a hang), instead
    of hanging the test run (SIGALRM: its handler runs in the main thread, between waits)."""
    def expired(signum, frame):
        raise TimeoutError(f"{what} did not finish within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# (devices, samples, {round: m}) whose m changes put a round of the new k across the last batch
# that a loader sized for the rounds of the epoch's first k would load (b = 4, 3 epochs)
SPANNING = [(1, 100, {10: 3, 20: 2}), (2, 81, {1: 1, 5: 3, 8: 2}), (1, 77, {1: 2, 6: 3, 9: 2}),
            (2, 108, {5: 3, 8: 2}), (1, 101, {3: 2, 19: 3, 20: 3}), (1, 67, {5: 3, 12: 1, 14: 2}),
            (2, 73, {1: 2, 7: 2, 8: 3}), (1, 88, {8: 1, 11: 3, 16: 2}), (2, 94, {1: 2, 7: 1, 8: 2}),
            (1, 100, {15: 2, 22: 3}), (2, 110, {4: 1, 5: 3, 10: 2}), (1, 69, {3: 1, 8: 2, 13: 3})]


def _m_changes(case: int) -> tuple[int, int, dict[int, int]]:
    """Case ``case``'s devices, samples and m changes: ``SPANNING``, then seeded ones."""
    if case < len(SPANNING):
        return SPANNING[case]
    g = random.Random(case)
    devices, n = g.choice((1, 2)), g.randrange(60, 111)
    fewest = 3 * (n // (devices * 3 * 4))  # 3 epochs at k = 3 per device, b = 4
    rounds = sorted(g.sample(range(1, fewest), 3))
    return devices, n, {r: g.randint(1, 3) for r in rounds}


@pytest.mark.parametrize("case", range(20))
def test_m_changes_under_persistent_loader_workers_finish_with_the_plans_batches(case):
    """The tuner's m changes between rounds (``set_replicas`` from a hook; several near an
    epoch's end) under a DataLoader with 2 persistent workers, inline and with worker processes
    (rounds one after the other, as with the auto-tuner, or the next learnt ahead): the fit
    finishes (a hang fails at the deadline), and its weights are those of the same fit without
    DataLoader workers (the plan's batches, every learner's) bit for bit."""
    devices, n, changes = _m_changes(case)
    executor, ahead = (("inline", False), ("process", False), ("process", True))[case % 3]
    weights = []
    for workers in (2, 0):
        torch.manual_seed(0)
        plan = cg.compile(nn.Linear(6, 2), (torch.ones(1, 6),), F.cross_entropy, batch_size=4,
                          devices=devices, replicas=1, executor=executor)
        data = DataLoader(Points(n), batch_size=4, num_workers=workers,
                          persistent_workers=workers > 0)
        with deadline(60, f"the fit of case {case} ({n} samples, m changes {changes})"):
            plan.fit(data, 3, seed=case, progress=False, hooks=[SetReplicas(changes, ahead)])
        weights.append(plan.central_weights())
    assert plan.rounds_done > max(changes)  # every change happened
    assert torch.equal(weights[0], weights[1])
    assert mp.active_children() == []


def _scores(model: nn.Module, ds: Points, idx: list[int]) -> tuple[float, float]:
    """The hand computation: accuracy and mean cross-entropy of ``model`` on samples ``idx``."""
    with torch.no_grad():
        out = model(ds.x[idx])
    hits = int((out.argmax(1) == ds.y[idx]).sum())
    return hits / len(idx), float(F.cross_entropy(out, ds.y[idx]))


def test_an_evaluation_dataloader_scores_exactly_the_samples_it_yields():
    """Plan.evaluate and fit's eval_dataset score the samples a DataLoader's sampler or
    batch_sampler yields, not its whole dataset: against the accuracy and loss computed by hand
    on the subset (the samples z classifies right, and those it gets wrong), torch's RNG left
    as it was."""
    ds = Points(120)
    torch.manual_seed(0)
    plan = cg.compile(nn.Linear(6, 2), (torch.ones(1, 6),), F.cross_entropy, batch_size=4,
                      devices=1, replicas=2, executor="inline")
    with torch.no_grad():
        right = (plan.central_model()(ds.x).argmax(1) == ds.y).nonzero().flatten().tolist()
    wrong = sorted(set(range(len(ds))) - set(right))
    assert 10 < len(right) < 110  # the whole set scores neither 0 nor 1
    for idx, want_acc in ((right, 1.0), (wrong, 0.0)):
        want = _scores(plan.central_model(), ds, idx)
        assert want[0] == want_acc
        subset = torch.utils.data.SubsetRandomSampler(idx)
        for data in (DataLoader(ds, batch_size=8, sampler=subset),
                     DataLoader(ds, batch_size=None, sampler=subset),  # single samples
                     DataLoader(ds, batch_sampler=BatchSampler(idx, 7, drop_last=False))):
            rng = torch.get_rng_state()
            acc, loss = plan.evaluate(data, batch_size=16)
            assert torch.equal(torch.get_rng_state(), rng)
            assert acc == want[0]
            assert loss == pytest.approx(want[1], rel=1e-5)
    drawn = DataLoader(ds, sampler=WeightedRandomSampler(  # with replacement, from `right` only
        torch.tensor([float(i in right) for i in range(len(ds))]), 50))
    assert plan.evaluate(drawn)[0] == 1.0

    h = plan.fit(ds, 1, progress=False, eval_dataset=DataLoader(
        ds, sampler=torch.utils.data.SubsetRandomSampler(wrong[:20])))
    acc, loss = _scores(plan.central_model(), ds, wrong[:20])
    assert h.evals[-1].test_accuracy == acc
    assert h.evals[-1].test_loss == pytest.approx(loss, rel=1e-5)
    empty = DataLoader(ds, sampler=torch.utils.data.SubsetRandomSampler([]))
    with pytest.raises(ValueError, match=r"eval_dataset is a DataLoader whose sampler "
                                         r"\(SubsetRandomSampler\) yields no sample of its 120"):
        plan.evaluate(empty)


def test_a_dataloaders_own_batch_size_is_a_warning_once_per_fit_naming_the_plans_b():
    """b = 4 is the plan's: a DataLoader's batch_size=16 yields to it with one warning per fit,
    at the line that called fit; the same b is silent."""
    plan = bag_plan(devices=1, replicas=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan.fit(loader(batch_size=16, num_workers=2), 2, progress=False)
    said = [w for w in caught if "batch_size=16" in str(w.message)]
    assert len(said) == 1 and said[0].category is UserWarning and said[0].filename == __file__
    assert re.search(r"train_dataset is a DataLoader with batch_size=16, but every learner takes "
                     r"batches of the plan's b = 4 .* pass DataLoader\(\.\.\., batch_size=4\) to "
                     r"silence", str(said[0].message))
    assert plan.rounds_done == 2 * 96 // 4  # b = 4 samples a round
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan.fit(loader(batch_size=4), 1, progress=False)
    assert not [w for w in caught if "batch_size" in str(w.message)]
