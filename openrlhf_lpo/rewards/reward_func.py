"""OpenRLHF 0.11.2 reward-function file for Countdown, math and code (``--reward.remote_url <this file>``).

OpenRLHF's single-turn rollout executor loads a ``.py`` given as ``--reward.remote_url`` and
calls ``reward_func(queries, prompts, labels)`` from a worker thread after each generation;
``queries`` are the decoded prompt+response strings. This file is that function for our tasks.

Labels (written by :mod:`openrlhf_lpo.data`) name their task, and tasks are a registry:

* ``{"task": "countdown", "nums": [..], "target": t}`` -> :func:`grade_countdown`;
* ``{"task": "geometry", "answer": "...", "choices": [...] | null}`` -> :func:`geometry_reward`
  (Geometry3k and the synthetic diagrams; an option letter or the value, graded by the math grader);
* ``{"task": "math", "answer": "..."}`` or any label that is not a JSON object -> :func:`math_reward`
  (so MATH-style datasets whose label column is the bare gold answer work unchanged);
* ``{"task": "code", "tests": {...}}`` -> :func:`openrlhf_lpo.rewards.code.code_reward` (the response's
  last fenced code block run against the tests in the sandbox; ``LPO_CODE_REWARD`` fraction / all,
  ``LPO_CODE_*`` limits). When ``LPO_CODE_SANDBOX`` is set (the code recipe sets it), loading this
  file probes the sandbox, so a machine that cannot sandbox fails at start, not at the first reward.

Each task also registers the parser of its label fields (``LABELS``, :func:`register_label`); its reward
reads the label through it, and :func:`check_label` (used by ``lpo-train``'s preflight on every row)
runs the same parser, so a label the preflight accepts is a label the reward can grade.

Returned per batch: ``rewards`` and ``scores`` (float tensors) and ``extra_logs``
(``answer_found``, ``grader_timeout``, ``reward/error_frac``; the same keys for every task and every
batch, so batches concatenate).

A sample whose reward cannot be computed never ends the run: anything its task's reward raises (the
sandbox's ``Popen`` hitting EAGAIN/EMFILE, the grader pool failing to start, a label naming an unknown
task) scores 0 with status ``error``, as does a task that reports status ``error`` itself (the code
sandbox died or exited early). Each such sample counts in ``reward/error_frac`` and its cause goes to
the trainer (:mod:`openrlhf_lpo.rewards.reward_errors`), which stops the run only when errors persist.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Dict, List, Tuple

from openrlhf_lpo.registry import registrar
from openrlhf_lpo.rewards.reward_errors import ERROR_KEY, cause_text, note_error

REWARDS: Dict[str, Callable[[str, dict], Tuple[float, str]]] = {}


def register_reward(name: str):
    """Register ``fn(response, label_dict) -> (reward, status)`` under a task name."""
    return registrar(REWARDS, "reward task", name)


# task -> the parser of its label fields: the task's reward reads the label through it, and lpo-train's
# preflight (openrlhf_lpo/cli/preflight/labels.py) runs it on every row before anything starts.
LABELS: Dict[str, Callable[[dict], object]] = {}


def register_label(name: str):
    """Register ``fn(label_dict) -> fields`` for a task; it raises ValueError naming the bad field."""
    return registrar(LABELS, "label parser of task", name)


def _integer(value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError
    as_int = int(value) if not isinstance(value, str) else int(value.strip())
    if as_int != float(value):
        raise ValueError
    return as_int


@register_label("countdown")
def countdown_fields(label: dict) -> Tuple[List[int], int]:
    """``(nums, target)``: at least two integers and an integer target."""
    nums, target = label.get("nums"), label.get("target")
    try:
        if not isinstance(nums, list) or len(nums) < 2:
            raise ValueError
        nums = [_integer(n) for n in nums]
    except ValueError:
        raise ValueError(f"'nums' must be a list of at least 2 integers, got {nums!r:.80}") from None
    try:
        target = _integer(target)
    except ValueError:
        raise ValueError(f"'target' must be an integer, got {target!r:.80}") from None
    return nums, target


@register_label("math")
def math_answer(label: dict) -> str:
    """The gold answer: a non-empty string."""
    answer = label.get("answer")
    if answer is None or not str(answer).strip():
        raise ValueError(f"'answer' is missing or empty (got {answer!r:.40}): a math label needs a gold answer")
    return str(answer)


@register_label("code")
def code_tests(label: dict):
    """The tests, validated by the sandbox runner's own :func:`~openrlhf_lpo.rewards.code.parse_tests`."""
    from openrlhf_lpo.rewards.code import parse_tests

    try:
        return parse_tests(label.get("tests"))
    except ValueError as e:
        raise ValueError(f"'tests': {e}") from None


@register_label("geometry")
def geometry_fields(label: dict):
    """``(answer, choices or None)`` as :func:`~openrlhf_lpo.rewards.geometry.geometry_reward` reads them."""
    from openrlhf_lpo.rewards.geometry import parse_geometry_label

    answer, choices = parse_geometry_label(label)
    if not answer:
        raise ValueError("'answer' is empty")
    return answer, choices


