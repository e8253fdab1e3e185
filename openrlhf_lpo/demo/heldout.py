"""Held-out evaluation of a demo policy: Pass@k, distinct correct answers, coverage, greedy accuracy.

``n`` responses per held-out problem are sampled at the RL sampling temperature (pure sampling, the
policy itself) from a fixed seed, so two policies evaluated with the same seed see the same problems
and the same random numbers. Per problem ``p`` with ``c_p`` correct responses among ``n``:

* ``pass@k`` = mean over problems of the unbiased estimator ``1 - C(n-c_p, k)/C(n, k)``
  (Chen et al. 2021, Eq. 1), the one ``lpo-eval`` reports (:mod:`evaluation.metrics`);
* ``distinct_correct`` = mean over problems of the number of *different* correct answers among the
  ``n`` responses (a policy that always writes the same right answer scores 1);
* ``coverage`` = mean over problems of that number divided by the problem's number of correct
  answers (``Task.solutions``): the fraction of the answer set the policy still produces;
* ``greedy`` = greedy-decoding accuracy on the same problems.

Keys of the returned dict are prefixed ``heldout_`` (``heldout_pass@4``) so they can sit in a metrics
row beside the training columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from evaluation.metrics import benchmark_pass_at_k

# Held-out problems use a seed stream disjoint from training (and the warm-up's own stopping set).
HELDOUT_SEED = 2_000_003


@dataclass(frozen=True)
class HeldoutConfig:
    prompts: int = 64          # held-out problems
    samples: int = 16          # n responses per problem
    ks: Tuple[int, ...] = (1, 4, 16)
    seed: int = 0              # sampling seed (the problems are fixed by HELDOUT_SEED)
    temperature: float = 1.0

    def validate(self) -> None:
        if self.prompts < 1 or self.samples < 1:
            raise ValueError(f"held-out evaluation needs prompts >= 1 and samples >= 1; got {self.prompts}, "
                             f"{self.samples} (--eval-prompts / --eval-samples)")
        bad = [k for k in self.ks if not 1 <= k <= self.samples]
        if bad:
            raise ValueError(f"Pass@k needs 1 <= k <= samples ({self.samples}); got k={bad} (--eval-samples)")


def heldout_problems(task, n: int) -> List[Tuple[str, str]]:
    """The ``n`` held-out ``(question, label)`` problems every evaluation of ``task`` uses."""
    return task.problems(n, HELDOUT_SEED, split="heldout")


def summarize_samples(task, problems: Sequence[Tuple[str, str]], answers: Sequence[Sequence[str]],
                      ks: Sequence[int]) -> Dict[str, float]:
    """Metrics from already-extracted answers: ``answers[p]`` are the n answers to problem p."""
    if len(answers) != len(problems) or not problems:
        raise ValueError(f"need one answer list per problem; got {len(answers)} for {len(problems)} problems")
    correct = [[task.is_correct(a, label) for a in row] for (_, label), row in zip(problems, answers)]
    passk = benchmark_pass_at_k(correct, ks)
    distinct = [len({a for a, ok in zip(row, oks) if ok}) for row, oks in zip(answers, correct)]
    coverage = [d / len(task.solutions(label)) for d, (_, label) in zip(distinct, problems)]
    out = {f"heldout_pass@{k}": v for k, v in passk.items()}
    out["heldout_distinct_correct"] = sum(distinct) / len(distinct)
    out["heldout_coverage"] = sum(coverage) / len(coverage)
    return out


def evaluate_heldout(model, tokenizer, task, cfg: HeldoutConfig) -> Dict[str, float]:
    """Sample ``cfg.samples`` responses per held-out problem and score them (see module docstring).

    The global torch RNG is seeded with ``cfg.seed`` for the sampling and restored afterwards, so an
    evaluation inside a training loop does not change the training's random numbers.
    """
    import torch

    from openrlhf_lpo.demo.policy import decode, encode_prompts, greedy_responses, sample_responses
    from openrlhf_lpo.demo.task import extract_answer

    cfg.validate()
    problems = heldout_problems(task, cfg.prompts)
    ids, mask = encode_prompts(tokenizer, [q for q, _ in problems])
    max_new = task.max_answer_chars + 2
    was_training = model.training
    model.eval()
    state = torch.get_rng_state()
    try:
        torch.manual_seed(cfg.seed)
        with torch.no_grad():
            resp, _ = sample_responses(model, tokenizer, ids, mask, cfg.samples, max_new, cfg.temperature)
            greedy = greedy_responses(model, tokenizer, ids, mask, max_new)
    finally:
        torch.set_rng_state(state)
        model.train(was_training)
    texts = [extract_answer(t) for t in decode(tokenizer, resp)]
    answers = [texts[i * cfg.samples:(i + 1) * cfg.samples] for i in range(len(problems))]
    out = summarize_samples(task, problems, answers, cfg.ks)
    greedy_texts = [extract_answer(t) for t in decode(tokenizer, greedy)]
    out["heldout_greedy"] = sum(task.is_correct(a, label) for a, (_, label) in zip(greedy_texts, problems)) / len(problems)
    return out


def evaluate_checkpoint(path: str, task, cfg: HeldoutConfig, threads: int = 1) -> Dict[str, float]:
    """:func:`evaluate_heldout` of a saved HF model directory (a pipeline checkpoint)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return evaluate_heldout(model, tokenizer, task, cfg)
