"""The research agenda in the demo: the tripsum task against brute force, the research methods in the
in-process loop (any divergence name, schedules, tau scale, replay) and as lpo-train flags."""

import dataclasses
import itertools
import math
import re

import pytest
import torch

from openrlhf_lpo.demo.loop import InprocessReplay, RLConfig, _seq_mean, run_inprocess
from openrlhf_lpo.demo.methods import METHODS, Method, parse_methods
from openrlhf_lpo.demo.task import get_task, score

RESEARCH = ["lpo-hellinger", "lpo-tv", "lpo-alpha0.5", "lpo-alpha2", "lpo-fwd2rev-step", "lpo-fwd2rev-entropy",
            "lpo-fwd-tau0.5", "lpo-fwd-tau2", "lpo-fwd-replay"]


# ----------------------------------------------------------------------------- tripsum


def _tripsum_brute(question):
    """Every correct answer from the question text alone: ordered triples of three different listed digits."""
    listed, target = question.split(":")
    digits = [int(c) for c in listed.split(" ")]
    return sorted(f"{a}+{b}+{c}" for a, b, c in itertools.permutations(digits, 3) if a + b + c == int(target))


def test_tripsum_problems_and_answers_against_brute_force():
    task = get_task("tripsum")
    probs = task.problems(500, seed=5)
    assert probs == task.problems(500, seed=5) and probs != task.problems(500, seed=6)
    counts = {6: 0, 12: 0, 18: 0}
    for q, label in probs:
        assert re.fullmatch(r"\d( \d){5}:\d{1,2}", q), q
        digits = q.split(":")[0].split(" ")
        assert len(set(digits)) == 6 and 3 <= int(q.split(":")[1]) <= 24
        answers = _tripsum_brute(q)
        assert list(task.solutions(label)) == answers and len(answers) in counts
        counts[len(answers)] += 1
        assert label == f"tripsum:{''.join(digits)}:{q.split(':')[1]}"
    assert all(c > 10 for c in counts.values()), counts  # uneven difficulty: one, two and three triples


def test_tripsum_checker_against_brute_force():
    task = get_task("tripsum")
    candidates = [f"{a}+{b}+{c}" for a in range(10) for b in range(10) for c in range(10)]
    candidates += ["", "1+2", "1+2+", "1+2+3+4", "12+3+4", "1 + 2 + 3", "a+b+c"]
    for q, label in task.problems(25, seed=11):
        good = set(_tripsum_brute(q))
        for c in candidates:
            assert task.is_correct(c, label) == (c in good), (q, c)
        for c in list(good)[:3] + ["9+9+9"]:
            assert score(c + "<|im_end|>", label) == float(c in good)


def test_tripsum_rejects_labels_of_another_shape():
    with pytest.raises(ValueError, match="tripsum label"):
        get_task("tripsum").is_correct("1+2+3", "tripsum:123:6")


# ----------------------------------------------------------------------------- methods


def test_research_methods_become_lpo_train_flags():
    """Each research method's flags parse through lpo-train's real CLI into the intended namespace."""
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse

    base = ["--actor.model_name_or_path", "unused", "--reward.remote_url", "http://unused",
            "--actor.num_gpus_per_node", "1", "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "2",
            "--train.batch_size", "8", "--train.micro_batch_size", "4"]
    for name in RESEARCH + ["lpo:alpha:0.7"]:
        m = parse_methods(name)[0]
        lpo = build_parser_and_parse(base + m.pipeline_flags()).lpo
        assert lpo.divergence == (m.schedule.split("@")[0] if m.schedule else m.divergence), name
        assert lpo.divergence_schedule == m.schedule and lpo.temperature_scale == m.temperature_scale
        assert lpo.divergence_switch_entropy == m.switch_entropy and lpo.replay_batches == m.replay_batches
        assert lpo.replay_max_abs_s == m.replay_max_abs_s and lpo.end_kl
    with pytest.raises(ValueError, match="--methods lpo:alpha:x: divergence 'alpha:x'"):
        parse_methods("lpo:alpha:x")
    with pytest.raises(ValueError, match="LPO options"):
        Method("bad", "bad", "grpo", None, replay_batches=2)


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory):
    """A micro warm-up on pairsum (~5% sampled accuracy): some right answers among 64 samples a step."""
    from openrlhf_lpo.demo.warmup import WarmupConfig, train_warmup

    cfg = WarmupConfig(task="pairsum", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                       intermediate_size=64, batch_size=32, lr=1e-2, max_steps=WARMUP_STEPS, eval_every=WARMUP_STEPS,
                       eval_prompts=8, target_accuracy=1.0, threads=1)
    out = tmp_path_factory.mktemp("pairsum") / "micro"
    train_warmup(cfg, out, progress=False)
    return str(out)


WARMUP_STEPS = 120
CFG = RLConfig(task="pairsum", k=4, prompts_per_step=4, steps=3, mini_batches=2, threads=1, eval_every=3,
               eval_prompts=4, eval_samples=4)


