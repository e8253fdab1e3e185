"""lpo-eval's preflight: a checkpoint pattern that matches nothing, a --data file without the fields a
benchmark needs, a benchmark that does not exist: exit 2 with the pattern / file, row and field / the list
of benchmarks, before any engine starts (nothing is written under --out)."""

import json

import pytest

from evaluation.benchmarks import BENCHMARKS
from evaluation.cli import main



def _refused(argv, capsys, *needles):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("command", ["generate", "run"])
def test_bad_inputs_stop_before_any_engine(command, tmp_path, tiny_ckpt, capsys):
    out = tmp_path / "out"
    base = ["--no-progress", command, "--out", str(out), "--engine", "hf", "--limit", "2"]
    pattern = str(tmp_path / "runs" / "*" / "global_step*_hf")
    _refused(base + ["--ckpts", pattern, "--benchmarks", "math500"], capsys, f"--ckpts pattern {pattern!r} matched nothing")
    no_answer = tmp_path / "mine.jsonl"
    no_answer.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n" + json.dumps({"problem": "2+2?"}) + "\n")
    _refused(base + ["--ckpts", tiny_ckpt, "--benchmarks", "math500", "--data", f"math500={no_answer}"], capsys,
             f"benchmark 'math500' ({no_answer}) row 1: no gold answer field", "row has ['problem']")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"problem": "a", "answer": "1"}\n{"problem": \n')
    _refused(base + ["--ckpts", tiny_ckpt, "--benchmarks", "mine", "--data", f"mine={broken}"], capsys,
             f"{broken}:2: invalid JSON line")
    _refused(base + ["--ckpts", tiny_ckpt, "--benchmarks", "math500,aime2042"], capsys,
             "unknown benchmark 'aime2042'; choose from " + ", ".join(list(BENCHMARKS)[:6]))
    assert not out.exists()  # no engine ran, no job folder was planned
