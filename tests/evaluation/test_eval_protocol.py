"""The paper's protocol one flag away: presets and their overrides, the settings header of every
report, the Pass@k average over k > 1, loud subsets, MMLU-Pro's extraction chain, GPQA's option orderings."""

import json
from fractions import Fraction
from math import comb

import pytest

from evaluation.benchmarks import BENCHMARKS, load_benchmark
from evaluation.checkpoints import local_checkpoint
from evaluation.cli import _gen_options, build_parser, main
from evaluation.engines import ENGINES, Completion, register_engine
from evaluation.generate import plan_jobs
from evaluation.protocol import PAPER_K, PRESETS
from evaluation.templates import VERL_MATH_INSTRUCTION

ORACLE: dict[str, str] = {}  # question -> the text of a correct response (filled by the test)

if "oracle-test" not in ENGINES:

    @register_engine("oracle-test")
    class OracleEngine:
        """Planted answers (no model): sample j of a prompt is right when (seed + j) % 3 == 0, else no answer."""

        def __init__(self, model_path, **kw):
            self.tokenizer = None

        def generate(self, prompts, n, sampling, seeds):
            out = []
            for prompt, seed in zip(prompts, seeds):
                (right,) = [a for q, a in ORACLE.items() if q in prompt]
                out.append([Completion(right if (seed + j) % 3 == 0 else "I have no idea.", "stop", 5) for j in range(n)])
            return out

        def close(self):
            pass


def _opts(tiny_ckpt, tmp_path, *flags, benchmarks="aime24,math500,minerva"):
    args = build_parser().parse_args(["generate", "--ckpts", tiny_ckpt, "--out", str(tmp_path), "--benchmarks",
                                      benchmarks, "--limit", "1", *flags])
    return _gen_options(args)


def _sampling(o):
    return (o.template, o.temperature, o.top_p, o.top_k, o.max_tokens)


def test_presets_and_flags_that_beat_them(tiny_ckpt, tmp_path):
    assert _sampling(_opts(tiny_ckpt, tmp_path)) == ("qwen-boxed", 0.6, 0.95, -1, 8192)  # no preset: the defaults
    paper = _opts(tiny_ckpt, tmp_path, "--preset", "paper")
    assert _sampling(paper) == ("verl-math", 1.0, 1.0, -1, 4096) and paper.k == PAPER_K
    jobs = {j.config["benchmark"]: j for j in plan_jobs(local_checkpoint(tiny_ckpt), paper)}
    for bench, k in (("aime24", 32), ("math500", 1), ("minerva", 4)):  # the paper's k, n = k
        cfg = jobs[bench].config
        assert (cfg["n"], cfg["k"], cfg["template"]) == (k, k, "verl-math")
        assert (cfg["sampling"]["temperature"], cfg["sampling"]["top_p"], cfg["sampling"]["max_tokens"]) == (1.0, 1.0, 4096)
    assert jobs["aime24"].prompts[0].rstrip().endswith(VERL_MATH_INSTRUCTION + "<|im_end|>\n<|im_start|>assistant")
    # every explicit flag beats the preset, per benchmark for --k
    o = _opts(tiny_ckpt, tmp_path, "--preset", "paper", "--temperature", "0.6", "--top-p", "0.9", "--top-k", "20",
              "--max-tokens", "2048", "--template", "qwen-boxed", "--k", "math500=4")
    assert _sampling(o) == ("qwen-boxed", 0.6, 0.9, 20, 2048)
    jobs = {j.config["benchmark"]: j for j in plan_jobs(local_checkpoint(tiny_ckpt), o)}
    assert [(jobs[b].n, jobs[b].config["k"]) for b in ("aime24", "math500", "minerva")] == [(32, 32), (4, 4), (4, 4)]
    assert _opts(tiny_ckpt, tmp_path, "--preset", "paper", "--k", "2").k == {"*": 2}  # every benchmark: the preset's go
    assert _sampling(_opts(tiny_ckpt, tmp_path, "--preset", "r1")) == ("chat", 0.6, 0.95, -1, 32768)
    # the paper's k are the registry's defaults too (a run without a preset uses them)
    assert {b: BENCHMARKS[b].k for b in PAPER_K} == PAPER_K


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--ckpts", "X", "--out", "o", "--preset", "papr"], "argument --preset: invalid choice: 'papr'"),
        (["generate", "--ckpts", "X", "--out", "o", "--gpqa-orderings", "0"], "--gpqa-orderings must be >= 1"),
        (["score", "--runs", "r", "--require-box", "sometimes"], "argument --require-box: invalid choice"),
        (["score", "--runs", "r", "--choice-extraction", "lm-eval"], "the chain must be one of explicit, mmlu-pro"),
        (["score", "--runs", "r", "--choice-extraction", "math500=mmlu-pro"], "math500 is not a multiple-choice"),
        (["score", "--runs", "r", "--choice-extraction", "mmlu=mmlu-pro"], "unknown benchmark 'mmlu'"),
        (["report", "--runs", "r", "--passk-average", "k>2"], "argument --passk-average: invalid choice"),
    ],
)
def test_bad_protocol_flags_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def _pass_at_k(n, c, k):
    return 1 - Fraction(comb(n - c, k), comb(n, k))


