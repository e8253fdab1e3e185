"""Synthetic verifiable tasks for the CPU demo: prompts, reference answers and a 0/1 reward.

The default task is 2-digit addition (``a+b`` with ``a, b`` in [10, 99]): a tiny character-level
Qwen3 learns it in a few minutes of supervised warm-up on 2 CPU cores, and RL with a rule-based
reward then visibly raises the sampled accuracy (see ``docs/demo.md``).

A task is a small object registered by name in :data:`TASKS`; the demo's ``--task`` flag looks it
up there. Each task must be usable by three consumers that never share state:

* the warm-up trainer (``prompt`` + ``answer`` text pairs),
* the prompt dataset written for the ``lpo-train`` pipeline (jsonl rows ``{"prompt", "label"}``),
* the reward function (:func:`score`), also exposed to OpenRLHF through
  ``openrlhf_lpo/demo/reward_func.py``.
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Tuple

TASKS: Dict[str, "Task"] = {}


def register_task(task: "Task") -> "Task":
    """Add ``task`` to :data:`TASKS`; duplicate names are rejected."""
    if task.name in TASKS:
        raise ValueError(f"task {task.name!r} is already registered")
    TASKS[task.name] = task
    return task


def get_task(name: str) -> "Task":
    """Look a task up by name; the error lists the registered ones."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"--task {name!r} is unknown; choose one of {sorted(TASKS)}") from None


@dataclass(frozen=True)
class Task:
    """A verifiable toy task.

    ``sample(rng)`` returns ``(question, answer)`` strings; the question is the user message
    of a one-turn chat, the answer is exactly what the assistant must write before ``<|im_end|>``.
    """

    name: str
    sample: Callable[[random.Random], Tuple[str, str]]
    max_answer_chars: int
    description: str

    def problems(self, n: int, seed: int) -> List[Tuple[str, str]]:
        """``n`` problems drawn with a private RNG seeded by ``seed`` (reproducible)."""
        rng = random.Random(seed)
        return [self.sample(rng) for _ in range(n)]

    def stream(self, seed: int) -> Iterator[Tuple[str, str]]:
        rng = random.Random(seed)
        while True:
            yield self.sample(rng)


def _addition(rng: random.Random) -> Tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"{a}+{b}", str(a + b)


register_task(
    Task(
        name="addition",
        sample=_addition,
        max_answer_chars=3,
        description="2-digit addition a+b (a, b in [10, 99]); reward 1 for the exact sum",
    )
)

# Special tokens the model may emit around its answer; the reward ignores them and surrounding
# whitespace, nothing else (no partial credit, no number extraction from longer text).
_STRIP = re.compile(r"(<\|im_end\|>|<\|endoftext\|>|<\|im_start\|>)")


def extract_answer(response: str) -> str:
    """The response text up to the first end-of-turn token, stripped of whitespace."""
    head = response.split("<|im_end|>", 1)[0]
    return _STRIP.sub("", head).strip()


def score(response: str, label: str) -> float:
    """1.0 if the response (up to end of turn) is exactly the reference answer, else 0.0."""
    return 1.0 if extract_answer(response) == str(label).strip() else 0.0


def write_prompt_dataset(path: str, task: Task, n: int, seed: int) -> str:
    """Write ``n`` problems as jsonl rows ``{"prompt": question, "label": answer}`` atomically.

    The pipeline reads it with ``--data.input_key prompt --data.label_key label`` and applies
    the tokenizer's chat template to the prompt.
    """
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        for question, answer in task.problems(n, seed):
            f.write(json.dumps({"prompt": question, "label": answer}) + "\n")
    os.replace(tmp, path)
    return path
