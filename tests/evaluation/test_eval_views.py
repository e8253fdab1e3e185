"""maj@k clusters through the real grader, the per-problem view, compare (table + HTML), and eval
metrics logged to TensorBoard / W&B against training step."""

import json
import random
from pathlib import Path

import pytest

from evaluation.cli import main
from evaluation.engines import ENGINES, Completion, register_engine
from evaluation.majority import CORRECT, vote_labels

if "sums-test" not in ENGINES:

    @register_engine("sums-test")
    class SumsEngine:
        """Answers 'a+b' questions; the step-20 checkpoint is right more often than step 10 (seeded per sample).

        About a third of the samples carry hostile markup, so the HTML pages must escape it; a quarter hit
        the token limit.
        """

        def __init__(self, model_path, **kw):
            self.tokenizer = None
            self.skill = {"global_step10_hf": 0.25, "global_step20_hf": 0.85}.get(Path(model_path).name, 0.5)

        def generate(self, prompts, n, sampling, seeds):
            out = []
            for prompt, seed in zip(prompts, seeds):
                a, b = (int(x) for x in prompt.split("?")[0].split()[-1].split("+"))
                rng = random.Random(seed)
                comps = []
                for j in range(n):
                    ans = a + b if rng.random() < self.skill else a + b + rng.choice([1, 10])
                    hostile = rng.random() < 0.35
                    text = f"<script>alert(1)</script> so \\boxed{{{ans}}}" if hostile else f"The sum is \\boxed{{{ans}}}."
                    comps.append(Completion(text, "length" if rng.random() < 0.25 else "stop", 5 + 3 * (seed % 4) + ans % 7))
                out.append(comps)
            return out

        def close(self):
            pass


def test_vote_labels_use_the_graders_equivalence(pool):
    rows = [
        {"correct": True, "grader_status": "ok", "extracted": "2"},
        {"correct": False, "grader_status": "ok", "extracted": "\\frac{1}{2}"},
        {"correct": False, "grader_status": "ok", "extracted": "0.5"},
        {"correct": False, "grader_status": "ok", "extracted": "\\left( 1, 2 \\right)"},
        {"correct": False, "grader_status": "ok", "extracted": "(1,2)"},
        {"correct": False, "grader_status": "ok", "extracted": "7"},
        {"correct": False, "grader_status": "no_answer", "extracted": None},
    ]
    (lab,) = vote_labels([rows], "math", pool)
    assert lab[0] == CORRECT and lab[6] is None
    assert lab[1] == lab[2] != CORRECT  # 1/2 and 0.5: one answer (math-verify), not the text
    assert lab[3] == lab[4] not in (lab[1], CORRECT)  # same text up to \left/\right and spaces
    assert lab[5] not in (lab[1], lab[3], CORRECT)
    (ch,) = vote_labels([[{"correct": False, "grader_status": "ok", "extracted": "C,D"},
                          {"correct": False, "grader_status": "ok", "extracted": "C"},
                          {"correct": False, "grader_status": "ok", "extracted": "C"}]], "choice", None)
    assert ch[1] == ch[2] != ch[0]


@pytest.fixture(scope="module")
def sums_runs(tmp_path_factory, tiny_ckpt):
    """Two checkpoints of one run (OpenRLHF layout) evaluated on a custom a+b benchmark."""
    import shutil

    root = tmp_path_factory.mktemp("views")
    for step in (10, 20):
        shutil.copytree(tiny_ckpt, root / "sums_run" / "ckpt" / f"global_step{step}_hf")
    data = root / "sums.jsonl"
    rng = random.Random(0)
    data.write_text("".join(json.dumps({"problem": f"What is {a}+{b}?", "answer": str(a + b)}) + "\n"
                            for a, b in ((rng.randint(10, 99), rng.randint(10, 99)) for _ in range(12))))
    out = root / "runs"
    code = main(["--no-progress", "run", "--ckpts", str(root / "sums_run"), "--benchmarks", "sums", "--data",
                 f"sums={data}", "--engine", "sums-test", "--n", "4", "--k", "2", "--template", "none", "--out", str(out),
                 "--workers", "1", "--tensorboard", str(root / "tb")])
    assert code == 0
    return root, out


def test_custom_benchmark_metrics_and_report(sums_runs):
    root, out = sums_runs
    ms = {json.loads(p.read_text())["step"]: json.loads(p.read_text()) for p in out.glob("*/sums-*/metrics.json")}
    assert set(ms) == {10, 20} and ms[20]["pass@1"] > ms[10]["pass@1"]
    for m in ms.values():
        samples = [json.loads(line) for line in open(next(out.glob(f"{m['checkpoint']}/sums-*/samples.jsonl")))]
        by_pid = {}
        for s in samples:
            by_pid.setdefault(s["problem_id"], []).append(s)
        # maj@4 by hand: the most common extracted answer of each problem (ties share the credit)
        ref = 0.0
        for rs in by_pid.values():
            counts = {}
            for s in rs:
                counts[s["extracted"]] = counts.get(s["extracted"], 0) + 1
            top = max(counts.values())
            leaders = [a for a, c in counts.items() if c == top]
            ref += (1 / len(leaders)) if rs[0]["gold"] in leaders else 0.0
        assert m["maj@k"]["4"] == pytest.approx(ref / len(by_pid))
        assert m["best_of_n"] == pytest.approx(sum(any(s["correct"] for s in rs) for rs in by_pid.values()) / len(by_pid))
        assert m["worst_of_n"] == pytest.approx(sum(all(s["correct"] for s in rs) for rs in by_pid.values()) / len(by_pid))
        cut = sum(s["finish_reason"] == "length" for s in samples)
        assert 0 < cut < len(samples) and m["length"]["truncated_rate"] == pytest.approx(cut / len(samples))
        right = [s["n_tokens"] for s in samples if s["correct"]]
        assert m["length"]["mean_correct"] == pytest.approx(sum(right) / len(right))
    md = (out / "summary.md").read_text()
    assert "| sums_run__global_step10_hf-" in md and "| sums_run__global_step20_hf-" in md
    assert (out / "lengths.png").read_bytes()[:4] == b"\x89PNG"


