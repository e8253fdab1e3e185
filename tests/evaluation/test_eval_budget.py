"""Accuracy against token budget on planted responses: the tiny tokenizer has one token per character, so
where each box closes (in tokens) is known by construction, and each verdict at a budget follows from it."""

import json

import pytest

from evaluation.budget import parse_budgets
from evaluation.cli import main
from evaluation.generate import GenOptions
from evaluation.launch import generate
from evaluation.report import report
from evaluation.score import score

BOX = "\\boxed{42}"  # 10 tokens
# each planted response: (text, [(token where a box closes, its content), ...])
PLANTED = [
    (BOX + " x" * 20, [(10, "42")]),  # answered early: right from 10 tokens on
    (" y" * 15 + " " + BOX, [(41, "42")]),  # answered at token 41: right only in full
    (BOX, [(10, "42")]),  # short
    ("\\boxed{41}" + " x" * 20, [(10, "41")]),  # wrong at every budget
    ("\\boxed{41}" + " q" * 5 + " no: " + BOX, [(10, "41"), (35, "42")]),  # corrected after token 16
    ("42" + " w" * 20, []),  # no box: a cut prefix has no answer even though it starts with the gold
]
BUDGETS = (8, 16, 32, 128)  # 128 >= --max-tokens 64: cuts nothing, left out


def _expected(budget: int, gold: str = "42") -> list[bool | None]:
    """Verdict of each planted response cut after ``budget`` tokens: the last box closed within it
    (None: decided by the full grader, the response is not cut)."""
    out = []
    for text, boxes in PLANTED:
        if len(text) <= budget:
            out.append(None)
            continue
        inside = [content for end, content in boxes if end <= budget]
        out.append(bool(inside) and inside[-1] == gold)
    return out


def test_parse_budgets():
    assert parse_budgets("1k,2k,4k,8k") == (1024, 2048, 4096, 8192)
    assert parse_budgets("3000, 1k") == (1024, 3000) and parse_budgets("none") == ()
    for bad in ("0", "x", "1.5k"):
        with pytest.raises(ValueError, match="--budgets"):
            parse_budgets(bad)


def test_pass1_at_token_budgets_regrades_the_cut_prefixes(tmp_path, tiny_ckpt, planted):
    data = planted.make(tmp_path, {"42": [t for t, _ in PLANTED]})
    out = tmp_path / "runs"
    generate([tiny_ckpt], GenOptions(benchmarks=["planted"], data={"planted": str(data)}, out=str(out),
                                     engine="planted-test", n={"*": len(PLANTED)}, k={"*": 1}, progress=False,
                                     max_tokens=64, template="none"))
    (m,) = score(out, workers=1, timeout=20, show_progress=False, budgets=BUDGETS)
    rows = [json.loads(x) for x in next(out.glob("*/planted-*/samples.jsonl")).read_text().splitlines()]
    assert [r["n_tokens"] for r in rows] == [len(t) for t, _ in PLANTED]  # one token per character
    full = [r["correct"] for r in rows]
    assert full[:5] == [True, True, True, False, True]
    assert set(m["budget"]) == {"8", "16", "32"}
    for b in (8, 16, 32):
        want = [f if e is None else e for e, f in zip(_expected(b), full)]
        got = m["budget"][str(b)]
        assert got["pass@1"] == pytest.approx(sum(want) / len(want)), (b, want)
        assert got["cut_rate"] == pytest.approx(sum(len(t) > b for t, _ in PLANTED) / len(PLANTED))
    assert [m["budget"][b]["pass@1"] * 6 for b in ("8", "16", "32")] == pytest.approx([0, 2, 2])
    assert m["pass@1"] == pytest.approx(sum(full) / 6)
    # the table and the plot
    table = report(out)
    md = (out / "summary.md").read_text()
    assert "### Pass@1 (%) at token budget" in md
    line = next(x for x in md.splitlines() if "| planted |" in x and "B=" not in x and x.count("|") == 9)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[3:] == ["0.0", "33.3", "33.3", f"{100 * sum(full) / 6:.1f}", "64"]
    assert (out / "budget.png").read_bytes()[:4] == b"\x89PNG"
    assert table["rows"][0]["cells"]["planted"]["budget"][16]["pass@1"] == pytest.approx(2 / 6)
    # changing the budgets rescores; `--budgets none` leaves them out
    assert main(["--no-progress", "score", "--runs", str(out), "--workers", "1", "--budgets", "none"]) == 0
    assert "budget" not in json.loads(next(out.glob("*/planted-*/metrics.json")).read_text())
    with pytest.raises(SystemExit) as e:  # argparse: exit 2 naming the flag
        main(["score", "--runs", str(out), "--budgets", "1x"])
    assert e.value.code == 2
