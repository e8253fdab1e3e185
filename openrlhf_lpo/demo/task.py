"""Synthetic verifiable tasks for the CPU demo: prompts, labels, every correct answer, a 0/1 reward.

Three tasks are registered in :data:`TASKS` (the demo's ``--task`` flag looks them up):

* ``addition``: 2-digit addition (``12+34`` -> ``46``), one correct answer per prompt;
* ``pairsum``: five distinct digits and a target (``3 8 1 6 5:9``); the answer names two of the
  digits that add up to the target (``8+1``, ``1+8``, ``3+6`` or ``6+3``). Every prompt has exactly
  four correct answers (two disjoint pairs, both orders), so a policy can keep several of them or
  collapse onto one: response diversity and Pass@k can move independently of accuracy. A fifth of
  the (digit set, target) problems is reserved for held-out evaluation and never trained on.
* ``tripsum``: six distinct digits and a target (``3 8 1 6 5 0:9``); the answer names three listed
  digits that add up to it (``3+6+0``). One to three triples per prompt (6, 12 or 18 correct answers,
  every order), so problems differ in difficulty: after the warm-up a fifth of the held-out problems or
  more are never solved in 16 samples, and Pass@k can move (on pairsum Pass@16 is 1.0 from the start).

A task is a small frozen object; each consumer uses only its public methods and never shares state:

* the warm-up trainer (:meth:`Task.sft_stream`: question + one correct answer drawn uniformly),
* the prompt dataset of the ``lpo-train`` pipeline (jsonl rows ``{"prompt", "label"}``),
* the reward (:func:`score`), also exposed to OpenRLHF through ``openrlhf_lpo/demo/reward_func.py``,
* the held-out evaluation (:meth:`Task.problems` with ``split="heldout"``, :meth:`Task.solutions`).

A label carries what the reward needs. ``addition`` keeps its historical label, the reference answer
itself (``"46"``); other tasks write ``"<task>:<payload>"`` (``"pairsum:38165:9"``) so that one reward
file scores every task.
"""

from __future__ import annotations

import json
import os
import random
import re
import zlib
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from openrlhf_lpo.registry import register_unique

TASKS: Dict[str, "Task"] = {}

SPLITS = ("all", "train", "heldout")


def register_task(task: "Task") -> "Task":
    """Add ``task`` to :data:`TASKS`; duplicate names are rejected."""
    return register_unique(TASKS, "task", task.name, task)


def get_task(name: str) -> "Task":
    """Look a task up by name; the error lists the registered ones."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"--task {name!r} is unknown; choose one of {sorted(TASKS)}") from None


@dataclass(frozen=True)
class Task:
    """A verifiable toy task.

    ``draw(rng)`` returns ``(question, label)``: the question is the user message of a one-turn chat;
    ``solutions(label)`` lists every string the assistant may write before ``<|im_end|>`` to be
    right (sorted, non-empty); ``check(answer, label)`` decides one answer (``answer in solutions``
    when not given). ``heldout_fraction`` > 0 reserves that fraction of problems for evaluation,
    chosen by a hash of the label (:meth:`split_of`); 0 means one pool (held-out problems are then
    only drawn with another seed).
    """

    name: str
    draw: Callable[[random.Random], Tuple[str, str]]
    solutions: Callable[[str], Tuple[str, ...]]
    max_answer_chars: int
    description: str
    check: Optional[Callable[[str, str], bool]] = None
    heldout_fraction: float = 0.0
    example: str = ""

    def is_correct(self, answer: str, label: str) -> bool:
        if self.check is not None:
            return bool(self.check(answer, label))
        return answer in self.solutions(label)

    def split_of(self, label: str) -> str:
        """``"heldout"`` or ``"train"`` (deterministic in the label; ``"train"`` without a split)."""
        if self.heldout_fraction <= 0:
            return "train"
        bucket = zlib.crc32(_canonical(label).encode()) % 10_000
        return "heldout" if bucket < self.heldout_fraction * 10_000 else "train"

    def _draw_split(self, rng: random.Random, split: str) -> Tuple[str, str]:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if split == "all" or self.heldout_fraction <= 0:
            return self.draw(rng)
        while True:
            question, label = self.draw(rng)
            if self.split_of(label) == split:
                return question, label

    def problems(self, n: int, seed: int, split: str = "all") -> List[Tuple[str, str]]:
        """``n`` ``(question, label)`` problems drawn with a private RNG seeded by ``seed``."""
        rng = random.Random(seed)
        return [self._draw_split(rng, split) for _ in range(n)]

    def stream(self, seed: int, split: str = "all") -> Iterator[Tuple[str, str]]:
        rng = random.Random(seed)
        while True:
            yield self._draw_split(rng, split)

    def sft_stream(self, seed: int, split: str = "train") -> Iterator[Tuple[str, str]]:
        """``(question, answer)`` pairs for supervised warm-up: each answer is drawn uniformly from
        the problem's solutions with a second RNG, so the problem stream equals :meth:`stream`."""
        answer_rng = random.Random(f"{self.name}-answers-{seed}")
        for question, label in self.stream(seed, split):
            sols = self.solutions(label)
            yield question, sols[0] if len(sols) == 1 else answer_rng.choice(sols)


