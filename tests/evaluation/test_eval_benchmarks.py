"""Loaders: row counts and gold extraction on the staged data, local files, clear errors."""

import csv
import json

import pytest

from evaluation.benchmarks import BENCHMARKS, get_benchmark, last_boxed, load_benchmark

COUNTS = {"aime24": 30, "aime25": 30, "amc23": 40, "math500": 500, "minerva": 272, "olympiadbench": 675,
          "mmlu_pro": 300, "arc_c": 1172}


@pytest.mark.parametrize("name, rows", sorted(COUNTS.items()))
def test_row_counts_and_kinds(name, rows, bench_dir):
    loaded = load_benchmark(name)
    assert len(loaded.problems) == rows
    assert {p.kind for p in loaded.problems} == {BENCHMARKS[name].kind}
    assert len({p.id for p in loaded.problems}) == rows
    assert all(p.question.strip() and p.gold.strip() for p in loaded.problems)


def test_gold_extraction_matches_the_raw_files(bench_dir):
    raw = [json.loads(line) for line in open(bench_dir / "amc23" / "test.jsonl")]
    golds = [p.gold for p in load_benchmark("amc23").problems]
    assert golds == [str(int(r["answer"])) for r in raw]  # floats like 27.0 -> "27"
    assert all(float(r["answer"]).is_integer() for r in raw)

    raw = [json.loads(line) for line in open(bench_dir / "minerva_math" / "test.jsonl")]
    minerva = load_benchmark("minerva").problems
    assert minerva[0].gold == "1.6"  # "... =\boxed{1.6} \mathrm{~cm}"
    for r, p in zip(raw, minerva):  # independent: the text between the last "\boxed{" and its closing brace
        s = r["solution"]
        start = s.rindex("\\boxed{") + len("\\boxed{")
        depth, end = 1, start
        while depth:
            depth += {"{": 1, "}": -1}.get(s[end], 0)
            end += 1
        assert p.gold == s[start : end - 1].strip()

    raw = [json.loads(line) for line in open(bench_dir / "olympiadbench" / "test.jsonl")]
    oly = load_benchmark("olympiadbench").problems
    assert raw[194]["final_answer"] == ["$221,$8$"] and oly[194].gold == "221,8"
    for r, p in zip(raw, oly):
        (answer,) = r["final_answer"]  # every staged row has a one-element list
        if "\\$" not in answer:  # no escaped dollar sign: the gold is the answer without math delimiters
            assert p.gold == answer.replace("$", "").strip()

    arc = load_benchmark("arc_c").problems
    assert sum(p.gold.isdigit() for p in arc) == 22
    assert arc[0].gold == "C" and "C) Planetary days will become shorter." in arc[0].question
    math500 = load_benchmark("math500", limit=3).problems
    assert [p.gold for p in math500][0] == "\\left( 3, \\frac{\\pi}{2} \\right)"


def test_local_files_csv_gpqa_and_errors(tmp_path, bench_dir):
    # GPQA in its original csv layout: options shuffled with a per-question seed, gold follows the answer
    path = tmp_path / "gpqa_diamond.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"])
        w.writeheader()
        for i in range(6):
            w.writerow({"Question": f"Q{i}?", "Correct Answer": f"right{i}", "Incorrect Answer 1": "w1",
                        "Incorrect Answer 2": "w2", "Incorrect Answer 3": "w3"})
    a = load_benchmark("gpqa", str(path)).problems
    b = load_benchmark("gpqa_diamond", str(path)).problems
    assert a == b and len(a) == 6
    for i, p in enumerate(a):
        assert f"{p.gold}) right{i}" in p.question
    assert len({p.gold for p in a}) > 1  # the correct option is not always in the same place

    with pytest.raises(ValueError, match="Idavidrein/gpqa"):
        load_benchmark("gpqa_diamond")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "1+1?", "solution": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"row 0: no gold answer field.*'answer'"):
        load_benchmark("math500", str(bad))
    with pytest.raises(ValueError, match="'solution' has no"):
        load_benchmark("minerva", str(bad))
    with pytest.raises(ValueError, match="not a Hugging Face dataset name"):
        load_benchmark("aime24", str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="could not load Hugging Face dataset"):
        load_benchmark("aime24", "nobody-xyz/not-a-dataset@test")
    with pytest.raises(ValueError, match="unknown benchmark"):
        get_benchmark("aime23")


def test_missing_staged_file_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("LPO_BENCHMARKS_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=r"aime24/test.jsonl not found; set LPO_BENCHMARKS_DIR"):
        load_benchmark("aime24")


def test_last_boxed_balanced():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{x^{2}}") == "x^{2}"
    assert last_boxed("\\boxed{1} then \\boxed{2") == "1"
    assert last_boxed("none") is None
