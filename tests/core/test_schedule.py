"""Divergence schedules (openrlhf_lpo/core/divergence_schedule.py): the stage of every update by step, the entropy switch
(running mean, once, logged step, step boundaries still apply) against a brute-force walk written here,
a checkpoint round trip that keeps the switch, and the parse errors."""

import random

import pytest

from openrlhf_lpo.core.divergence_schedule import DivergenceSchedule, Stage, parse_schedule


def test_parse_and_stage_by_step():
    stages = parse_schedule("fwd@0, alpha:0.5@3 ,rev@7")
    assert stages == [Stage("fwd", 0), Stage("alpha:0.5", 3), Stage("rev", 7)]
    sched = DivergenceSchedule(stages)
    assert [sched.divergence(t) for t in range(10)] == ["fwd"] * 3 + ["alpha:0.5"] * 4 + ["rev"] * 3
    assert parse_schedule("fwd,rev")[0] == Stage("fwd", 0) and parse_schedule("fwd,rev")[1] == Stage("rev", None)
    assert sched.metrics(4) == {"lpo/divergence_stage": 1.0}


def brute_force(stages, h, window, entropies):
    """The divergence of each update, by a direct reading of the rule: update t uses the last stage with
    start <= t; after the first update whose trailing ``window``-mean entropy is < h (and whose next
    update's stage has a successor), every later update uses at least that successor."""
    out, fired_at, floor = [], None, 0
    for t, _ in enumerate(entropies):
        by_step = max(i for i, (_, start) in enumerate(stages) if start is not None and start <= t)
        out.append(stages[max(by_step, floor) if fired_at is not None else by_step][0])
        if fired_at is None and t + 1 >= window and sum(entropies[t + 1 - window:t + 1]) / window < h:
            nxt_by_step = max(i for i, (_, start) in enumerate(stages) if start is not None and start <= t + 1)
            if nxt_by_step + 1 < len(stages):
                fired_at, floor = t, nxt_by_step + 1
    return out, fired_at


@pytest.mark.parametrize("seed", range(30))
def test_entropy_switch_matches_brute_force(seed):
    rng = random.Random(seed)
    text, stages = rng.choice([("fwd@0,rev", [("fwd", 0), ("rev", None)]),
                               ("fwd@0,rev@12", [("fwd", 0), ("rev", 12)]),
                               ("fwd@0,js,rev@15", [("fwd", 0), ("js", None), ("rev", 15)]),
                               ("alpha:1@0,alpha:0.5@5,rev", [("alpha:1", 0), ("alpha:0.5", 5), ("rev", None)])])
    h, window = rng.uniform(0.3, 0.7), rng.randint(1, 4)
    entropies = [max(0.0, 1.0 - 0.05 * t + rng.gauss(0, 0.08)) for t in range(20)]
    sched = DivergenceSchedule(parse_schedule(text), h, window)
    got, fired = [], None
    for t, e in enumerate(entropies):
        got.append(sched.divergence(t))
        if sched.observe(t, e):
            assert fired is None, "the switch fires once"
            fired = t
    want, want_fired = brute_force(stages, h, window, entropies)
    assert got == want and fired == want_fired == sched.switched_at
    if fired is not None:
        m = sched.metrics(fired)
        assert m["lpo/divergence_switched_at"] == fired + 1  # the logged step whose entropy fired it
        assert m["lpo/entropy_running_mean"] == pytest.approx(sum(entropies[fired + 1 - window:fired + 1]) / window)


def test_switch_fires_once_and_a_checkpoint_keeps_it():
    sched = DivergenceSchedule(parse_schedule("fwd,rev"), 0.5, window=2)
    fired = [sched.observe(t, e) for t, e in enumerate([0.9, 0.6, 0.45, 0.4])]  # 2-step means: -, .75, .525, .425
    assert fired == [False, False, False, True]
    assert sched.switched_at == 3 and sched.divergence(3) == "fwd" and sched.divergence(4) == "rev"
    assert not sched.observe(4, 5.0) and sched.divergence(50) == "rev"  # once: a later entropy rise changes nothing
    state = sched.state_dict()
    resumed = DivergenceSchedule(parse_schedule("fwd,rev"), 0.5, window=2)
    assert resumed.divergence(4) == "fwd"
    resumed.load_state_dict(state)
    assert resumed.switched_at == 3 and [resumed.divergence(t) for t in (3, 4, 9)] == ["fwd", "rev", "rev"]
    with pytest.raises(ValueError, match="differs from this run's"):
        DivergenceSchedule(parse_schedule("fwd,js"), 0.5, window=2).load_state_dict(state)


def test_a_resumed_run_with_a_partial_window_continues_the_same_mean():
    full = DivergenceSchedule(parse_schedule("fwd,rev"), 0.5, window=3)
    part = DivergenceSchedule(parse_schedule("fwd,rev"), 0.5, window=3)
    es = [0.7, 0.55, 0.5, 0.45, 0.44]
    for t, e in enumerate(es[:2]):
        full.observe(t, e)
        part.observe(t, e)
    resumed = DivergenceSchedule(parse_schedule("fwd,rev"), 0.5, window=3)
    resumed.load_state_dict(part.state_dict())
    for t, e in enumerate(es[2:], start=2):
        assert full.observe(t, e) == resumed.observe(t, e)
    assert full.switched_at == resumed.switched_at == 4  # 3-step means .583, .5 (not below), .463


@pytest.mark.parametrize("text, kwargs, match", [
    ("fwd@0", {}, "one stage"),
    ("fwd@1,rev@5", {}, "first stage 'fwd@1' must start at step 0"),
    ("fwd@0,rev@5,js@5", {}, "strictly increase"),
    ("fwd@0,rev@x", {}, "'x' is not an integer"),
    ("fwd@0,rev@-2", {}, "must be >= 0"),
    ("fwd@0,,rev@2", {}, "comma-separated"),
    ("fwd@0,kl@2", {}, "unknown divergence 'kl'"),
    ("fwd@0,alpha:nan@2", {}, "a = nan must be a finite"),
    ("fwd,rev", {}, "'rev' has no @step and no entropy switch"),
    ("fwd,js,rev", {"switch_entropy": 0.5}, "at most one stage may have no @step"),
    ("fwd,rev", {"switch_entropy": -0.1}, "must be a positive number"),
    ("fwd,rev", {"switch_entropy": 0.5, "window": 0}, "window must be >= 1"),
])
def test_bad_schedules(text, kwargs, match):
    with pytest.raises(ValueError, match=match):
        DivergenceSchedule(parse_schedule(text), **kwargs)


def test_missing_entropy_is_a_clear_error():
    sched = DivergenceSchedule(parse_schedule("fwd,rev"), 0.5)
    with pytest.raises(ValueError, match="logged no finite response entropy"):
        sched.observe(0, None)
