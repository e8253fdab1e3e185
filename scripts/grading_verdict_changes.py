#!/usr/bin/env python
"""Grading verdicts before/after a grader change, on responses built from the real benchmark golds.

    python scripts/grading_verdict_changes.py --old-rev f29a78b        # the grader before issue 24
    python scripts/grading_verdict_changes.py --old-rev 8149ae6        # the grader before issue 17

The old grader is loaded from git at ``--old-rev``: ``openrlhf_lpo/rewards/grading.py`` when it was one
self-contained file (issue 17 and before), else its modules (``extraction``, ``grade_result``,
``math_grading``, ``choice_grading``) as a package of their own; the new one is the working tree's. Both
grade in this process (math-verify without a pool; each item under a SIGALRM limit, golds are trusted
input). For every benchmark and response shape it prints how many responses each grader calls correct
and how many verdicts (``correct``, ``status``) changed. Response shapes, all from the staged golds ``g``
(``p`` = ``g`` perturbed as in ``tests/evaluation/test_eval_grading_references.py``; ``g1, g2, ...`` the
parts of a multi-part gold):

    boxed \\boxed{g} | fbox \\fbox{g} | perturbed \\boxed{p} | corrected \\boxed{p} no: \\boxed{g} |
    recanted \\boxed{g}, or rather \\boxed{p} | solution (the reference solution, MATH500/Minerva) |
    sci-times / sci-cdot (Minerva e-notation golds as a \\times 10^{b} / a \\cdot 10^{b}) |
    r1-unfinished (an r1-template prompt opened <think>; the response never closes it) |
    list \\boxed{g1}, \\boxed{g2} | list-and \\boxed{g1} \\quad\\text{and}\\quad \\boxed{g2} (multi-part golds) |
    list-corrected \\boxed{g1}, \\boxed{g2} no: \\boxed{p} | statement \\boxed{p} ... The final answer is $g$. |
    backslash \\boxed{g\\} | truncated "... so we get g" unboxed, cut at the token limit (the new grader
    applies its default box-required policy) | unboxed the same, finished (no box required)
    choice: boxed, answer-late ("answer is (X) ... Final Answer: g"), ANSWER:, lowercase, hedge,
    qualifier ("the answer is for sure g"), quoted (Answer: "g"), hedge-conditional ("(X) or (g). If ...,
    the answer is (X); otherwise the answer is (g)."), stray ("I would go with g" graded by the explicit chain and by --choice-extraction
    mmlu-pro: the column "new correct" of the row stray/mmlu-pro)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evaluation.benchmarks import benchmarks_dir, load_benchmark  # noqa: E402
from evaluation.templates import render_prompt  # noqa: E402
from openrlhf_lpo.rewards import grading as new  # noqa: E402
from openrlhf_lpo.rewards.extraction import split_answer  # noqa: E402

MATH = ["aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench"]
CHOICE = ["arc_c", "mmlu_pro"]
NUMBER = re.compile(r"-?\d+(\.\d+)?")
DIGIT = re.compile(r"\d")
SCI = re.compile(r"^(-?\d+(?:\.\d+)?)e(-?\d+)$")


def perturb(gold: str) -> str:
    g = gold.strip()
    if NUMBER.fullmatch(g):
        return str(int(g) + 1) if "." not in g else repr(float(g) + 1.0)
    m = DIGIT.search(g)
    if m:
        return g[: m.start()] + str((int(m.group()) + 3) % 10) + g[m.end():]
    return "(" + g + ")+1"


def load_old(rev: str):
    """The grader at ``rev``: an object with ``grade_math_inprocess``, ``grade_choice`` and ``assistant_text``."""
    def show(path):
        r = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True, text=True)
        return r.stdout if r.returncode == 0 else None

    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    if show("openrlhf_lpo/rewards/math_grading.py") is None:  # one file then
        path = tmp / f"old_grading_{rev}.py"
        path.write_text(show("openrlhf_lpo/rewards/grading.py"))
        spec = importlib.util.spec_from_file_location(f"old_grading_{rev}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up
        spec.loader.exec_module(mod)
        return mod
    pkg = f"old_rewards_{rev}"
    root = tmp / pkg
    root.mkdir(exist_ok=True)
    (root / "__init__.py").write_text("")
    for name in ("extraction", "grade_result", "math_grading", "choice_grading"):
        (root / f"{name}.py").write_text(show(f"openrlhf_lpo/rewards/{name}.py"))
    spec = importlib.util.spec_from_file_location(pkg, root / "__init__.py", submodule_search_locations=[str(root)])
    sys.modules[pkg] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[pkg])
    mods = {n: importlib.import_module(f"{pkg}.{n}") for n in ("extraction", "math_grading", "choice_grading")}
    return types.SimpleNamespace(grade_math_inprocess=mods["math_grading"].grade_math_inprocess,
                                 grade_choice=mods["choice_grading"].grade_choice,
                                 assistant_text=mods["extraction"].assistant_text)


class _Alarm(Exception):
    pass


def _on_alarm(*_):
    raise _Alarm


def guarded(fn, *args, limit=10, **kw):
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(limit)
    try:
        r = fn(*args, **kw)
        return (bool(r.correct), r.status)
    except _Alarm:
        return (False, "timeout")
    finally:
        signal.alarm(0)


def math_sets(bench: str) -> dict[str, list[tuple[str, str, str | None]]]:
    """shape -> [(response, gold, prompt)]"""
    problems = load_benchmark(bench).problems
    golds = [p.gold for p in problems]
    sets = {
        "boxed": [("\\boxed{%s}" % g, g, None) for g in golds],
        "fbox": [("\\fbox{%s}" % g, g, None) for g in golds],
        "perturbed": [("The answer is \\boxed{%s}." % perturb(g), g, None) for g in golds],
        "corrected": [("\\boxed{%s} no: \\boxed{%s}" % (perturb(g), g), g, None) for g in golds],
        "recanted": [("\\boxed{%s}, or rather \\boxed{%s}" % (g, perturb(g)), g, None) for g in golds],
    }
    r1 = [render_prompt("r1", p.question, "math") for p in problems]
    sets["r1-unfinished"] = [("Let me compute ... so \\boxed{%s}" % g, g, pr) for g, pr in zip(golds, r1)]
    raw_name = {"math500": "math500/test.jsonl", "minerva": "minerva_math/test.jsonl"}.get(bench)
    if raw_name:
        rows = [json.loads(line) for line in open(benchmarks_dir() / raw_name) if line.strip()]
        sets["solution"] = [(r["solution"], g, None) for r, g in zip(rows, golds)]
    multi = [(split_answer(g), g) for g in golds if len(split_answer(g)) > 1]
    if multi:
        sets["list"] = [(", ".join("\\boxed{%s}" % x for x in parts), g, None) for parts, g in multi]
        sets["list-and"] = [(" \\quad\\text{and}\\quad ".join("\\boxed{%s}" % x for x in parts), g, None)
                            for parts, g in multi]
        sets["list-corrected"] = [(", ".join("\\boxed{%s}" % x for x in parts) + " no: \\boxed{%s}" % perturb(g), g, None)
                                  for parts, g in multi]
    sets["statement"] = [("\\boxed{%s} ... Final Answer: The final answer is $%s$. I hope it is correct." % (perturb(g), g),
                          g, None) for g in golds]
    sets["backslash"] = [("So the answer is \\boxed{%s\\}" % g, g, None) for g in golds]
    sets["truncated"] = [("Let me work it out step by step ... so we get $%s$" % g, g, "length") for g in golds]
    sets["unboxed"] = [("Let me work it out step by step ... so we get $%s$" % g, g, "stop") for g in golds]
    sci = [(g, *SCI.match(g).groups()) for g in golds if SCI.match(g)]
    if sci:
        sets["sci-times"] = [("\\boxed{%s \\times 10^{%s}}" % (m, e), g, None) for g, m, e in sci]
        sets["sci-cdot"] = [("\\boxed{%s \\cdot 10^{%s} \\mathrm{~m}}" % (m, e), g, None) for g, m, e in sci]
    return sets


def choice_sets(bench: str) -> dict[str, list[tuple[str, str, str | None]]]:
    problems = load_benchmark(bench).problems
    shapes = ("boxed", "answer-late", "ANSWER:", "lowercase", "hedge", "qualifier", "quoted", "hedge-conditional",
              "stray", "stray/mmlu-pro")
    out = {k: [] for k in shapes}
    for p in problems:
        other = next(x for x in ("1234" if p.gold.isdigit() else "ABCD") if x != p.gold)
        out["boxed"].append(("\\boxed{%s}" % p.gold, p.gold, p.choices))
        out["answer-late"].append(("The answer is (%s). Checking again... Final Answer: %s" % (other, p.gold), p.gold, p.choices))
        out["ANSWER:"].append(("ANSWER: %s" % p.gold, p.gold, p.choices))
        out["lowercase"].append(("answer: %s" % p.gold.lower(), p.gold, p.choices))
        out["hedge"].append(("\\boxed{(%s) and (%s)}" % (p.gold, other), p.gold, p.choices))
        out["qualifier"].append(("So the answer is for sure %s." % p.gold, p.gold, p.choices))
        out["quoted"].append(('Answer: "%s"' % p.gold, p.gold, p.choices))
        out["hedge-conditional"].append((
            "The answer is (%s) or (%s). If the first reading holds, the answer is (%s); otherwise the answer is (%s)."
            % (other, p.gold, other, p.gold), p.gold, p.choices))
        out["stray"].append(("I would go with %s here." % p.gold, p.gold, p.choices))
        out["stray/mmlu-pro"].append(("I would go with %s here." % p.gold, p.gold, p.choices))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old-rev", required=True, help="git revision holding the old grading.py")
    ap.add_argument("--benchmarks", default=",".join(MATH + CHOICE))
    ap.add_argument("--no-fast-path", action="store_true", help="grade math with fast_path=False on both sides")
    ap.add_argument("--item-limit", type=int, default=10, help="seconds per item (SIGALRM) before 'timeout'")
    args = ap.parse_args()
    old = load_old(args.old_rev)
    fast = not args.no_fast_path
    print(f"old = the grader at {args.old_rev}, new = working tree; fast_path={fast}\n")
    print("| benchmark | response shape | n | old correct | new correct | verdicts changed | wrong->right | right->wrong |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    t0 = time.time()
    for bench in args.benchmarks.split(","):
        kind = "choice" if bench in CHOICE else "math"
        sets = choice_sets(bench) if kind == "choice" else math_sets(bench)
        for shape, items in sets.items():
            o_res, n_res = [], []
            for resp, gold, extra in items:
                if kind == "choice":
                    chain = {"extraction": "mmlu-pro"} if shape.endswith("/mmlu-pro") else {}
                    o_res.append(guarded(old.grade_choice, resp, gold, extra))
                    n_res.append(guarded(new.grade_choice, resp, gold, extra, **chain))
                elif extra in ("length", "stop"):  # a finish reason: the default box-required policy
                    o_res.append(guarded(old.grade_math_inprocess, resp, gold, fast_path=fast, limit=args.item_limit))
                    n_res.append(guarded(new.grade_math_inprocess, resp, gold, fast_path=fast, limit=args.item_limit,
                                         require_box=extra == "length"))
                else:  # a grader without assistant_text (before issue 17) had no notion of the prompt
                    old_text = old.assistant_text(resp, extra) if hasattr(old, "assistant_text") else resp
                    o_res.append(guarded(old.grade_math_inprocess, old_text, gold, fast_path=fast, limit=args.item_limit))
                    n_res.append(guarded(new.grade_math_inprocess, new.assistant_text(resp, extra), gold,
                                         fast_path=fast, limit=args.item_limit))
            changed = sum(a != b for a, b in zip(o_res, n_res))
            up = sum((not a[0]) and b[0] for a, b in zip(o_res, n_res))
            down = sum(a[0] and not b[0] for a, b in zip(o_res, n_res))
            print(f"| {bench} | {shape} | {len(items)} | {sum(a[0] for a in o_res)} | {sum(b[0] for b in n_res)} "
                  f"| {changed} | {up} | {down} |", flush=True)
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