def test_paper_preset_end_to_end_with_its_header(tiny_ckpt, tmp_path, capsys, bench_dir, gpqa_csv):
    out = tmp_path / "runs"
    gpqa = gpqa_csv(3)
    benches = {"aime24": None, "math500": None, "mmlu_pro": None, "gpqa_diamond": str(gpqa)}
    for b, src in benches.items():
        for p in load_benchmark(b, src, limit=3).problems:
            ORACLE[p.question] = "\\boxed{%s}" % p.gold
    argv = ["--no-progress", "run", "--preset", "paper", "--ckpts", tiny_ckpt, "--benchmarks", ",".join(benches),
            "--data", f"gpqa_diamond={gpqa}", "--limit", "3", "--engine", "oracle-test", "--out", str(out),
            "--workers", "1", "--no-plots"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "preset paper: template=verl-math (preset paper), temperature=1.0 (preset paper)" in err
    assert "WARNING: mmlu_pro is a SUBSET: 3 of its 12,032 test questions (" in err
    assert "mmlu_pro/test.jsonl holds 300; --limit 3): not comparable with published numbers; the staged copy" in err
    assert "gpqa_diamond: 4 option orderings per question (12 problems)" in err
    metrics = {json.loads(p.read_text())["benchmark"]: json.loads(p.read_text()) for p in out.glob("*/*/metrics.json")}
    assert {b: (m["n"], m["k"], m["n_problems"]) for b, m in metrics.items()} == {
        "aime24": (32, 32, 3), "math500": (1, 1, 3), "mmlu_pro": (1, 1, 3), "gpqa_diamond": (1, 1, 12)}
    # Pass@k from the planted samples, independently of the grader
    expect = {}
    for job in out.glob("*/*/samples.jsonl"):
        rows = [json.loads(line) for line in job.read_text().splitlines()]
        bench = rows[0]["benchmark"]
        by = {}
        for r in rows:
            by.setdefault(r["problem_id"], []).append(r["response"].startswith("\\boxed"))
        n = len(next(iter(by.values())))
        expect[bench] = {k: float(sum(_pass_at_k(n, sum(v), k) for v in by.values()) / len(by)) for k in (1, n)}
        assert [r["correct"] for r in rows] == [r["response"].startswith("\\boxed") for r in rows], bench
    for b, m in metrics.items():
        assert m["pass@1"] == pytest.approx(expect[b][1]) and m["pass@k"][str(m["n"])] == pytest.approx(expect[b][m["n"]])
    assert 0 < expect["aime24"][32] and expect["aime24"][1] < 1  # the planted pattern has right and wrong samples
    # GPQA: Pass@1 is the mean over its four orderings of each ordering's accuracy
    rows = [json.loads(line) for line in next(out.glob("*/gpqa_diamond-*/samples.jsonl")).read_text().splitlines()]
    per_ordering = [sum(r["correct"] for r in rows if r["problem_id"].endswith(f"-o{o}")) / 3 for o in range(4)]
    assert metrics["gpqa_diamond"]["pass@1"] == pytest.approx(sum(per_ordering) / 4)
    # the report: the paper's Pass@k average (only aime24 has k > 1 among the math benchmarks) and its header
    table = json.loads((out / "summary.json").read_text())
    (row,) = table["rows"]
    assert row["math_avg_pass@k"] == pytest.approx(expect["aime24"][32])
    assert row["math_avg_pass@1"] == pytest.approx((expect["aime24"][1] + expect["math500"][1]) / 2)
    md = (out / "summary.md").read_text()
    head = md.split("### Pass@1")[0]
    for line in ("> **WARNING: mmlu_pro is a SUBSET: 3 of its 12,032 test questions** (the first 3 of the 300 rows of /",
                 "> **WARNING: gpqa_diamond is a SUBSET: 3 of its 198 test questions**",
                 "- preset: paper (every setting below matches it)", "- template: verl-math", "- temperature: 1.0",
                 "- top p: 1.0", "- top k: -1", "- max tokens: 4096", "- seed: 0", "- engine: oracle-test",
                 "aime24 n=32 k=32, math500 n=1 k=1", "- Pass@k average: over the benchmarks with k > 1 (the paper's)",
                 "- box required: truncated responses (hit --max-tokens) are graded by their boxes only",
                 "- choice extraction: explicit (the last explicit answer)",
                 "- gpqa_diamond: 4 option orderings per question"):
        assert line in head, (line, head)
    assert "| math avg (k>1) |" in md
    # the other average on request; MMLU-Pro's chain for one benchmark (only that job is rescored), in the header
    stamps = {p.parent.name.split("-")[0]: p.stat().st_mtime_ns for p in out.glob("*/*/metrics.json")}
    assert main(["--no-progress", "score", "--runs", str(out), "--workers", "1", "--choice-extraction",
                 "mmlu_pro=mmlu-pro"]) == 0
    changed = {p.parent.name.split("-")[0] for p in out.glob("*/*/metrics.json")
               if p.stat().st_mtime_ns != stamps[p.parent.name.split("-")[0]]}
    assert changed == {"mmlu_pro"}
    assert json.loads(next(out.glob("*/mmlu_pro-*/metrics.json")).read_text())["grader"]["choice_extraction"] == "mmlu-pro"
    assert main(["--no-progress", "report", "--runs", str(out), "--no-plots", "--passk-average", "all"]) == 0
    table = json.loads((out / "summary.json").read_text())
    assert table["rows"][0]["math_avg_pass@k"] == pytest.approx((expect["aime24"][32] + expect["math500"][1]) / 2)
    head = (out / "summary.md").read_text().split("### Pass@1")[0]
    assert ("- choice extraction: **mixed**: mmlu-pro (MMLU-Pro's chain: also the last standalone letter) (mmlu_pro); "
            "explicit (the last explicit answer) (gpqa_diamond)") in head
    assert "over every benchmark of the group" in head


def test_header_says_when_settings_are_mixed_or_match_no_preset():
    from evaluation.protocol import header_lines, job_protocol, table_protocol

    def metrics(bench, temperature, n, k, notes=None):
        cfg = {"template": "verl-math", "sampling": {"temperature": temperature, "top_p": 1.0, "top_k": -1,
                                                     "max_tokens": 4096}, "seed": 0, "engine": "vllm",
               "data_source": "x", "n_problems": 30, "data_notes": notes or {}}
        return {"benchmark": bench, "group": BENCHMARKS[bench].group, "n": n, "k": k, "protocol": job_protocol(cfg),
                "grader": {"boxes": "last", "require_box": "truncated"}}

    ms = [metrics("aime24", 1.0, 32, 32), metrics("math500", 0.6, 1, 1)]
    prot = table_protocol(ms)
    assert prot["preset"] is None and prot["passk_average"] == "all"
    text = "\n".join(header_lines(prot))
    assert "- temperature: **mixed**: 1.0 (aime24); 0.6 (math500)" in text and "- preset: none" in text
    assert table_protocol([metrics("aime24", 1.0, 32, 32), metrics("math500", 1.0, 1, 1)])["preset"] == "paper"
    assert table_protocol([metrics("aime24", 1.0, 16, 16)])["preset"] is None  # not the paper's k
    # a subset is found from the job's notes, or (older runs) from its problem count and the benchmark's size
    m = metrics("mmlu_pro", 1.0, 1, 1, {"questions": 300, "size": 12032, "subset": True})
    assert table_protocol([m])["subsets"] == {"mmlu_pro": {"questions": 300, "size": 12032, "rows": 300, "source": "x"}}
    m = metrics("minerva", 1.0, 4, 4)
    m["protocol"]["data_notes"] = {}
    assert table_protocol([m])["subsets"]["minerva"]["questions"] == 30
    with pytest.raises(ValueError, match="--passk-average must be one of auto, all, k>1"):
        table_protocol(ms, "some")
    assert set(PRESETS) == {"paper", "r1"}
