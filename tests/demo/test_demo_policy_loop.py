"""The demo's sampling/log-prob helpers and its in-process RL loop, on a micro model."""

import dataclasses
import math

import pytest
import torch

from openrlhf_lpo.demo.loop import RLConfig, grpo_loss, run_inprocess
from openrlhf_lpo.demo.methods import METHODS, parse_methods
from openrlhf_lpo.demo.policy import encode_prompts, response_mask, sample_responses, token_logprobs


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory):
    from openrlhf_lpo.testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m") / "micro", seed=1, hidden_size=32, num_layers=1,
                            num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)


def test_response_mask_brute_force():
    gen = torch.Generator().manual_seed(0)
    resp = torch.randint(0, 4, (50, 7), generator=gen)
    mask = response_mask(resp, eos_id=2)
    for i in range(resp.shape[0]):
        row = resp[i].tolist()
        end = row.index(2) + 1 if 2 in row else len(row)
        assert mask[i].tolist() == [1] * end + [0] * (len(row) - end)


def test_sampling_logprobs_match_generate_scores(micro_model):
    """The recomputed log-probs are exactly those of the policy generate sampled from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(micro_model)
    model = AutoModelForCausalLM.from_pretrained(micro_model).eval()
    ids, att = encode_prompts(tok, ["12+34", "56+78"])
    torch.manual_seed(0)
    out = model.generate(input_ids=ids.repeat_interleave(3, 0), attention_mask=att.repeat_interleave(3, 0),
                         do_sample=True, temperature=0.7, top_k=0, top_p=1.0, max_new_tokens=5,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         output_scores=True, return_dict_in_generate=True)
    resp = out.sequences[:, ids.shape[1]:]
    ref = torch.stack([torch.log_softmax(s.double(), -1).gather(-1, resp[:, t:t + 1]).squeeze(-1)
                       for t, s in enumerate(out.scores)], dim=1)
    with torch.no_grad():
        got = token_logprobs(model, ids.repeat_interleave(3, 0), att.repeat_interleave(3, 0), resp, 0.7)
    mask = response_mask(resp, tok.eos_token_id).bool()
    assert torch.allclose(got[mask].double(), ref[mask], atol=1e-4)
    # sample_responses groups rows prompt-major and pads to max_new_tokens
    torch.manual_seed(0)
    r2, m2 = sample_responses(model, tok, ids, att, 3, 5, 0.7)
    assert r2.shape == (6, 5) and torch.equal(r2[:, : resp.shape[1]], resp)


def test_grpo_loss_against_float64_loop():
    gen = torch.Generator().manual_seed(3)
    logp = torch.randn(6, 4, generator=gen, dtype=torch.float64) * 0.3 - 1
    old = logp + torch.randn(6, 4, generator=gen, dtype=torch.float64) * 0.2
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    adv = torch.randn(6, generator=gen, dtype=torch.float64)
    eps = 0.2
    total = 0.0
    for i in range(6):
        terms = []
        for t in range(4):
            if mask[i, t]:
                r = math.exp(logp[i, t] - old[i, t])
                terms.append(-min(r * adv[i].item(), min(max(r, 1 - eps), 1 + eps) * adv[i].item()))
        total += sum(terms) / len(terms) if terms else 0.0
    assert grpo_loss(logp, old, mask, adv, eps).item() == pytest.approx(total / 6, rel=1e-12)


def test_methods_registry_and_flags():
    assert [m.name for m in parse_methods("lpo-fwd, grpo")] == ["lpo-fwd", "grpo"]
    with pytest.raises(ValueError, match="--methods"):
        parse_methods("lpo-fwd,ppo")
    with pytest.raises(ValueError, match="twice"):
        parse_methods("grpo,grpo")
    assert METHODS["grpo"].pipeline_flags() == ["--algo.advantage.estimator", "group_norm",
                                                "--lpo.temperature", "std", "--lpo.end_kl"]
    assert METHODS["lpo-rev"].pipeline_flags() == ["--algo.advantage.estimator", "lpo", "--lpo.divergence", "rev",
                                                   "--lpo.temperature", "std", "--lpo.end_kl"]
    # every LPO method is paired with the baseline of its temperature
    pairs = {n: m.baseline.name for n, m in METHODS.items()}
    assert pairs["lpo-fwd"] == pairs["lpo-rev"] == pairs["lpo-js"] == pairs["grpo"] == "grpo"
    assert pairs["lpo-fwd@one"] == pairs["lpo-rev@one"] == "dr-grpo" and METHODS["dr-grpo"].temperature == "one"
    assert pairs["lpo-fwd@mean"] == pairs["lpo-rev@mean"] == "maxrl" and METHODS["maxrl"].temperature == "mean"


@pytest.mark.parametrize("field,value,flag", [("k", 1, "--k"), ("steps", 0, "--steps"),
                                              ("prompts_per_step", 3, "--prompts-per-step"), ("lr", -1.0, "--lr")])
def test_rl_config_rejects_bad_values(field, value, flag):
    import dataclasses

    with pytest.raises(ValueError, match=flag):
        dataclasses.replace(RLConfig(), **{field: value}).validate()


@pytest.mark.parametrize("name", ["lpo-fwd", "grpo", "lpo-rev@mean", "maxrl", "dr-grpo"])
def test_inprocess_rows(micro_model, name):
    cfg = RLConfig(task="pairsum", k=4, prompts_per_step=4, steps=2, mini_batches=2, threads=1, eval_every=2,
                   eval_prompts=6, eval_samples=4)
    rows = []
    info = run_inprocess(METHODS[name], cfg, micro_model, on_row=rows.append, progress=False)
    assert [r["step"] for r in rows] == [0, 1, 2] and info["steps"] == 2
    assert set(rows[0]) == {"method", "step", "backend", "elapsed_s", "heldout_pass@1", "heldout_pass@4",
                            "heldout_distinct_correct", "heldout_coverage", "heldout_greedy"}
    for r in rows[1:]:
        assert r["method"] == name
        # rewards are 0/1 over G*K = 16 samples; degenerate fraction is over G = 4 groups
        assert r["reward"] * 16 == pytest.approx(round(r["reward"] * 16))
        assert r["degenerate_groups"] * 4 == pytest.approx(round(r["degenerate_groups"] * 4))
        assert r["informative_groups"] == pytest.approx(1 - r["degenerate_groups"])
        assert 0 <= r["group_distinct_correct"] <= 4 * r["reward"] + 1e-9  # at most the correct ones
        assert 0.0 < r["entropy"] <= math.log(128) + 1e-6
        assert r["kl_target"] >= 0.0 and math.isfinite(r["grad_norm"])
        assert 1.0 <= r["response_length"] <= 5.0
    assert "heldout_pass@4" in rows[-1] and "heldout_pass@1" not in rows[1]


def test_methods_of_a_seed_share_prompts_and_step1_rollouts(micro_model):
    """Pairing: same seed -> same prompts every step and the same rollouts at step 1."""
    cfg = RLConfig(task="pairsum", k=2, prompts_per_step=4, steps=2, threads=1, eval_every=0)
    runs = {}
    for name in ("lpo-fwd", "grpo", "maxrl"):
        rows = []
        run_inprocess(METHODS[name], cfg, micro_model, on_row=rows.append, progress=False)
        runs[name] = rows
    ref = runs["grpo"]
    for rows in runs.values():
        assert [r["prompt_digest"] for r in rows] == [r["prompt_digest"] for r in ref]
        assert rows[0]["rollout_digest"] == ref[0]["rollout_digest"] and rows[0]["reward"] == ref[0]["reward"]
    other = dataclasses.replace(cfg, seed=1)
    rows = []
    run_inprocess(METHODS["grpo"], other, micro_model, on_row=rows.append, progress=False)
    assert rows[0]["prompt_digest"] != ref[0]["prompt_digest"]
