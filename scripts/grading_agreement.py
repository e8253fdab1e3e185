"""How often the grader agrees with an expected verdict: the peers' cases, our held-out cases, math-verify's own cases.

    python scripts/grading_agreement.py [--verbose]

For each data file in tests/evaluation/data/ it prints the disagreements of our grader (``grade_math_inprocess``,
``grade_choice``) and of math-verify alone (``verify(parse("$gold$"), parse(response))`` with its default extraction),
on the cases that count (``disputed`` unset). Math only for math-verify alone (it has no multiple-choice grader
with its defaults). Runs in this process with math-verify's own timeouts off: the data is trusted (~1 min).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATA = ROOT / "tests" / "evaluation" / "data"

from openrlhf_lpo.rewards.choice_grading import grade_choice  # noqa: E402
from openrlhf_lpo.rewards.math_grading import grade_math_inprocess  # noqa: E402


def math_verify_alone(gold: str, response: str) -> bool:
    """math-verify as its README uses it: the gold in math mode (``$gold$`` unless it has ``$`` or a box already)."""
    from math_verify import parse, verify

    if "$" not in gold and "\\boxed" not in gold:
        gold = f"${gold}$"
    try:
        return bool(verify(parse(gold, parsing_timeout=None), parse(response, parsing_timeout=None), timeout_seconds=None))
    except Exception:
        return False


def ours(case: dict) -> bool:
    if case.get("kind", "math") == "choice":
        return grade_choice(case["response"], case["gold"]).correct
    return grade_math_inprocess(case["response"], case["gold"]).correct


def load(name: str) -> list[dict]:
    """The cases of one data file in one shape: gold, response, expected, kind, disputed, label."""
    data = json.loads((DATA / name).read_text())
    out = []
    for i, c in enumerate(data["cases"]):
        response = c.get("response", c.get("pred"))
        out.append({"gold": c["gold"], "response": response, "expected": c["expected"], "kind": c.get("kind", "math"),
                    "disputed": c.get("disputed"), "label": f"{i} {c.get('source', c.get('file', ''))} {c.get('test', c.get('kind_of_case', ''))}"})
    return out


def report(name: str, verbose: bool) -> dict:
    cases = [c for c in load(name) if not c["disputed"]]
    mine = [i for i, c in enumerate(cases) if ours(c) != c["expected"]]
    math_cases = [i for i, c in enumerate(cases) if c["kind"] == "math"]
    alone = [i for i in math_cases if math_verify_alone(cases[i]["gold"], cases[i]["response"]) != cases[i]["expected"]]
    print(f"{name}: {len(cases)} cases counted ({len(math_cases)} math); ours disagrees on {len(mine)}, "
          f"math-verify alone on {len(alone)} of the {len(math_cases)} math cases")
    if verbose:
        for tag, idx in (("ours", mine), ("math-verify alone", alone)):
            for i in idx:
                c = cases[i]
                print(f"  [{tag}] {c['label']}: gold={c['gold']!r} response={c['response'][-90:]!r} expected={c['expected']}")
    return {"counted": len(cases), "ours": len(mine), "math_verify_alone": len(alone), "math": len(math_cases)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verbose", action="store_true", help="list every disagreement")
    ap.add_argument("files", nargs="*", default=["peer_grading_cases.json", "grading_heldout_cases.json",
                                                 "math_verify_cases.json"])
    args = ap.parse_args(argv)
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    for name in args.files:
        if (DATA / name).exists():
            report(name, args.verbose)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
