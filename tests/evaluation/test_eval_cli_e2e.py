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
