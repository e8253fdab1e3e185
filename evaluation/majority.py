"""Answer clusters for majority voting (maj@k), using the grader's own equivalence.

Within one problem, samples vote with their extracted answers; two answers are the same vote when the
grader says they are equivalent:

* every sample graded correct is equivalent to the gold, so they form one cluster (the correct one);
* wrong answers are first grouped by their text (whitespace, ``\\left``/``\\right`` and a final period
  ignored), then the remaining distinct answers are compared pairwise with math-verify through the
  worker pool (answer ``a`` as the gold, ``\\boxed{b}`` as the response; a comparison that times out
  counts as different) and merged (union-find);
* multiple choice: the extracted option (a hedge such as ``C,D`` is its own answer);
* a sample without an answer (``no_answer``, ``timeout``, ``error``) abstains;
* kinds outside :data:`VOTING_KINDS` (code) have no answers to vote with: ``lpo-eval score`` reports no maj@k.
"""

from __future__ import annotations

import re

from openrlhf_lpo.rewards.grading import GraderPool

CORRECT = 0  # the label of the correct cluster
# Kinds whose samples carry an answer to vote with; a kind that has none (code: a program is judged by its
# tests, and "0/3 fail" is no answer) gets no maj@k.
VOTING_KINDS = {"math", "choice"}
_WS = re.compile(r"\s+|\\left|\\right|\\!|\\,|\\;|\\ ")


def _key(answer: str) -> str:
    return _WS.sub("", answer).rstrip(".")


def vote_labels(problems: list[list[dict]], kind: str, pool: GraderPool | None, timeout: float = 5.0) -> list[list[int | None]]:
    """One label per sample (``CORRECT`` for the correct cluster, ``None`` to abstain) for each problem's rows.

    Rows carry ``correct``, ``grader_status`` and ``extracted`` (as in ``samples.jsonl``).
    """
    labels: list[list[int | None]] = []
    pairs: list[tuple[int, int, int]] = []  # (problem, rep a, rep b)
    items: list[tuple[str, str, str]] = []
    reps_of: list[list[str]] = []
    for p, rows in enumerate(problems):
        reps: list[str] = []  # distinct wrong answers, by key
        keys: dict[str, int] = {}
        lab: list[int | None] = []
        for r in rows:
            if r["correct"]:
                lab.append(CORRECT)
            elif r["grader_status"] != "ok" or r.get("extracted") in (None, ""):
                lab.append(None)
            else:
                key = _key(str(r["extracted"])) if kind == "math" else str(r["extracted"])
                if key not in keys:
                    keys[key] = len(reps) + 1
                    reps.append(str(r["extracted"]))
                lab.append(keys[key])
        labels.append(lab)
        reps_of.append(reps)
        if kind == "math" and pool is not None:
            for i in range(len(reps)):
                for j in range(i + 1, len(reps)):
                    pairs.append((p, i + 1, j + 1))
                    items.append(("math_full", "\\boxed{" + reps[j] + "}", reps[i]))
    if items:
        same = pool.grade(items, timeout=timeout)
        parent: dict[tuple[int, int], tuple[int, int]] = {}

        def find(x):
            while parent.get(x, x) != x:
                x = parent[x]
            return x

        for (p, a, b), res in zip(pairs, same):
            if res.correct:
                ra, rb = find((p, a)), find((p, b))
                if ra != rb:
                    parent[max(ra, rb)] = min(ra, rb)
        for p, lab in enumerate(labels):
            labels[p] = [None if v is None else (CORRECT if v == CORRECT else find((p, v))[1]) for v in lab]
    return labels