@pytest.mark.parametrize("name", RESEARCH + ["lpo:js"])
def test_research_methods_run_in_the_loop(micro_model, name):
    method = parse_methods(name)[0]
    rows = []
    run_inprocess(method, CFG, micro_model, on_row=rows.append, progress=False)
    train = rows[1:]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in train)
    assert [r["fresh_rollouts"] for r in train] == [16, 32, 48]
    if method.replay_batches:
        assert train[0]["replay_groups"] == 0 and train[0]["optimizer_steps"] == 2  # nothing to replay yet
        for r in train[1:]:
            assert r["replay_drawn"] == 4 and r["replay_groups"] + r["replay_dropped"] == 4
            assert r["optimizer_steps"] == math.ceil((4 + r["replay_groups"]) / 2)
    else:
        assert all(r["optimizer_steps"] == 2 for r in train)
    if method.schedule:
        assert [r["divergence_stage"] for r in train] == [0.0, 0.0, 0.0]  # @20 and the entropy threshold: later
    if method.temperature_scale != 1.0:
        assert all(r["tau_mean"] >= 0 for r in train)
    # the same prompts as every other method of the seed, and at step 1 the same rollouts
    ref = []
    run_inprocess(METHODS["grpo"], dataclasses.replace(CFG, steps=1, eval_every=0), micro_model,
                  on_row=ref.append, progress=False)
    assert train[0]["prompt_digest"] == ref[0]["prompt_digest"] and train[0]["rollout_digest"] == ref[0]["rollout_digest"]


def test_a_step_schedule_switches_the_loop_divergence(micro_model):
    """fwd@0,rev@1: update 1 is LPO-fwd's (same step-2 rollouts), update 2 is not (rev's loss)."""
    sched = Method("t-sched", "t", "lpo", "fwd", schedule="fwd@0,rev@1")
    cfg = dataclasses.replace(CFG, k=8, prompts_per_step=8, eval_every=0)
    rows = {}
    for m in (sched, METHODS["lpo-fwd"]):
        out = []
        run_inprocess(m, cfg, micro_model, on_row=out.append, progress=False)
        rows[m.name] = out
    s, f = rows["t-sched"], rows["lpo-fwd"]
    assert [r["divergence_stage"] for r in s] == [0.0, 1.0, 1.0]
    assert s[0]["loss"] == f[0]["loss"] and s[1]["rollout_digest"] == f[1]["rollout_digest"]  # update 1 was fwd's
    assert s[1]["loss"] != f[1]["loss"]
    informative = [r["informative_groups"] for r in s]
    assert max(informative) > 0, "the micro model never solved a problem: the loss comparison would be vacuous"


def test_inprocess_replay_measures_s_t_against_the_stored_behaviour(micro_model):
    """InprocessReplay.step_batch: delta = mean over response tokens of log pi_t - log mu for each replayed
    response (mu planted here), groups with any |delta| above the threshold dropped, whole groups kept."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from openrlhf_lpo.demo.policy import encode_prompts, sample_responses, token_logprobs

    tok = AutoTokenizer.from_pretrained(micro_model)
    model = AutoModelForCausalLM.from_pretrained(micro_model).eval()
    task = get_task("pairsum")
    k = 4
    qs = [q for q, _ in task.problems(6, seed=1)]
    ids, att = encode_prompts(tok, qs)
    torch.manual_seed(0)
    resp, mask = sample_responses(model, tok, ids, att, k, 7)
    with torch.no_grad():
        pi = token_logprobs(model, ids.repeat_interleave(k, 0), att.repeat_interleave(k, 0), resp)
    g = torch.Generator().manual_seed(2)
    noise = torch.tensor([0.01, 0.02, 0.05, 1.0, 2.0, 3.0]).repeat_interleave(k)[:, None]
    mu = pi + noise * torch.randn(pi.shape, generator=g)
    groups = [(ids[i][att[i].bool()], resp[i * k:(i + 1) * k], mask[i * k:(i + 1) * k], torch.rand(k),
               mu[i * k:(i + 1) * k]) for i in range(6)]
    method = Method("t-replay", "t", "lpo", "fwd", replay_batches=2, replay_ratio=3.0, replay_max_abs_s=0.3)
    replay = InprocessReplay(method, dataclasses.replace(CFG, k=k), tok.pad_token_id)
    replay.add(groups[:3], step=0)
    replay.add(groups[3:], step=1)
    fresh = groups[:2]  # stand-ins for this step's fresh groups (their behaviour = pi_t)
    fresh = [(p, r, m, rw, pi[i * k:(i + 1) * k]) for i, (p, r, m, rw, _) in enumerate(fresh)]
    out = replay.step_batch(model, tok, fresh, step=2, cfg=dataclasses.replace(CFG, k=k))
    b_ids, b_att, b_resp, b_mask, b_old, b_rewards, delta, order, stats = out
    want = _seq_mean(pi - mu, mask).view(6, k)  # every stored group's delta, computed here
    keep = [i for i in range(6) if float(want[i].abs().max()) <= 0.3]
    assert stats["replay_drawn"] == 6 and stats["replay_groups"] == len(keep) and stats["replay_dropped"] == 6 - len(keep)
    assert 0 < len(keep) < 6
    assert sorted(order) == list(range(2 + len(keep)))
    assert float(delta[:2].abs().max()) == 0.0  # fresh groups: on-policy
    kept_rows = delta[2:].double()
    got = sorted(tuple(round(x, 6) for x in row.tolist()) for row in kept_rows)
    exp = sorted(tuple(round(x, 6) for x in want[i].tolist()) for i in keep)
    assert got == exp
    assert stats["replay_abs_s_max"] == pytest.approx(float(want.abs().max()), rel=1e-5)
    assert b_rewards.shape == (2 + len(keep), k) and b_resp.shape[0] == (2 + len(keep)) * k
