"""A checkpoint's learners on another number of ranks (training/reshard.py): the rule, row by row,
against the saved rows, with a row optimizer (AdamW) and float16 loss scales. The real
multi-process resumes (2 → 1, 1 → 2, 2 → 2) are in tests/test_distributed.py."""

import pytest
import torch

from crossbow_graph.training.checkpoint import load_plan_state_dict, plan_state_dict
from crossbow_graph.training.reshard import saved_learners, saved_world_size, split_for_ranks
from _plans import TinyBN, make_plan, tiny_data
from _reference import default_alpha

M = 2


def _plan(seed: int):
    return make_plan(TinyBN, seed=seed, devices=1, replicas=M, executor="inline", precision="fp16",
                     optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))


def _two_rank_checkpoint():
    """A checkpoint as two ranks write it: rank 0's plan state and RNG, rank 1's device states
    (another plan's learners, trained on other data) and RNG in ``peers``."""
    p0, p1 = _plan(0), _plan(1)
    p0.fit(tiny_data(64, seed=0), 1, shuffle=True, progress=False)
    p1.fit(tiny_data(64, seed=1), 1, shuffle=True, progress=False)
    sd0, sd1 = plan_state_dict(p0), plan_state_dict(p1)
    sd1["states"][0]["loss_scales"] = (torch.tensor([1024.0, 2048.0]), torch.tensor([3, 4]))
    return {"plan": sd0, "rng": "rng of rank 0", "world_size": 2,
            "peers": [{"states": sd1["states"], "losses": sd1["losses"], "rng": "rng of rank 1"}]}


def _rows(dev, i):
    opt = dev["optimizer_rows"]
    return dict(w=dev["w"][i], v=dev["v"][i], buf=dev["buf"][i], first=dev["first_step"][i],
                ints=dev["int_buffers"][i], scale=dev["loss_scales"][0][i],
                good=dev["loss_scales"][1][i], age=opt["age"][i],
                opt={k: t[i] for k, t in opt["state"].items()})


def _assert_same_row(got, want):
    for key in ("w", "v", "buf", "scale", "good", "age"):
        assert torch.equal(got[key], want[key]), key
    assert got["first"] == want["first"]
    assert got["ints"].keys() == want["ints"].keys()
    assert all(torch.equal(got["ints"][n], want["ints"][n]) for n in want["ints"])
    assert got["opt"].keys() == want["opt"].keys()
    assert all(torch.equal(got["opt"][k], want["opt"][k]) for k in want["opt"])


def test_three_ranks_keep_the_saved_learners_in_order_and_clone_new_ones_from_z():
    state = _two_rank_checkpoint()
    assert saved_world_size(state) == 2 and saved_learners(state) == 2 * M
    ranks = [state["plan"]["states"][0], state["peers"][0]["states"][0]]
    parts = split_for_ranks(state, 3)
    assert [rng for _, rng in parts] == ["rng of rank 0", "rng of rank 1", None]
    for r in (0, 1):  # learners 0 … 3: the saved ones, rank by rank
        want = state["plan"]["losses"] if r == 0 else state["peers"][0]["losses"]
        assert torch.equal(parts[r][0]["losses"], want)
        dev = parts[r][0]["states"][0]
        for i in range(M):
            _assert_same_row(_rows(dev, i), _rows(ranks[r], i))
    z = ranks[0]["z"]
    for sd, _ in parts:  # every rank's central model, momentum and counters are rank 0's
        dev = sd["states"][0]
        for key in ("z", "z_prev", "zbuf"):
            assert torch.equal(dev[key], ranks[0][key]), key
        assert sd["rounds_done"] == state["plan"]["rounds_done"]
        assert sd["position_in_epoch"] == state["plan"]["position_in_epoch"]
    assert len(parts[2][0]["losses"]) == 0
    new = parts[2][0]["states"][0]  # learners 4, 5: new, by DeviceState.resize's rule
    assert torch.equal(new["w"], z.expand(M, -1)) and not new["v"].any()
    assert torch.equal(new["buf"], ranks[0]["zbuf"].expand(M, -1))
    assert new["first_step"] == [True] * M
    assert not new["optimizer_rows"]["age"].any()  # fresh: torch.optim initialises at the next step
    assert not any(t.any() for t in new["optimizer_rows"]["state"].values())
    assert torch.equal(new["loss_scales"][0], torch.tensor([1024.0, 1024.0]))  # the smallest saved
    assert not new["loss_scales"][1].any()
    want_ints = ranks[0]["int_buffers"][0]
    assert all(torch.equal(ints[n], want_ints[n]) for ints in new["int_buffers"] for n in want_ints)


def test_one_rank_keeps_rank_0s_learners_and_loads_into_a_plan():
    state = _two_rank_checkpoint()
    (sd, rng), = split_for_ranks(state, 1)
    assert rng == "rng of rank 0"
    # the epoch's losses of both ranks' learners, each once (the epoch's mean loss counts them)
    want = torch.cat([state["plan"]["losses"], state["peers"][0]["losses"]])
    assert len(state["plan"]["losses"]) > 0 and torch.equal(sd["losses"], want)
    saved = state["plan"]["states"][0]
    for i in range(M):
        _assert_same_row(_rows(sd["states"][0], i), _rows(saved, i))
    plan = _plan(5)
    load_plan_state_dict(plan, sd)
    s = plan.states[0]
    assert torch.equal(s.w, saved["w"]) and torch.equal(s.z, saved["z"])
    assert torch.equal(s.z_prev, saved["z_prev"]) and torch.equal(s.optim_rows.age, saved["optimizer_rows"]["age"])
    assert plan.settings.alpha_for(plan.num_learners) == pytest.approx(
        default_alpha(M, plan.sync.central_momentum))  # α re-derived for k = M


def test_as_many_ranks_get_their_own_saved_state_unchanged():
    state = _two_rank_checkpoint()
    parts = split_for_ranks(state, 2)
    assert parts[0][0]["states"] is state["plan"]["states"]
    assert parts[1][0]["states"] is state["peers"][0]["states"]
    assert [rng for _, rng in parts] == ["rng of rank 0", "rng of rank 1"]
