"""Evaluation during training: our metric function on real OpenRLHF 0.11.2 experiences, checked against
OpenRLHF's own compute_eval_metrics (pass1, pass<n>) and brute force (pass@k, maj@n), and the evaluate()
body logging through OpenRLHF's TensorboardLogger."""

import itertools
import json
from types import SimpleNamespace

import pytest
import torch

from evaluation.templates import render_prompt


def _experience(tok, prompt: str, response: str, label: str, reward: float, truncated: bool = False):
    """An Experience as OpenRLHF's SamplesGenerator builds it (_process_response_into_experience)."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    p = tok(prompt, add_special_tokens=False)["input_ids"]
    r = tok(response, add_special_tokens=False)["input_ids"]
    seq = torch.tensor(p + r)
    mask = torch.zeros(len(seq), dtype=torch.long)
    mask[len(p):] = 1
    return Experience(sequences=seq.unsqueeze(0), attention_mask=torch.ones(1, len(seq), dtype=torch.long),
                      action_mask=mask[1:].unsqueeze(0), prompts=[prompt], labels=[label], rewards=torch.tensor([reward]),
                      response_length=torch.tensor([len(r)]), truncated=torch.tensor([truncated]))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from openrlhf_lpo.testing.tiny import build_tokenizer

    tok = build_tokenizer(tmp_path_factory.mktemp("tok"))
    math_label = lambda a: json.dumps({"task": "math", "answer": a})  # noqa: E731
    cd_label = json.dumps({"task": "countdown", "nums": [3, 5], "target": 8})
    # (prompt, label, source, responses); n = 4 samples per prompt
    plan = [
        ("What is 1/2 + 0?", math_label("\\frac{1}{2}"), "math_a",
         ["so \\boxed{0.5}", "\\boxed{1/3}", "\\boxed{\\frac{1}{3}}", "\\boxed{\\frac12}"]),  # 2 right; 1/3 twice
        ("What is 2+2?", math_label("4"), "math_a", ["\\boxed{5}", "\\boxed{5}", "\\boxed{4}", "no idea"]),
        ("What is 3+3?", math_label("6"), "math_a", ["\\boxed{6}"] * 4),
        (render_prompt("r1", "What is 1+1?", "math"), math_label("2"), "math_r1",  # the prompt opened <think>
         ["1+1 is \\boxed{2}", "ok</think> \\boxed{2}", "hmm \\boxed{2}", "</think>\\boxed{3}"]),
        ("Make 8 from 3 and 5.", cd_label, "countdown",
         ["<answer>3+5</answer>", "<answer>3*5</answer>", "<answer>5+3</answer>", "none"]),
    ]
    verdicts = {  # our grader's verdicts, by hand
        "math_a": [[1, 0, 0, 1], [0, 0, 1, 0], [1, 1, 1, 1]],
        "math_r1": [[0, 1, 0, 0]],
        "countdown": [[1, 0, 1, 0]],
    }
    samples, loader = [], []
    for i, (prompt, label, src, responses) in enumerate(plan):
        loader.append(([src], [prompt], [label], [None]))
        row = verdicts[src][sum(1 for p in plan[:i] if p[2] == src)]
        for j, resp in enumerate(responses):
            samples.append(_experience(tok, prompt, resp, label, float(row[j]), truncated=(j == 3)))
    return tok, samples, loader, verdicts


def test_metrics_match_openrlhf_and_brute_force(setup):
    from openrlhf.trainer.ppo_trainer import compute_eval_metrics as stock

    from evaluation.training_eval import compute_eval_metrics

    tok, samples, loader, verdicts = setup
    ours = compute_eval_metrics(loader, samples, 4, tokenizer=tok)
    upstream = stock(loader, samples, 4)  # rewards were set to our verdicts: the shared keys must agree
    for key in ("eval_math_a_pass1", "eval_math_a_pass4", "eval_countdown_pass1", "eval_countdown_pass4",
                "eval_math_r1_pass1", "eval_response_length_mean", "eval_truncated_rate", "eval_math_a_truncated_rate"):
        assert ours[key] == pytest.approx(upstream[key]), key
    for src, rows in verdicts.items():
        for k in (1, 2, 4):
            subsets = list(itertools.combinations(range(4), k))
            ref = sum(sum(any(r[i] for i in s) for s in subsets) / len(subsets) for r in rows) / len(rows)
            assert ours[f"eval_{src}_pass{k}"] == pytest.approx(ref), (src, k)
        assert ours[f"eval_{src}_worst4"] == pytest.approx(sum(all(r) for r in rows) / len(rows))
    # maj@4 by hand: {1/2: 2 votes, 1/3: 2 votes} -> tie -> 1/2; {5: 2, 4: 1} -> 0; {6: 4} -> 1
    assert ours["eval_math_a_maj4"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert "eval_countdown_maj4" not in ours  # Countdown rewards carry no extracted answer to vote with
    assert ours["eval_math_r1_no_answer_rate"] == pytest.approx(0.5)  # unfinished <think>: no answer
    assert ours["eval_pass1"] == pytest.approx(sum(sum(r) / 4 for rows in verdicts.values() for r in rows) / 5)


def test_evaluate_logs_through_openrlhfs_logger(setup, tmp_path):
    from openrlhf.utils.logging_utils import TensorboardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from evaluation.training_eval import evaluate

    tok, samples, loader, _ = setup
    args = SimpleNamespace(logger=SimpleNamespace(tensorboard_dir=str(tmp_path), wandb=SimpleNamespace(run_name="r")))
    tb = TensorboardLogger(args)

    class Generator:  # stands in for SamplesGenerator.generate_eval_samples (vLLM)
        def generate_eval_samples(self, **kw):
            assert kw["n_samples_per_prompt"] == 4 and kw["temperature"] == 0.6
            return samples

    trainer = SimpleNamespace(samples_generator=Generator(), eval_dataloader=loader, tokenizer=tok,
                              wandb_logger=None, tensorboard_logger=tb)
    logs = evaluate(trainer, 20, n_samples_per_prompt=4, temperature=0.6)
    tb.close()
    acc = EventAccumulator(str(tmp_path / "r"))
    acc.Reload()
    (ev,) = acc.Scalars("eval/eval_math_a_pass2")
    assert ev.step == 20 and ev.value == pytest.approx(logs["eval_math_a_pass2"])
