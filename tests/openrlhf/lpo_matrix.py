"""The gradient-exactness matrix for the LPO OpenRLHF tests.

The case table over packing, micro-batch sizes, divergences (and the divergence family), off-policy
corrections, temperatures, dynamic batching, the composed KL + entropy loss and listwise replay
(``matrix_cases``); one real ppo_train per case against the window-by-window reference
(``run_matrix_case``, ``gradient_matrix``); and the checks of one row (``check_matrix_row``,
``replay_check``). Set-up comes from lpo_fixtures.py, the references from lpo_references.py.
"""

from __future__ import annotations

from lpo_fixtures import (CPUStrategy, flat_items, keep_threshold, make_actor, make_experiences,
                          make_replay_experiences, make_rollout_samples, max_abs, max_abs_diff, parse_args,
                          plan_group_windows, replay_buffer_groups, run_lpo_step, sample_key)
from lpo_references import reference_steps

DIVERGENCE_CASES = ("fwd", "rev", "js")
FAMILY_CASES = ("hellinger", "tv", "alpha:0.5", "alpha:2", "alpha:-0.5")
PACKING_CASES = (False, True)
MATRIX_LR = 0.5  # large enough that later windows see s far from s_t (checked)


def micro_cases(K):
    return (1, K // 2, K, 2 * K)


def matrix_cases(K, dp):
    """(name, kwargs) of the exactness matrix. dp 1: packing x micro (1, K/2, K, 2K) x divergence,
    the off-policy corrections and the temperatures; dp 2 (two processes, so a subset): micro-batches
    of at most the rank's window (K), fwd and js, one off-policy case per mode, one temperature."""
    micros = micro_cases(K) if dp == 1 else (1, K // 2, K)
    divs = DIVERGENCE_CASES if dp == 1 else ("fwd", "js")
    cases = [(f"packing={int(p)},micro={m},div={d}", dict(packing=p, micro=m, div=d))
             for p in PACKING_CASES for m in micros for d in divs]
    off_micros, off_divs = ((K // 2, K), ("fwd", "rev")) if dp == 1 else ((K // 2,), ("rev",))
    cases += [(f"offpolicy={mode},micro={m},div={d}", dict(packing=False, micro=m, div=d, behaviour_noise=0.3,
                                                            correction=(mode, 0.5, 1.5)))
              for mode in ("clip", "mask") for m in off_micros for d in off_divs]
    temps = ("one", "mean", 0.7) if dp == 1 else ("mean",)
    cases += [(f"temperature={t},micro={K // 2}", dict(packing=False, micro=K // 2, div="fwd", temperature=t))
              for t in temps]
    # dynamic batching (packing forced): a budget below a group's tokens splits groups (samples as
    # items, c from s_t / a pre-pass); larger budgets keep whole groups (one pass)
    budgets = ((16, False), (64, True), (1000, True)) if dp == 1 else ((16, False), (1000, True))
    cases += [(f"dynamic={b},micro=1,div={d}", dict(packing=True, micro=1, div=d, budget=b, whole=w))
              for b, w in budgets for d in (("fwd", "rev") if dp == 1 else ("fwd",))]
    # the stock KL loss (k3, coefficient 0.1) and entropy bonus (0.01) on top of the listwise loss
    cases += [(f"composed=kl+entropy,micro={m}", dict(packing=False, micro=m, div="fwd", composed=True))
              for m in ((K // 2, K) if dp == 1 else (K // 2,))]
    # the divergence family: closed-form c (two-pass) and autograd of the value (one pass)
    family = FAMILY_CASES if dp == 1 else ("alpha:0.5", "tv")
    cases += [(f"family={d},micro={m}", dict(packing=False, micro=m, div=d))
              for d in family for m in ((K // 2, K) if dp == 1 else (K // 2,))]
    cases += [(f"temperature=std,scale={x},micro={K // 2}", dict(packing=False, micro=K // 2, div="fwd",
                                                                  temperature_scale=x))
              for x in ((0.5, 2.0) if dp == 1 else (0.5,))]
    # listwise replay: fresh groups + replayed ones with planted behaviour log-probs, some stale
    replay = ([("fwd", K // 2, None), ("alpha:0.5", K, None), ("rev", K // 2, ("clip", 0.5, 1.5))] if dp == 1
              else [("rev", K // 2, None), ("fwd", 1, None)])
    cases += [(f"replay,micro={m},div={d}" + (f",offpolicy={c[0]}" if c else ""),
               dict(packing=False, micro=m, div=d, replay=True, correction=c, behaviour_noise=0.3 if c else 0.0))
              for d, m, c in replay]
    if dp == 2:  # 3 of the 4 drawn groups pass the filter: one more is dropped so both ranks hold 3 groups
        cases.append((f"replay,keep=3,micro={K // 2},div=fwd",
                      dict(packing=False, micro=K // 2, div="fwd", replay=True, replay_keep=3)))
    return cases


def matrix_case_args(model_dir, K, G, micro, dp, packing, div, correction=None, temperature="std", epochs=2,
                     budget=None, extra=()):
    """Two optimizer windows per rollout batch and two epochs: four steps per ppo_train. ``budget``:
    dynamic batching with that many tokens per micro-batch (OpenRLHF then forces packing)."""
    extra = ["--lpo.divergence", div, "--lpo.temperature", str(temperature), "--train.max_epochs", str(epochs),
             *extra]
    if budget is not None:
        extra += ["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", str(budget),
                  "--rollout.max_tokens_per_gpu", str(budget)]
    if correction is not None:
        mode, low, high = correction
        extra += ["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", mode,
                  "--algo.advantage.is_correction_threshold", str(low), str(high)]
    return parse_args(model_dir, K=K, G=G, micro=micro, dp=dp, packing=packing, train_batch=G * K // 2,
                      extra=extra)


def run_matrix_case(model_dir, state, actor, samples, *, K, G, micro, dp, rank, packing, div, correction=None,
                    temperature="std", behaviour_noise=0.0, seed=1, budget=None, whole=None, composed=False,
                    replay=False, temperature_scale=1.0, replay_keep=None):
    extra = ["--algo.kl.use_loss", "--algo.kl.init_coef", "0.1", "--algo.kl.estimator", "k3",
             "--actor.entropy_coef", "0.01"] if composed else []
    if temperature_scale != 1.0:
        extra += ["--lpo.temperature_scale", str(temperature_scale)]
    behaviour, replay_info = None, None
    if replay:
        actor.model.load_state_dict(state)
        old_groups, behaviour, limit = replay_buffer_groups(actor, G + 2, K, seed=seed + 100)
        if replay_keep is not None:  # a threshold that lets exactly replay_keep of the drawn groups pass
            seed_args = matrix_case_args(model_dir, K, G, micro, dp, packing, div, correction, temperature)
            limit = keep_threshold(actor, old_groups, behaviour, int(seed_args.train.seed), G, replay_keep)
        extra += ["--lpo.replay_batches", "2", "--lpo.replay_ratio", "1", "--lpo.replay_max_abs_s", repr(limit)]
    args = matrix_case_args(model_dir, K, G, micro, dp, packing, div, correction, temperature, budget=budget,
                            extra=extra)
    actor.model.load_state_dict(state)
    if replay:
        exps, replay_info = make_replay_experiences(args, CPUStrategy(args), actor, samples, old_groups, behaviour,
                                                    seed=seed, behaviour_noise=behaviour_noise)
    else:
        exps = make_experiences(args, CPUStrategy(args), actor, samples, seed=seed, behaviour_noise=behaviour_noise,
                                reference_noise=0.2 if composed else 0.0)
    actor.model.load_state_dict(state)
    grads, status, trainer = run_lpo_step(args, actor, exps, rank=rank, dp=dp, lr=MATRIX_LR,
                                          kl_ctl=0.1 if composed else 0.0)
    windows = plan_group_windows(trainer, trainer.replay_buffer.items, dp)
    result = {"grads": grads, "status": status, "modes": [w.mode for w in trainer.last_update.windows]}
    if rank == 0:
        result["refs"] = reference_steps(model_dir, state, exps, windows, K=K, divergence=div,
                                         temperature=temperature, correction=correction,
                                         eps=args.actor.eps_clip_low_high, lr=MATRIX_LR,
                                         kl_coef=0.1 if composed else 0.0, entropy_coef=0.01 if composed else 0.0,
                                         behaviour=behaviour, temperature_scale=temperature_scale)
        if replay:
            result["replay"] = replay_check(exps, replay_info, limit, dp, G)
    return result


def gradient_matrix(model_dir, dp=1, rank=0, K=4, G=4, seed=0, samples_fn=None, cases=None):
    """Every (packing, micro, divergence) case, plus off-policy corrections and temperatures.

    Each case is one ppo_train of the real LPOActorTrainer with SGD (lr 0.5): two windows per
    rollout batch, two epochs, so the steps after the first see updated parameters. Returns, on
    rank 0, {case: {"err": max |step grad - reference| over steps, "scale", "modes"}}.
    ``samples_fn(G, K, seed=)`` makes the rollout samples (default: text, make_rollout_samples);
    ``cases`` the (name, kwargs) list (default: matrix_cases(K, dp)); vlm_harness.py passes both."""
    samples = (samples_fn or make_rollout_samples)(G, K, seed=seed)
    base = make_actor(model_dir, packing=False)
    state = {k: v.clone() for k, v in base.model.state_dict().items()}
    actors = {False: base}
    cases = matrix_cases(K, dp) if cases is None else cases
    table = {}
    for name, kw in cases:
        if kw["packing"] not in actors:
            actors[kw["packing"]] = make_actor(model_dir, packing=kw["packing"])
        r = run_matrix_case(model_dir, state, actors[kw["packing"]], samples, K=K, G=G, dp=dp, rank=rank, **kw)
        whole = kw.get("whole")
        if rank == 0:
            assert len(r["grads"]) == len(r["refs"]) and (len(r["grads"]) == 4 or kw.get("replay")), \
                (name, len(r["grads"]), len(r["refs"]))
            table[name] = {
                "n_steps": len(r["grads"]),
                **({"replay": r["replay"]} if "replay" in r else {}),
                "err": max(max_abs_diff(a, b) for a, b in zip(r["grads"], r["refs"])),
                "rel": max(max_abs_diff(a, b) / max_abs(b) for a, b in zip(r["grads"], r["refs"])),
                "scale": min(max_abs(b) for b in r["refs"]),
                "modes": r["modes"],
                "whole": kw["micro"] % K == 0 if whole is None else whole,
                "kl_moved": abs(r["status"]["lpo/kl_last"] - r["status"]["lpo/kl_start"]),
                "n_params": len(r["grads"][0]),
            }
    return table


def check_matrix_row(row, rel_tol):
    """One exactness case: a non-trivial reference, every step within ``rel_tol`` of it, the expected
    source of c per window (two windows x two epochs; more with replayed groups), and P really moved
    between windows. Replay cases: the staleness filter kept exactly the drawn groups whose planted
    |s_t| is within the threshold, and dropped some."""
    assert row["scale"] > 1e-3, "reference gradient is trivially small; the check would be vacuous"
    assert row["rel"] < rel_tol, f"max |grad - reference| = {row['err']:.3e} ({row['rel']:.1e} relative)"
    n = row.get("n_steps", 4)
    expected = ["one_pass"] * n if row["whole"] else ["shortcut"] + ["pre_pass"] * (n - 1)
    assert row["modes"] == expected
    assert row["kl_moved"] > 1e-3, "the updates did not move P: later windows would not test fresh coefficients"
    if "replay" in row:
        rp = row["replay"]
        assert rp["trained"] and rp["stale"], f"the case must train replayed groups and drop stale ones: {rp}"
        assert rp["trained"] == rp["expected_trained"], rp
        assert rp["logged"] == {"lpo/replay_groups": len(rp["trained"]), "lpo/replay_dropped_stale": len(rp["stale"]),
                                "lpo/replay_drawn": len(rp["worst"]), "lpo/replay_dropped_layout": rp["trim"]}, rp


def replay_check(experiences, info, limit, dp, n_fresh):
    """The drawn groups the staleness filter must keep (max |s_t| <= limit, computed by the harness), in
    draw order with the last ones trimmed until fresh + kept divides over the ranks, against what trained."""
    trained_keys = {sample_key(it) for it in flat_items(experiences)}
    passing = [g for g, w in enumerate(info["worst"]) if w <= limit]
    trim = (n_fresh + len(passing)) % dp
    trained = []
    for g, keys in enumerate(info["drawn"]):
        inside = [k in trained_keys for k in keys]
        assert all(inside) or not any(inside), "a replayed group was split"
        if all(inside):
            trained.append(g)
    st = info["status"]
    return {"trained": trained, "expected_trained": passing[:len(passing) - trim], "trim": trim,
            "stale": [g for g, w in enumerate(info["worst"]) if w > limit], "worst": info["worst"], "limit": limit,
            "logged": {k: int(st[k]) for k in ("lpo/replay_groups", "lpo/replay_dropped_stale", "lpo/replay_drawn",
                                               "lpo/replay_dropped_layout")}}
