"""Text benchmarks of ``lpo-eval``: the paper's six math sets and its three out-of-distribution sets.

Registered into :mod:`evaluation.benchmark_registry` (``size`` = the full test set, so a smaller copy is
reported as a subset). Gold extraction per benchmark:

* AIME24/AIME25/MATH500: ``answer``. AMC23: ``answer`` is a float (27.0 -> "27").
* Minerva: the last ``\\boxed{}`` of ``solution``.
* OlympiadBench: ``final_answer`` is a list of strings with ``$`` math delimiters: delimiters removed,
  elements joined with ", ".
* MMLU-Pro / ARC-c / GPQA: an option letter (ARC has 22 rows with digit labels 1-4).

**MMLU-Pro** (12,032 test questions): the staged copy is a seed-42 sample of 300, for smoke tests; read
the full set with ``--data mmlu_pro=PATH`` (TIGER-Lab/MMLU-Pro's test split saved as parquet/jsonl:
``question``, ``options`` (up to 10), ``answer`` letter, ``answer_index``) or ``--data
mmlu_pro=TIGER-Lab/MMLU-Pro@test`` (the hub). Options "N/A" are dropped as MMLU-Pro's own scripts do
(the gold letter follows ``answer_index``).

**GPQA-diamond** (198 questions) is never staged (its authors ask that it not be posted in plain text):
pass its path. From the original rows (``Question``, ``Correct Answer``, ``Incorrect Answer 1-3``) each
question is asked in ``orderings`` option orders (default :data:`GPQA_ORDERINGS` = 4, as OpenAI's
simple-evals), each a deterministic shuffle keyed by the question and the ordering index (ordering 0
is the single-order shuffle of earlier versions, keyed by the question alone); the orderings of one
question are distinct permutations. Each ordering is its own problem (id ``<row>-o<r>``), so Pass@1 is
the mean over orderings and Pass@k is each ordering's Pass@k averaged over orderings (one k-sample draw
sees one option order). Files with the options already written into the question (LUFFY's parquet, a
``question``/``answer`` jsonl) have one fixed order.
"""

from __future__ import annotations

import random
from typing import Any

from openrlhf_lpo.rewards.grading import last_boxed

from .benchmark_registry import (
    MATH_Q,
    BenchmarkSpec,
    FieldMissing,
    Problem,
    convert_math,
    field_value,
    math_gold,
    question_text,
    register_benchmark,
    strip_dollars,
)
from .io import sha256_text

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
GPQA_ORDERINGS = 4  # option orderings per GPQA question (simple-evals' n_repeats)
MMLU_PRO_SIZE = 12032


def _conv_minerva(row: dict, i: int) -> Problem:
    if "solution" in row and row["solution"] is not None:
        gold = last_boxed(str(row["solution"]))
        if gold is None:
            raise FieldMissing("field 'solution' has no \\boxed{} answer (Minerva golds are its last box)")
        return Problem(str(i), question_text(row, MATH_Q), gold.strip(), "math")
    if "answer" in row or "reward_model" in row:
        return Problem(str(i), question_text(row, MATH_Q), math_gold(row), "math")
    raise FieldMissing(f"no 'solution' field (Minerva's gold is the last \\boxed{{}} of 'solution'); row has {sorted(row)}")


def _conv_olympiad(row: dict, i: int) -> Problem:
    q = question_text(row, ("question", "problem", "Question"))
    ctx = row.get("context")
    if ctx and "prompt" not in row:
        q = f"{ctx}\n{q}"
    if "reward_model" in row:
        gold = math_gold(row)
    else:
        v = field_value(row, ("final_answer", "answer"), "gold answer (OlympiadBench: 'final_answer', a list)")
        items = v if isinstance(v, (list, tuple)) else [v]
        gold = ", ".join(strip_dollars(str(x)) for x in items)
    return Problem(str(i), q, gold, "math")


def _letter_gold(v: Any, what: str = "answer") -> str:
    s = str(v).strip().upper()
    if s.startswith("(") and s.endswith(")"):
        s = s[1:-1].strip()
    if len(s) != 1 or not s.isalnum():
        raise FieldMissing(f"{what} {v!r} is not a single option letter")
    return s


def _conv_mmlu_pro(row: dict, i: int) -> Problem:
    q = question_text(row, ("question", "problem"))
    if "reward_model" in row:
        return Problem(str(i), q, _letter_gold(field_value(row, ("reward_model.ground_truth",), "gold answer")), "choice")
    if row.get("answer_index") is not None:
        index = int(row["answer_index"])
    elif row.get("answer") is not None:
        index = LETTERS.index(_letter_gold(row["answer"]))
    else:
        raise FieldMissing(f"no gold answer field (looked for 'answer' letter / 'answer_index'; row has {sorted(row)})")
    opts = row.get("options")
    if not (isinstance(opts, (list, tuple)) and opts):  # options already in the question (the staged subset)
        return Problem(str(i), q, LETTERS[index], "choice")
    if not 0 <= index < len(opts) or opts[index] == "N/A":
        raise FieldMissing(f"answer_index {index} does not name one of the {len(opts)} options")
    kept = [j for j, o in enumerate(opts) if o != "N/A"]  # MMLU-Pro's preprocessing drops "N/A" options
    q = q + "\nOptions are:\n" + "\n".join(f"{LETTERS[k]}. {opts[j]}" for k, j in enumerate(kept))
    return Problem(str(i), q, LETTERS[kept.index(index)], "choice", LETTERS[: len(kept)])