def test_show_and_compare(sums_runs, capsys, tmp_path):
    root, out = sums_runs
    assert main(["show", "--runs", str(out), "--checkpoint", "step20", "--benchmark", "sums", "--problem", "3"]) == 0
    text = capsys.readouterr().out
    assert "=== problem 3" in text and "--- question\nWhat is" in text and "--- prompt" in text and "--- sample 3:" in text
    page = tmp_path / "show.html"
    assert main(["show", "--runs", str(out), "--checkpoint", "step20", "--benchmark", "sums", "--html", str(page)]) == 0
    html = page.read_text()
    assert "<script>alert" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "<script" not in html
    assert html.count("<details><summary>problem ") == 12
    assert main(["show", "--runs", str(out), "--checkpoint", "global_step", "--benchmark", "sums"]) == 2
    assert "matches several checkpoints" in capsys.readouterr().err

    cmp_html = tmp_path / "cmp.html"
    assert main(["compare", "--runs", str(out), "--a", "step10", "--b", "step20", "--html", str(cmp_html)]) == 0
    md = capsys.readouterr().out
    samples = {}
    for step in (10, 20):
        (f,) = out.glob(f"*step{step}_hf-*/sums-*/samples.jsonl")
        acc = {}
        for s in map(json.loads, open(f)):
            acc.setdefault(s["problem_id"], []).append(s["correct"])
        samples[step] = {pid: sum(v) / len(v) for pid, v in acc.items()}
    gained = sum(samples[10][p] == 0 and samples[20][p] > 0 for p in samples[10])
    lost = sum(samples[10][p] > 0 and samples[20][p] == 0 for p in samples[10])
    a = 100 * sum(samples[10].values()) / 12
    b = 100 * sum(samples[20].values()) / 12
    row = next(line for line in md.splitlines() if line.startswith("| sums | 12 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:4] == [f"{a:.1f}", f"{b:.1f}"] and cells[6:8] == [str(gained), str(lost)]
    assert cells[4].startswith(f"{b - a:+.1f} [")  # the difference with its paired bootstrap interval
    lo, hi = (float(x) for x in cells[4].split("[")[1].rstrip("]").split(","))
    assert lo <= b - a <= hi and 0 < float(cells[5]) <= 1
    assert gained > 0
    page = cmp_html.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and page.count("<details class=") == 12


def test_metrics_logged_against_training_step(sums_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, out = sums_runs
    ms = {json.loads(p.read_text())["step"]: json.loads(p.read_text()) for p in out.glob("*/sums-*/metrics.json")}
    acc = EventAccumulator(str(root / "tb" / "sums_run"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"eval/sums_pass1", "eval/sums_pass2", "eval/sums_maj4", "eval/sums_response_length_mean",
            "eval/sums_truncated_rate"} <= tags
    events = acc.Scalars("eval/sums_pass1")
    assert [e.step for e in events] == [10, 20]
    assert [e.value for e in events] == pytest.approx([ms[10]["pass@1"], ms[20]["pass@1"]])
    assert [e.value for e in acc.Scalars("eval/sums_maj4")] == pytest.approx([ms[10]["maj@k"]["4"], ms[20]["maj@k"]["4"]])


def test_wandb_offline_run_holds_the_eval_series(sums_runs, tmp_path, monkeypatch):
    root, out = sums_runs
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert main(["report", "--runs", str(out), "--no-plots", "--wandb-project", "lpo-eval-test"]) == 0
    import time

    from wandb.proto import wandb_internal_pb2

    (run_file,) = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    deadline = time.monotonic() + 60
    while True:  # the wandb-core service writes the file asynchronously, also after finish() returned
        history = []
        for data in _wandb_records(run_file.read_bytes()):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(data)
            if rec.WhichOneof("record_type") == "history":
                history.append({item.nested_key[0] if item.nested_key else item.key: json.loads(item.value_json)
                                for item in rec.history.item})
        if len(history) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    ms = {json.loads(p.read_text())["step"]: json.loads(p.read_text()) for p in out.glob("*/sums-*/metrics.json")}
    assert [h["eval/global_step"] for h in history] == [10, 20]
    assert [h["eval/sums_pass1"] for h in history] == pytest.approx([ms[10]["pass@1"], ms[20]["pass@1"]])


def _wandb_records(raw: bytes):
    """Records of a W&B offline ``.wandb`` file: a 7-byte header (":W&B", magic, version), then a LevelDB-style
    log of 32 KiB blocks whose chunks (crc32 4, length 2, type 1: full/first/middle/last) carry protobufs."""
    import struct

    assert raw[:4] == b":W&B"
    pos, buf = 7, b""
    while pos + 7 <= len(raw):
        left = 32768 - pos % 32768
        if left < 7:  # block trailer: padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if pos + 7 + length > len(raw):  # a record still being written
            return
        chunk = raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            continue
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            yield buf
            buf = b""