@register_reward("countdown")
def _countdown(response: str, label: dict) -> Tuple[float, str]:
    from openrlhf_lpo.rewards.countdown import grade_countdown

    format_score = float(os.environ.get("LPO_COUNTDOWN_FORMAT_SCORE", "0.0"))
    nums, target = countdown_fields(label)
    result = grade_countdown(response, nums, target, format_score=format_score)
    return result.reward, result.status


@register_reward("math")
def _math(response: str, label: dict) -> Tuple[float, str]:
    from openrlhf_lpo.rewards.math_reward import math_reward

    return math_reward(response, math_answer(label))


@register_reward("code")
def _code(response: str, label: dict) -> Tuple[float, str]:
    from openrlhf_lpo.rewards.code import code_reward

    code_tests(label)  # a bad test set is an error, even for a response without code
    reward, status = code_reward(response, label["tests"])
    return reward, ("no_answer" if status == "no_code" else status)


@register_reward("geometry")
def _geometry(response: str, label: dict) -> Tuple[float, str]:
    from openrlhf_lpo.rewards.geometry import geometry_reward

    return geometry_reward(response, label)


def parse_label(label) -> dict:
    """Label string -> dict with a ``task``; a non-JSON (or non-object) label is a math gold answer."""
    if isinstance(label, dict):
        parsed = label
    else:
        try:
            parsed = json.loads(label)
        except (TypeError, ValueError):
            parsed = None
        if not isinstance(parsed, dict):
            return {"task": "math", "answer": str(label)}
    task = parsed.get("task")
    if task not in REWARDS:
        raise ValueError(f"label task {task!r} is unknown; registered tasks: {sorted(REWARDS)}")
    return parsed


def check_label(label) -> str:
    """The task of ``label``, after parsing it as that task's reward will (ValueError names the field)."""
    parsed = parse_label(label)
    parser = LABELS.get(parsed["task"])
    if parser is not None:
        parser(parsed)
    return parsed["task"]


def response_of(query: str, prompt: str) -> str:
    """The generated part of ``query`` (prompt + response as decoded by the rollout engine).

    The prompt is removed so that text inside it (Countdown's ``<answer> (1 + 2) / 3 </answer>``
    example) is never graded as the model's answer.
    """
    if prompt and query.startswith(prompt):
        return query[len(prompt):]
    if prompt:
        tail = prompt[-64:]
        cut = query.rfind(tail)
        if cut >= 0:
            return query[cut + len(tail):]
    return query


def score_one(query: str, prompt: str, label) -> Tuple[float, str]:
    """Reward and status of one sample.

    The graded text is the assistant's turn: when the prompt opens a ``<think>`` block (the R1
    templates), it is put back in front of the response, so unfinished reasoning has no answer.
    """
    from openrlhf_lpo.rewards.extraction import assistant_text

    parsed = parse_label(label)
    return REWARDS[parsed["task"]](assistant_text(response_of(query, prompt), prompt), parsed)


def _task_of(label) -> str:
    """The task a label names, for error reports (never raises)."""
    try:
        return str(parse_label(label)["task"])
    except Exception:  # noqa: BLE001  (an unknown task: its own name)
        try:
            return str(json.loads(label).get("task"))
        except Exception:  # noqa: BLE001
            return "?"


def score_or_error(query: str, prompt: str, label) -> Tuple[float, str]:
    """:func:`score_one`, with any exception (and a task's own status ``error``) scored ``(0.0, "error")``
    and reported with its cause."""
    try:
        reward, status = score_one(query, prompt, label)
    except Exception as e:  # noqa: BLE001  (one failed reward must not end the run)
        note_error(_task_of(label), cause_text(e))
        return 0.0, "error"
    if status == "error":
        note_error(_task_of(label), "the task reported status 'error' (for code: the sandbox died, exited early "
                                    "or could not start the program)")
        return 0.0, "error"
    return reward, status


def reward_func(queries: List[str], prompts: List[str], labels: List[str]) -> dict:
    """OpenRLHF reward hook: one reward per query (see module docstring)."""
    import torch

    if not (len(queries) == len(prompts) == len(labels)):
        raise ValueError(
            f"reward_func got {len(queries)} queries, {len(prompts)} prompts, {len(labels)} labels; "
            "they must have the same length"
        )
    rewards, found, timeouts, errors = [], [], [], []
    for query, prompt, label in zip(queries, prompts, labels):
        reward, status = score_or_error(query, prompt, label)
        rewards.append(reward)
        found.append(0.0 if status == "no_answer" else 1.0)
        timeouts.append(1.0 if status == "timeout" else 0.0)
        errors.append(1.0 if status == "error" else 0.0)
    rewards_t = torch.tensor(rewards, dtype=torch.float32)
    return {
        "rewards": rewards_t,
        "scores": rewards_t.clone(),
        "extra_logs": {
            "answer_found": torch.tensor(found, dtype=torch.float32),
            "grader_timeout": torch.tensor(timeouts, dtype=torch.float32),
            ERROR_KEY: torch.tensor(errors, dtype=torch.float32),
        },
    }


if os.environ.get("LPO_CODE_SANDBOX"):  # the code recipe: refuse now (engine start) if programs cannot be sandboxed
    import sys

    from openrlhf_lpo.rewards.code import check_code_sandbox

    print(f"[openrlhf_lpo] code reward sandbox: {check_code_sandbox()}", file=sys.stderr, flush=True)
