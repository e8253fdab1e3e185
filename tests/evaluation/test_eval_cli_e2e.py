"""`lpo-eval run` end to end on a tiny random model with the CPU (transformers) engine, plus CLI errors."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evaluation.cli import main


def _lpo_eval() -> list[str]:
    exe = Path(sys.executable).parent / "lpo-eval"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "evaluation"]


@pytest.mark.e2e
def test_lpo_eval_run_writes_samples_metrics_table_and_plots(tmp_path, tiny_ckpt, bench_dir):
    out = tmp_path / "runs"
    cmd = _lpo_eval() + [
        "run", "--ckpts", str(Path(tiny_ckpt).parent / "global_step_*"), "--benchmarks", "math500,arc_c",
        "--engine", "hf", "--limit", "2", "--n", "2", "--k", "2", "--max-tokens", "6", "--workers", "1",
        "--out", str(out),
    ]
    env = dict(os.environ, LPO_BENCHMARKS_DIR=str(bench_dir), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p for p in out.glob("*/*") if p.is_dir())
    assert [p.name.split("-")[0] for p in jobs] == ["arc_c", "math500"]
    for job in jobs:
        assert {f.name for f in job.iterdir()} == {"config.json", "problems.jsonl", "generations.jsonl", "samples.jsonl",
                                                   "metrics.json", ".lock"}
        umask = os.umask(0o022)
        os.umask(umask)
        for f in job.iterdir():  # readable by the team: the mode of a plainly created file, not mkstemp's 0600
            assert f.stat().st_mode & 0o777 == 0o666 & ~umask, (f, oct(f.stat().st_mode))
        rows = [json.loads(line) for line in open(job / "samples.jsonl")]
        assert len(rows) == 2 * 2
        assert list(rows[0]) == ["checkpoint", "benchmark", "problem_id", "sample_idx", "prompt_sha", "response",
                                 "finish_reason", "n_tokens", "gold", "extracted", "correct", "grader_status"]
        assert all(r["grader_status"] in ("ok", "timeout", "no_answer", "error") for r in rows)
        assert all(1 <= r["n_tokens"] <= 6 for r in rows)
        m = json.loads((job / "metrics.json").read_text())
        acc = sum(r["correct"] for r in rows) / len(rows)
        assert m["pass@1"] == pytest.approx(acc) and set(m["pass@k"]) == {"1", "2"}
        assert m["truncated_rate"] == pytest.approx(sum(r["finish_reason"] == "length" for r in rows) / len(rows))
        assert m["config_sha"] == json.loads((job / "config.json").read_text())["config_sha"]
        # length statistics against an independent computation from the samples
        lengths = sorted(r["n_tokens"] for r in rows)
        assert m["length"]["mean"] == pytest.approx(sum(lengths) / len(lengths))
        assert m["length"]["p50"] == pytest.approx((lengths[1] + lengths[2]) / 2)  # 4 samples: halfway between the middle two
        assert m["length"]["max"] == lengths[-1]
        assert set(m["maj@k"]) == {"1", "2"} and set(m["worst@k"]) == {"1", "2"}
        assert m["maj@k"]["1"] == pytest.approx(m["pass@1"])  # a vote of one sample is that sample
        cfg = json.loads((job / "config.json").read_text())
        assert cfg["sampling"]["stop"] == ["<|im_end|>", "<|endoftext|>"] and cfg["trust_remote_code"] is False
        problems = [json.loads(line) for line in open(job / "problems.jsonl")]
        assert [p["problem_id"] for p in problems] == ["0", "1"] and problems[0]["prompt"].startswith("<|im_start|>system")
    for name in ("summary.md", "summary.csv", "summary.json", "passk.png", "steps.png", "lengths.png"):
        assert (out / name).exists(), name
    for png in ("passk.png", "steps.png", "lengths.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = list(csv.DictReader(open(out / "summary.csv")))
    assert len(table) == 1 and table[0]["step"] == "5"
    md = (out / "summary.md").read_text()
    assert "| checkpoint | step | math500 | arc_c | math avg | ood avg |" in md
    assert "Pass@1" in md and "| run_x__global_step_5-" in md
    assert "### maj@n" in md and "### Best / worst of n" in md and "### Response length (tokens)" in md
    assert "| checkpoint | step | math500 |" in proc.stdout  # the table is printed too

    # a second run finds every job finished: nothing is regenerated or rewritten
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*.jsonl")}
    proc = subprocess.run(cmd + ["--no-plots"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.jsonl")} == before

    # The random tiny model never answers (every verdict above is "wrong"): plant answers whose verdicts
    # are known independently of the grader (golds read from the benchmark files), then rescore.
    _plant_answers_and_rescore(out, bench_dir)


def _plant_answers_and_rescore(out, bench_dir):
    import pandas as pd

    math_golds = [json.loads(line)["answer"] for line in open(bench_dir / "math500" / "test.jsonl")][:2]
    arc = pd.read_parquet(bench_dir / "arc_challenge" / "valid.arc_c.parquet")
    arc_golds = [arc.iloc[i]["reward_model"]["ground_truth"] for i in range(2)]
    assert math_golds == ["\\left( 3, \\frac{\\pi}{2} \\right)", "p - q"]
    wrong_letter = {g: "ABCD"[("ABCD".index(g) + 1) % 4] for g in arc_golds}
    planted = {  # (problem, sample) -> (response, correct)
        "math500": {("0", 0): ("so \\boxed{(3, \\frac{\\pi}{2})}", True),  # equal to the gold, written otherwise
                    ("0", 1): ("\\boxed{(3, \\pi)}", False),
                    ("1", 0): ("\\boxed{p - q}", True),  # the gold verbatim (the fast path)
                    ("1", 1): ("I cannot tell.", False)},
        "arc_c": {("0", 0): (f"The answer is \\boxed{{{arc_golds[0]}}}", True),
                  ("0", 1): (f"\\boxed{{{wrong_letter[arc_golds[0]]}}}", False),
                  ("1", 0): (f"\\boxed{{{wrong_letter[arc_golds[1]]}}}", False),
                  ("1", 1): (f"Answer: \\boxed{{{arc_golds[1]}}}", True)},
    }
    jobs = {p.name.split("-")[0]: p for p in out.glob("*/*") if p.is_dir()}
    for bench, answers in planted.items():
        gen = jobs[bench] / "generations.jsonl"
        rows = [json.loads(line) for line in open(gen)]
        assert len(rows) == len(answers) == 4
        for r in rows:
            r["response"] = answers[(r["problem_id"], r["sample_idx"])][0]
        gen.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # a changed generations file is rescored by a plain `score`
    assert main(["--no-progress", "score", "--runs", str(out), "--workers", "1"]) == 0
    stamp = {}
    for bench, answers in planted.items():
        job = jobs[bench]
        rows = [json.loads(line) for line in open(job / "samples.jsonl")]
        assert [r["correct"] for r in rows] == [answers[(r["problem_id"], r["sample_idx"])][1] for r in rows], bench
        m = json.loads((job / "metrics.json").read_text())
        # independent count: 2 of 4 planted answers are right, one per problem
        assert m["pass@1"] == pytest.approx(0.5) and m["pass@k"]["1"] == pytest.approx(0.5)
        assert m["pass@k"]["2"] == pytest.approx(1.0)
        assert m["grader"]["fast_path"] is True
        stamp[bench] = ((job / "metrics.json").stat().st_mtime_ns, (job / "samples.jsonl").stat().st_mtime_ns, m)
    # up to date: `score` skips (nothing rewritten)
    assert main(["--no-progress", "score", "--runs", str(out), "--workers", "1"]) == 0
    for bench, (m_ns, s_ns, _) in stamp.items():
        job = jobs[bench]
        assert ((job / "metrics.json").stat().st_mtime_ns, (job / "samples.jsonl").stat().st_mtime_ns) == (m_ns, s_ns)
    # --force rescores (rewritten, same numbers); --no-fast-path is another grader setting: rescored, same verdicts
    assert main(["--no-progress", "score", "--runs", str(out), "--workers", "1", "--force"]) == 0
    for bench, (m_ns, s_ns, m) in stamp.items():
        job = jobs[bench]
        assert (job / "metrics.json").stat().st_mtime_ns != m_ns and (job / "samples.jsonl").stat().st_mtime_ns != s_ns
        assert json.loads((job / "metrics.json").read_text())["pass@k"] == m["pass@k"]
    assert main(["--no-progress", "score", "--runs", str(out), "--workers", "1", "--no-fast-path"]) == 0
    for bench, answers in planted.items():
        m = json.loads((jobs[bench] / "metrics.json").read_text())
        rows = [json.loads(line) for line in open(jobs[bench] / "samples.jsonl")]
        assert m["grader"]["fast_path"] is False and m["pass@1"] == pytest.approx(0.5)
        assert [r["correct"] for r in rows] == [answers[(r["problem_id"], r["sample_idx"])][1] for r in rows], bench


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--ckpts", "X", "--out", "o", "--benchmarks", "aime24", "--n", "aime24=4"], "--n aime24=4 is smaller than k=32"),
        (["generate", "--ckpts", "X", "--out", "o", "--benchmarks", "gpqa_diamond"], "Idavidrein/gpqa"),
        (["generate", "--ckpts", "X", "--out", "o", "--benchmarks", "aime2024"], "unknown benchmark 'aime2024'"),
        (["generate", "--ckpts", "/nonexistent/ckpt", "--out", "o", "--benchmarks", "aime24"], "is not a model directory"),
        (["generate", "--ckpts", "X", "--out", "o", "--n", "aime24=zero"], "value must be an integer"),
        (["generate", "--ckpts", "X", "--out", "o", "--data", "math500"], "expected NAME=PATH_OR_HF_DATASET"),
        (["score", "--runs", "/nonexistent/runs"], "is not a directory"),
        (["report", "--runs", "/nonexistent/runs"], "is not a directory"),
    ],
)
def test_cli_errors_name_the_flag(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
