"""Accuracy against token budget: Pass@1 as if generation had stopped at B tokens, from one run.

For each budget B below a job's ``--max-tokens`` (``lpo-eval score --budgets``, default 1k,2k,4k,8k =
1024..8192 tokens), a sample of at most B tokens (the engine's count) keeps its verdict; a longer one
is cut after its first B tokens (the response re-encoded with the checkpoint's tokenizer, cut at the
character where token B ends) and the prefix is graded as a response that ran out of tokens:

* math: only a closed ``\\boxed{}`` in the graded text counts (after the last ``</think>``; an unclosed
  ``<think>`` has no answer). A prefix without one has no answer, whatever its last expression: the box
  must lie within the budget. The grader gets ``require_box="all"`` as well (box-only extraction);
* multiple choice: explicit answers only, as always (a box, "answer is X", "Answer: X");
* other kinds (code) are not cut: a program's prefix is not a program (:data:`BUDGET_KINDS`).

The re-encoded token count of a response can differ from the engine's by the stop token and special
tokens that decoding dropped; the cut uses the engine's count to decide *whether* a sample is cut and
the re-encoding to decide *where*.
"""

from __future__ import annotations

from functools import lru_cache

from openrlhf_lpo.rewards.extraction import final_answer_text, last_boxed
from openrlhf_lpo.rewards.grading import GradeResult, assistant_text

from .grading import GRADERS

DEFAULT_BUDGETS = (1024, 2048, 4096, 8192)
BUDGET_KINDS = frozenset({"math", "choice"})


def parse_budgets(spec: str) -> tuple[int, ...]:
    """``"1k,2k,4k,8k"`` (k = 1024) or plain token counts; ``"none"``: no budget curve."""
    if spec.strip().lower() in ("none", "off", ""):
        return ()
    out = []
    for part in [p.strip().lower() for p in spec.split(",") if p.strip()]:
        try:
            v = int(part[:-1]) * 1024 if part.endswith("k") else int(part)
        except ValueError:
            raise ValueError(f"--budgets {part!r}: expected token counts such as 1024 or 1k (= 1024), or none") from None
        if v < 1:
            raise ValueError(f"--budgets {part!r}: a budget must be >= 1 token")
        out.append(v)
    return tuple(sorted(set(out)))


def job_budgets(cfg: dict, budgets: tuple[int, ...]) -> list[int]:
    """The budgets that cut something in this job: below its ``max_tokens``, for kinds that can be cut."""
    max_tokens = (cfg.get("sampling") or {}).get("max_tokens")
    if cfg.get("kind") not in BUDGET_KINDS or max_tokens is None:
        return []
    return sorted(b for b in set(budgets) if b < max_tokens)


@lru_cache(maxsize=8)
def checkpoint_tokenizer(path: str, trust_remote_code: bool = False):
    import logging

    from transformers import AutoTokenizer

    logging.getLogger("transformers").setLevel(logging.ERROR)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def cut_points(tokenizer, text: str, budgets: list[int]) -> dict[int, str | None]:
    """``text`` cut after its first b tokens for each budget b (None where it has at most b tokens)."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    return {b: (text[: offsets[b - 1][1]] if len(offsets) > b else None) for b in budgets}


def _has_box(text: str) -> bool:
    final = final_answer_text(text)
    return final is not None and last_boxed(final) is not None


def grade_at_budgets(rows: list[dict], full: list[GradeResult], cfg: dict, prompts: dict, pool, opts: dict,
                     budgets: list[int], tokenizer) -> dict[int, list[bool]]:
    """Per budget, each sample's verdict when generation stops after that many tokens (module doc)."""
    out = {b: [g.correct for g in full] for b in budgets}
    long_rows = [i for i, r in enumerate(rows) if r["n_tokens"] > budgets[0]]
    cuts = {i: cut_points(tokenizer, rows[i]["response"], [b for b in budgets if rows[i]["n_tokens"] > b])
            for i in long_rows}
    grade = GRADERS[cfg["kind"]]
    for b in budgets:
        todo, texts = [], []
        for i in long_rows:
            prefix = cuts[i].get(b)
            if prefix is None:
                continue  # within the budget once re-encoded: the full verdict stands
            text = assistant_text(prefix, prompts.get(rows[i]["problem_id"], prompts.get("*")))
            if cfg["kind"] == "math" and not _has_box(text):
                out[b][i] = False  # no box within the budget: no answer
                continue
            todo.append(i)
            texts.append(text)
        if todo:
            results = grade([rows[i] for i in todo], texts, pool, {**opts, "require_box": "all"}, None)
            for i, g in zip(todo, results):
                out[b][i] = g.correct
    return out