def _canonical(label: str) -> str:
    """The label up to the order of listed digits (``pairsum:38165:9`` -> ``pairsum:13568:9``):
    held-out problems differ from training ones as digit sets, not as permutations of one."""
    for task, pattern in (("pairsum", _PAIRSUM_LABEL), ("tripsum", _TRIPSUM_LABEL)):
        m = pattern.fullmatch(label)
        if m:
            return f"{task}:{''.join(sorted(m.group(1)))}:{m.group(2)}"
    return label


# ----------------------------------------------------------------------------- addition


def _addition(rng: random.Random) -> Tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"{a}+{b}", str(a + b)


register_task(
    Task(
        name="addition",
        draw=_addition,
        solutions=lambda label: (str(label).strip(),),
        max_answer_chars=3,
        description="2-digit addition a+b (a, b in [10, 99]); one correct answer, the exact sum",
        example="12+34 -> 46",
    )
)

# ----------------------------------------------------------------------------- pairsum

PAIRSUM_DIGITS = 5
_PAIRSUM_LABEL = re.compile(r"pairsum:(\d{5}):(\d{1,2})")
_PAIRSUM_ANSWER = re.compile(r"(\d)\+(\d)")


def _digits_label(label: str, task: str, pattern, n: int) -> Tuple[str, int]:
    """``(digits, target)`` of a ``<task>:<n digits>:<target>`` label."""
    m = pattern.fullmatch(str(label).strip())
    if not m:
        raise ValueError(f"not a {task} label: {label!r} (expected '{task}:<{n} digits>:<target>')")
    return m.group(1), int(m.group(2))


def _pairsum_parse(label: str) -> Tuple[str, int]:
    return _digits_label(label, "pairsum", _PAIRSUM_LABEL, PAIRSUM_DIGITS)


def pairsum_pairs(digits: str, target: int) -> List[Tuple[int, int]]:
    """Ordered pairs ``(a, b)`` of two different listed digits with ``a + b == target``."""
    ds = [int(c) for c in digits]
    return [(a, b) for a in ds for b in ds if a != b and a + b == target]


def _pairsum(rng: random.Random) -> Tuple[str, str]:
    """Five distinct digits in random order and a target in [3, 15] that two disjoint pairs reach
    (rejection sampling; five distinct digits hold at most two such pairs, so exactly four answers)."""
    while True:
        ds = rng.sample(range(10), PAIRSUM_DIGITS)
        target = rng.randint(3, 15)
        digits = "".join(map(str, ds))
        if len(pairsum_pairs(digits, target)) == 4:
            return f"{' '.join(digits)}:{target}", f"pairsum:{digits}:{target}"


def _pairsum_solutions(label: str) -> Tuple[str, ...]:
    digits, target = _pairsum_parse(label)
    return tuple(sorted(f"{a}+{b}" for a, b in pairsum_pairs(digits, target)))


def _pairsum_check(answer: str, label: str) -> bool:
    digits, target = _pairsum_parse(label)
    m = _PAIRSUM_ANSWER.fullmatch(answer)
    if not m:
        return False
    a, b = int(m.group(1)), int(m.group(2))
    return a != b and str(a) in digits and str(b) in digits and a + b == target


register_task(
    Task(
        name="pairsum",
        draw=_pairsum,
        solutions=_pairsum_solutions,
        check=_pairsum_check,
        max_answer_chars=3,
        description="five distinct digits and a target: name two listed digits that add up to it "
                    "(exactly 4 correct answers per prompt; 20% of problems held out)",
        heldout_fraction=0.2,
        example="3 8 1 6 5:9 -> 8+1, 1+8, 3+6 or 6+3",
    )
)

# ----------------------------------------------------------------------------- tripsum

