"""Evaluation during training (OpenRLHF's ``--eval.*`` path) with our grader and the unbiased pass@k.

OpenRLHF 0.11.2's ``PPOTrainer.evaluate`` samples ``--eval.n_samples_per_prompt`` responses per prompt
of ``--eval.dataset`` and logs, per data source, the mean reward (``eval_<ds>_pass1``) and the max over
the n samples (``eval_<ds>_pass<n>``). This module replaces its metric function; it never imports the
trainer (duck-typed: it only reads the attributes named below).

:func:`compute_eval_metrics` (same first three arguments as OpenRLHF's) grades every response again
with the project's grader (the text is decoded from the experience's action tokens; a ``<think>`` the
prompt opened is taken into account), so the verdict is the same as ``lpo-eval score`` and the grader's
extracted answers give maj@k. Keys, per data source ``ds`` (the ``datasource`` column):

* ``eval_<ds>_pass1`` (mean accuracy; OpenRLHF's best-checkpoint tracker auto-selects ``*_pass1``),
  ``eval_<ds>_pass<k>`` for k = 2, 4, ..., n: the unbiased estimator ``1 - C(n-c,k)/C(n,k)``;
* ``eval_<ds>_maj<n>`` (majority vote over grader-equivalent answers), ``eval_<ds>_worst<n>`` (every
  sample correct);
* ``eval_<ds>_response_length_mean`` / ``_p50`` / ``_p90``, ``eval_<ds>_truncated_rate``,
  ``eval_<ds>_no_answer_rate``; and over all sources ``eval_pass1``, ``eval_response_length_mean``,
  ``eval_truncated_rate``.

Labels are the reward labels (:func:`openrlhf_lpo.rewards.reward_func.parse_label`): math labels are
graded by the math grader; other tasks (Countdown) by their reward function, correct meaning reward 1
(maj@k only for math sources: it needs the extracted answers). Without a tokenizer, the experiences'
rewards are used (correct = reward 1) and maj@k is left out.

Wiring (the trainer owns it): override ``evaluate`` in the LPO trainer with :func:`evaluate`.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from openrlhf_lpo.rewards.extraction import assistant_text
from openrlhf_lpo.rewards.grading import GradeResult, grade_math_batch
from openrlhf_lpo.rewards.reward_func import REWARDS, parse_label

from .majority import CORRECT, vote_labels
from .metrics import benchmark_worst_at_k, default_ks, majority_at_k, pass_at_k, percentile


def _response_text(exp: Any, tokenizer: Any) -> str:
    seq = exp.sequences[0]
    mask = exp.action_mask[0].bool()
    return tokenizer.decode(seq[1:][: mask.numel()][mask].tolist(), skip_special_tokens=True)


def _flatten(samples_list: Sequence[Any]) -> list[tuple[str, str, Any, int | None, bool | None]]:
    """(prompt, label, experience, response length, truncated) per sample, in order."""
    out = []
    for s in samples_list:
        for i, prompt in enumerate(s.prompts):
            length = s.response_length[i].item() if s.response_length is not None else None
            trunc = bool(s.truncated[i].item()) if s.truncated is not None else None
            out.append((prompt, s.labels[i] if s.labels else None, s, length, trunc))
    return out


def grade_samples(prompts: list[str], labels: list[Any], responses: list[str]) -> list[GradeResult]:
    """Our grader on each (prompt, label, response): math in the worker pool, choices and other tasks in-process."""
    results: list[GradeResult | None] = [None] * len(responses)
    math_idx, math_texts, math_golds = [], [], []
    for i, (prompt, label, resp) in enumerate(zip(prompts, labels, responses)):
        parsed = parse_label(label)
        text = assistant_text(resp, prompt)
        if parsed["task"] == "math":
            math_idx.append(i)
            math_texts.append(text)
            math_golds.append(str(parsed["answer"]))
        else:  # another task's reward function (Countdown: 1.0 only for a correct expression)
            reward, status = REWARDS[parsed["task"]](text, parsed)
            results[i] = GradeResult(reward == 1.0, "no_answer" if status == "no_answer" else "ok", None)
    if math_idx:
        for i, r in zip(math_idx, grade_math_batch(math_texts, math_golds)):
            results[i] = r
    return results  # type: ignore[return-value]


def compute_eval_metrics(eval_dataloader: Iterable, samples_list: Sequence[Any], n_samples_per_prompt: int,
                         tokenizer: Any = None) -> dict[str, float]:
    """Eval metrics of one evaluation round (see the module docstring for the keys)."""
    if not samples_list:
        return {}
    n = int(n_samples_per_prompt)
    source_of: dict[str, str] = {}
    for datasources, prompts, _labels, _images in eval_dataloader:
        for prompt, ds in zip(prompts, datasources):
            source_of[prompt] = ds
    flat = _flatten(samples_list)
    if len(flat) % n:
        raise ValueError(f"{len(flat)} eval samples is not a multiple of --eval.n_samples_per_prompt {n}")
    if tokenizer is not None:
        responses = [_response_text(s, tokenizer) for _, _, s, _, _ in flat]
        graded = grade_samples([f[0] for f in flat], [f[1] for f in flat], responses)
    else:
        graded = []
        for _, _, s, _, _ in flat:
            reward = float(s.rewards.flatten()[0]) if s.rewards is not None else 0.0
            graded.append(GradeResult(reward == 1.0, "ok", None))
    groups: dict[str, list[list[int]]] = {}
    for start in range(0, len(flat), n):
        prompts = {flat[j][0] for j in range(start, start + n)}
        if len(prompts) != 1:
            raise ValueError(f"eval samples {start}..{start + n - 1} do not share one prompt: samples must come "
                             f"in groups of --eval.n_samples_per_prompt {n}")
        groups.setdefault(source_of.get(flat[start][0], "unknown"), []).append(list(range(start, start + n)))
    logs: dict[str, float] = {}
    all_len, all_trunc, all_acc = [], [], []
    for ds, probs in groups.items():
        correct = [[graded[j].correct for j in p] for p in probs]
        cs = [sum(row) for row in correct]
        logs[f"eval_{ds}_pass1"] = sum(c / n for c in cs) / len(cs)
        for k in default_ks(n)[1:]:
            logs[f"eval_{ds}_pass{k}"] = sum(pass_at_k(n, c, k) for c in cs) / len(cs)
        if n > 1:
            logs[f"eval_{ds}_worst{n}"] = benchmark_worst_at_k(correct, [n])[n]
        if tokenizer is not None:
            logs[f"eval_{ds}_no_answer_rate"] = sum(graded[j].status == "no_answer" for p in probs for j in p) / (len(probs) * n)
            if n > 1 and all(parse_label(flat[p[0]][1])["task"] == "math" for p in probs):  # votes need answers
                rows = [[{"correct": graded[j].correct, "grader_status": graded[j].status,
                          "extracted": graded[j].extracted} for j in p] for p in probs]
                votes = vote_labels(rows, "math", _pool())
                logs[f"eval_{ds}_maj{n}"] = sum(majority_at_k(v, CORRECT, n) for v in votes) / len(votes)
        lengths = [flat[j][3] for p in probs for j in p if flat[j][3] is not None]
        trunc = [flat[j][4] for p in probs for j in p if flat[j][4] is not None]
        if lengths:
            logs[f"eval_{ds}_response_length_mean"] = sum(lengths) / len(lengths)
            logs[f"eval_{ds}_response_length_p50"] = percentile(lengths, 50)
            logs[f"eval_{ds}_response_length_p90"] = percentile(lengths, 90)
        if trunc:
            logs[f"eval_{ds}_truncated_rate"] = sum(trunc) / len(trunc)
        all_len += lengths
        all_trunc += trunc
        all_acc += [c / n for c in cs]
    logs["eval_pass1"] = sum(all_acc) / len(all_acc)
    if all_len:
        logs["eval_response_length_mean"] = sum(all_len) / len(all_len)
    if all_trunc:
        logs["eval_truncated_rate"] = sum(all_trunc) / len(all_trunc)
    return logs


def _pool():
    from openrlhf_lpo.rewards.grading import shared_pool

    return shared_pool()


def evaluate(trainer: Any, global_step: int, **generate_kwargs) -> dict[str, float]:
    """Drop-in body for ``PPOTrainer.evaluate(global_step, **generate_kwargs)`` (OpenRLHF 0.11.2).

    Reads ``trainer.samples_generator``, ``trainer.eval_dataloader``, ``trainer.tokenizer``,
    ``trainer.wandb_logger`` and ``trainer.tensorboard_logger``; logs with their ``log_eval`` as the
    stock method does and returns the logs (the trainer's best-checkpoint logic reads them).
    """
    import time

    start = time.time()
    samples = trainer.samples_generator.generate_eval_samples(**generate_kwargs)
    logs = compute_eval_metrics(trainer.eval_dataloader, samples, generate_kwargs["n_samples_per_prompt"],
                                tokenizer=getattr(trainer, "tokenizer", None))
    for logger in (getattr(trainer, "wandb_logger", None), getattr(trainer, "tensorboard_logger", None)):
        if logger:
            logger.log_eval(global_step, logs)
    logs_str = ", ".join(f"{k}={v:.4f}" for k, v in sorted(logs.items()))
    print(f"lpo eval at global_step {global_step} ({time.time() - start:.0f}s): {logs_str}", flush=True)
    return logs