def _conv_arc(row: dict, i: int) -> Problem:
    if "reward_model" in row:  # LUFFY parquet: options already in the user message
        q = question_text(row, ("question",))
        return Problem(str(i), q, _letter_gold(field_value(row, ("reward_model.ground_truth",), "gold answer")), "choice")
    q = field_value(row, ("question",), "question")
    ch = field_value(row, ("choices",), "choices (ARC: {'text': [...], 'label': [...]})")
    texts, labels = list(ch["text"]), [str(x) for x in ch["label"]]
    q = str(q) + "\n\n" + "\n".join(f"{lab}) {t}" for lab, t in zip(labels, texts)) + "\n"
    gold = _letter_gold(field_value(row, ("answerKey",), "gold answer ('answerKey')"))
    return Problem(str(i), q, gold, "choice", "".join(labels))


def gpqa_orderings(question: str, count: int) -> list[list[int]]:
    """``count`` distinct option orders of a GPQA question (index 0 = the correct answer), each a shuffle
    seeded by the question and the ordering index (ordering 0: by the question alone)."""
    if not 1 <= count <= 24:
        raise ValueError(f"--gpqa-orderings must be between 1 and 24 (the orders of 4 options), got {count}")
    orders: list[list[int]] = []
    for r in range(count):
        attempt = 0
        while True:
            key = question if r == 0 else f"{question}\x00ordering {r}\x00{attempt}"
            order = list(range(4))
            random.Random(int(sha256_text(key)[:16], 16)).shuffle(order)
            if order not in orders:
                break
            attempt += 1  # this ordering repeats an earlier one: the next seed of the same (question, r)
        orders.append(order)
    return orders


def _gpqa_problems(row: dict, i: int, options: dict) -> list[Problem]:
    want = options.get("orderings")
    if "Correct Answer" not in row:  # options already written into the question: one fixed order
        if want not in (None, 1):
            raise FieldMissing(f"--gpqa-orderings {want} needs GPQA's original rows ('Question', 'Correct Answer', "
                               "'Incorrect Answer 1-3'); this file has its options written into the question")
        if "reward_model" in row:
            q = question_text(row, ("question",))
            return [Problem(str(i), q, _letter_gold(field_value(row, ("reward_model.ground_truth",), "gold answer")),
                            "choice")]
        q = question_text(row, ("question", "problem"))
        return [Problem(str(i), q, _letter_gold(field_value(row, ("answer",), "gold answer")), "choice")]
    question = str(field_value(row, ("Question",), "question ('Question')")).strip()
    choices = [str(row["Correct Answer"]).strip()] + [
        str(field_value(row, (f"Incorrect Answer {j}",), f"'Incorrect Answer {j}'")).strip() for j in (1, 2, 3)]
    count = GPQA_ORDERINGS if want is None else int(want)
    out = []
    for r, order in enumerate(gpqa_orderings(question, count)):
        shown = [choices[j] for j in order]
        q = question + "\n\n" + "\n".join(f"{LETTERS[j]}) {o}" for j, o in enumerate(shown)) + "\n"
        out.append(Problem(str(i) if count == 1 else f"{i}-o{r}", q, LETTERS[order.index(0)], "choice", "ABCD"))
    return out


for _spec in (
    BenchmarkSpec("aime24", "math", "math", 32, convert_math, "aime24/test.jsonl", size=30),
    BenchmarkSpec("aime25", "math", "math", 32, convert_math, "aime25/test.jsonl", size=30),
    BenchmarkSpec("amc23", "math", "math", 32, convert_math, "amc23/test.jsonl", size=40),
    BenchmarkSpec("math500", "math", "math", 1, convert_math, "math500/test.jsonl", aliases=("math-500",), size=500),
    BenchmarkSpec("minerva", "math", "math", 4, _conv_minerva, "minerva_math/test.jsonl", aliases=("minerva_math",),
                  size=272),
    BenchmarkSpec(
        "olympiadbench", "math", "math", 1, _conv_olympiad, "olympiadbench/test.jsonl",
        aliases=("olympiad", "olympiad_bench"), size=675,
    ),
    BenchmarkSpec(
        "mmlu_pro", "choice", "ood", 1, _conv_mmlu_pro, "mmlu_pro/test.jsonl", aliases=("mmlu-pro",), size=MMLU_PRO_SIZE,
        note="the staged copy is a 300-row subset of the 12,032-question test set; pass --data mmlu_pro=PATH "
        "(TIGER-Lab/MMLU-Pro's test split as .parquet/.jsonl) or --data mmlu_pro=TIGER-Lab/MMLU-Pro@test",
    ),
    BenchmarkSpec("arc_c", "choice", "ood", 1, _conv_arc, "arc_challenge/valid.arc_c.parquet",
                  aliases=("arc", "arc_challenge"), size=1172),
    BenchmarkSpec(
        "gpqa_diamond", "choice", "ood", 1, lambda row, i: _gpqa_problems(row, i, {"orderings": 1})[0], None, aliases=("gpqa",), size=198, expand=_gpqa_problems,
        note="not staged (its authors ask that it not be posted in plain text): download the gated HF "
        "dataset Idavidrein/gpqa (gpqa_diamond.csv) and pass --data gpqa_diamond=PATH",
    ),
):
    register_benchmark(_spec)