TRIPSUM_DIGITS = 6
TRIPSUM_MAX_TRIPLES = 3
_TRIPSUM_LABEL = re.compile(r"tripsum:(\d{6}):(\d{1,2})")
_TRIPSUM_ANSWER = re.compile(r"(\d)\+(\d)\+(\d)")


def _tripsum_parse(label: str) -> Tuple[str, int]:
    return _digits_label(label, "tripsum", _TRIPSUM_LABEL, TRIPSUM_DIGITS)


def tripsum_triples(digits: str, target: int) -> List[Tuple[int, int, int]]:
    """Unordered triples a < b < c of listed digits with a + b + c == target."""
    ds = sorted(int(c) for c in digits)
    n = len(ds)
    return [(ds[i], ds[j], ds[k]) for i in range(n) for j in range(i + 1, n) for k in range(j + 1, n)
            if ds[i] + ds[j] + ds[k] == target]


def _tripsum(rng: random.Random) -> Tuple[str, str]:
    """Six distinct digits in random order and a target in [3, 24] that one to three triples reach
    (rejection sampling): 6, 12 or 18 correct answers (every order of each triple), of uneven difficulty."""
    while True:
        ds = rng.sample(range(10), TRIPSUM_DIGITS)
        target = rng.randint(3, 24)
        digits = "".join(map(str, ds))
        if 1 <= len(tripsum_triples(digits, target)) <= TRIPSUM_MAX_TRIPLES:
            return f"{' '.join(digits)}:{target}", f"tripsum:{digits}:{target}"


def _tripsum_solutions(label: str) -> Tuple[str, ...]:
    from itertools import permutations

    digits, target = _tripsum_parse(label)
    return tuple(sorted({"+".join(map(str, p)) for t in tripsum_triples(digits, target) for p in permutations(t)}))


def _tripsum_check(answer: str, label: str) -> bool:
    digits, target = _tripsum_parse(label)
    m = _TRIPSUM_ANSWER.fullmatch(answer)
    if not m:
        return False
    a, b, c = (int(x) for x in m.groups())
    return len({a, b, c}) == 3 and all(str(x) in digits for x in (a, b, c)) and a + b + c == target


register_task(
    Task(
        name="tripsum",
        draw=_tripsum,
        solutions=_tripsum_solutions,
        check=_tripsum_check,
        max_answer_chars=5,
        description="six distinct digits and a target: name three listed digits that add up to it "
                    "(one to three triples, 6-18 correct answers; harder than pairsum: Pass@16 below 1 "
                    "after the warm-up; 20% of problems held out)",
        heldout_fraction=0.2,
        example="3 8 1 6 5 0:9 -> 3+6+0, 8+1+0, 3+1+5 and their orders",
    )
)

# ----------------------------------------------------------------------------- reward

# Special tokens the model may emit around its answer; the reward ignores them and surrounding
# whitespace, nothing else (no partial credit, no number extraction from longer text).
_STRIP = re.compile(r"(<\|im_end\|>|<\|endoftext\|>|<\|im_start\|>)")


def extract_answer(response: str) -> str:
    """The response text up to the first end-of-turn token, stripped of whitespace."""
    head = response.split("<|im_end|>", 1)[0]
    return _STRIP.sub("", head).strip()


def task_of_label(label: str) -> Task:
    """The task a label belongs to: ``"<task>:..."`` names it; a bare label is an addition answer."""
    prefix = str(label).split(":", 1)[0]
    if ":" in str(label):
        if prefix not in TASKS:
            raise ValueError(f"label {label!r} names an unknown task {prefix!r}; known: {sorted(TASKS)}")
        return TASKS[prefix]
    return TASKS["addition"]


def score(response: str, label: str) -> float:
    """1.0 if the response (up to end of turn) is a correct answer for ``label``, else 0.0.

    For ``addition`` (bare labels) that is the exact reference string; for other tasks the task's
    checker decides.
    """
    return 1.0 if task_of_label(label).is_correct(extract_answer(response), str(label).strip()) else 0.0


def write_prompt_dataset(path: str, task: Task, n: int, seed: int, split: str = "train") -> str:
    """Write ``n`` problems as jsonl rows ``{"prompt": question, "label": label}`` atomically.

    The pipeline reads it with ``--data.input_key prompt --data.label_key label`` and applies
    the tokenizer's chat template to the prompt. ``split="train"`` never writes held-out problems.
    """
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        for question, label in task.problems(n, seed, split):
            f.write(json.dumps({"prompt": question, "label": label}) + "\n")
    os.replace(tmp, path)
    return path
