"""Runs and reports: checkpoint layouts (OpenRLHF, verl, Megatron, HF Trainer, hub ids), per-job locks
shared by two processes, the job key, several configs in one report, failing jobs and one-line errors."""

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from evaluation.checkpoints import local_checkpoint, resolve_checkpoints, run_and_label
from evaluation.cli import main
from evaluation.engines import ENGINES, Completion, register_engine
from evaluation.generate import GEN_FILE, GenOptions, JobsFailed, plan_jobs
from evaluation.launch import generate
from evaluation.locks import JobBusy, JobLock
from evaluation.report import collect, report
from evaluation.score import score

REPO = Path(__file__).resolve().parents[2]

if "echo-test" not in ENGINES:

    @register_engine("echo-test")
    class EchoEngine:
        """Deterministic answers from the seed (no model): a real engine's interface without its cost."""

        def __init__(self, model_path, **kw):
            self.tokenizer = None

        def generate(self, prompts, n, sampling, seeds):
            return [[Completion("\\boxed{%d}" % random.Random(s * 7 + j).randint(0, 3), "stop", 3 + j) for j in range(n)]
                    for s in seeds]

        def close(self):
            pass


def _fake_model(d: Path, weights: bool = True) -> Path:
    """A directory that passes for a checkpoint without being loaded (names and layout only)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text("{}")
    if weights:
        (d / "model.safetensors").write_bytes(b"x")
    return d


@pytest.mark.parametrize(
    "rel, run, step, label",
    [
        ("lpo_fwd/ckpt/global_step20_hf", "lpo_fwd", 20, "lpo_fwd__global_step20_hf"),  # OpenRLHF --ckpt.save_hf
        ("grpo/ckpt/best_global_step40_hf", "grpo", 40, "grpo__best_global_step40_hf"),  # OpenRLHF best checkpoint
        ("exp1/global_step_20/actor/huggingface", "exp1", 20, "exp1__global_step_20"),  # verl
        ("meg_run/checkpoints/iter_0000020/hf", "meg_run", 20, "meg_run__iter_0000020"),  # Megatron-LM
        ("sft/checkpoint-500", "sft", 500, "sft__checkpoint-500"),  # HF Trainer
        ("models/qwen-base", "qwen-base", None, "qwen-base"),
    ],
)
def test_run_and_step_from_checkpoint_layouts(rel, run, step, label, tmp_path):
    assert run_and_label(str(tmp_path / rel)) == (run, step, label)


def test_resolve_globs_run_dirs_and_bad_checkpoints(tmp_path):
    a20 = _fake_model(tmp_path / "lpo_a/ckpt/global_step20_hf")
    a10 = _fake_model(tmp_path / "lpo_a/ckpt/global_step10_hf")
    b20 = _fake_model(tmp_path / "lpo_b/ckpt/global_step20_hf")
    _fake_model(tmp_path / "lpo_b/ckpt/global_step30_hf", weights=False)  # still being written
    (tmp_path / "lpo_a/ckpt/_actor/global_step20").mkdir(parents=True)  # DeepSpeed states: not a model
    cks, bad = resolve_checkpoints([str(tmp_path / "*/ckpt/global_step*_hf")])
    assert [(c.run, c.step) for c in cks] == [("lpo_a", 10), ("lpo_a", 20), ("lpo_b", 20)]
    assert len({c.label for c in cks}) == 3  # two runs at step 20 no longer both show as "ckpt"
    assert len(bad) == 1 and "global_step30_hf" in bad[0][0] and "no weight files" in bad[0][1]
    # a run directory: every model directory below it, in step order
    cks, _ = resolve_checkpoints([str(tmp_path / "lpo_a")])
    assert [c.path for c in cks] == [str(a10), str(a20)]
    cks, _ = resolve_checkpoints([f"{a20},{b20}", str(a20)])  # comma lists, duplicates once
    assert [c.path for c in cks] == [str(a20), str(b20)]
    # a sharded Megatron checkpoint is named as such, with what to do
    meg = tmp_path / "meg/checkpoints/iter_0000020/mp_rank_00"
    meg.mkdir(parents=True)
    (meg / "model_optim_rng.pt").write_bytes(b"x")
    (tmp_path / "meg/checkpoints/latest_checkpointed_iteration.txt").write_text("20")
    with pytest.raises(ValueError, match=r"sharded training checkpoint \(Megatron/DeepSpeed\).*--ckpt.save_hf"):
        resolve_checkpoints([str(tmp_path / "meg/checkpoints")])
    with pytest.raises(ValueError, match="matched nothing"):
        resolve_checkpoints([str(tmp_path / "nope*")])


def test_hub_ids_cached_or_a_clear_offline_error(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snap = _fake_model(cache / "models--acme--tiny-math" / "snapshots" / "abc123")
    (cache / "models--acme--tiny-math" / "refs").mkdir()
    (cache / "models--acme--tiny-math" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))  # the constant is read at import
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    (ck,), bad = resolve_checkpoints(["acme/tiny-math"])
    assert not bad and Path(ck.path) == snap and ck.hub_id == "acme/tiny-math" and ck.label == "acme__tiny-math"
    with pytest.raises(ValueError, match=r"'acme/missing' is neither a local directory nor in the Hugging Face cache.*"
                                         r"HF_HUB_OFFLINE is set: download it first"):
        resolve_checkpoints(["acme/missing"])


def _opts(out, **kw):
    base = dict(benchmarks=["aime24", "amc23"], out=str(out), engine="echo-test", n={"*": 2}, k={"*": 1}, limit=3,
                batch_problems=2, progress=False, max_tokens=6, template="qwen-boxed")
    base.update(kw)
    return GenOptions(**base)


def test_job_key_covers_everything_that_changes_outputs(tiny_ckpt):
    (job,) = plan_jobs(local_checkpoint(tiny_ckpt),
                       _opts("/unused", benchmarks=["aime24"], engine="vllm"))
    base = job.config
    from evaluation.io import config_sha

    variants = {"dtype": "bfloat16", "max_model_len": 4096, "tp": 2, "system_prompt": "Be brief.",
                "trust_remote_code": True, "chat_template_kwargs": {"enable_thinking": False}, "template": "none"}
    shas = {config_sha(base)}
    for key, value in variants.items():
        shas.add(config_sha({**base, key: value}))
    stop = dict(base, sampling={**base["sampling"], "stop": ["</s>"]})
    shas.add(config_sha(stop))
    assert len(shas) == len(variants) + 2
    # the options really reach the config
    ck = local_checkpoint(tiny_ckpt)
    (j2,) = plan_jobs(ck, _opts("/unused", benchmarks=["aime24"], engine="vllm", dtype="bfloat16", max_model_len=512,
                                tp=2, system_prompt="Be brief.", stop=["###"]))
    c = j2.config
    assert (c["dtype"], c["max_model_len"], c["tp"], c["system_prompt"], c["sampling"]["stop"]) == (
        "bfloat16", 512, 2, "Be brief.", ["###"])
    assert c["prompts_sha"] != base["prompts_sha"]  # the system prompt changed the rendered prompts
    assert base["sampling"]["stop"] == ["<|im_end|>", "<|endoftext|>"]


def test_two_processes_share_one_out_by_job_locks(tmp_path, tiny_ckpt):
    out = tmp_path / "runs"
    ck = local_checkpoint(tiny_ckpt)
    jobs = plan_jobs(ck, _opts(out))
    held = jobs[0].dir
    # another process holds the aime24 job (as a second `lpo-eval generate` on the same --out would)
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from evaluation.locks import JobLock
            with JobLock({str(held)!r}):
                print("held", flush=True)
                sys.stdin.readline()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert holder.stdout.readline().strip() == "held"
        rep = generate([tiny_ckpt], _opts(out))
        assert len(rep.busy) == 1 and str(held) in rep.busy[0] and f"{holder.pid}@" in rep.busy[0]
        assert [Path(d).name.split("-")[0] for d in rep.done] == ["amc23"]
        assert not (held / GEN_FILE).exists()
        with pytest.raises(JobBusy, match="being processed by another process"):
            JobLock(held).acquire()
    finally:
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(30)
    rep = generate([tiny_ckpt], _opts(out))  # the lock died with its process: the job is done now
    assert [Path(d).name.split("-")[0] for d in rep.done] == ["aime24"] and not rep.busy
    assert (held / GEN_FILE).exists()


def test_report_with_two_configs_picks_the_latest_or_the_selected(tmp_path, tiny_ckpt, capsys):
    out = tmp_path / "runs"
    generate([tiny_ckpt], _opts(out, benchmarks=["aime24"], template="qwen-boxed"))
    generate([tiny_ckpt], _opts(out, benchmarks=["aime24"], template="none"))
    score(out, workers=1, timeout=20, show_progress=False, majority=False)
    cfgs = {json.loads(p.read_text())["template"]: json.loads(p.read_text())["config_sha"]
            for p in out.glob("*/aime24-*/config.json")}
    assert set(cfgs) == {"qwen-boxed", "none"}
    newest = max(out.glob("*/aime24-*/generations.jsonl"), key=lambda p: p.stat().st_mtime_ns)
    (m,) = collect(out)
    assert m["config_sha"] == json.loads((newest.parent / "config.json").read_text())["config_sha"]
    assert "has 2 configs; reporting the latest" in capsys.readouterr().err
    older = "qwen-boxed" if m["config_sha"] == cfgs["none"] else "none"
    (m2,) = collect(out, select={"template": older})
    assert m2["config_sha"] == cfgs[older]
    (m3,) = collect(out, config_sha=cfgs[older][:8])
    assert m3["config_sha"] == cfgs[older]
    with pytest.raises(ValueError, match="matches --select"):
        collect(out, select={"sampling.temperature": "0.9"})
    assert collect(out, select={"sampling.temperature": "0.6", "template": older})[0]["config_sha"] == cfgs[older]
    report(out, plots=False, select={"template": older})


def test_bad_jobs_do_not_stop_the_others_and_errors_are_one_line(tmp_path, tiny_ckpt, capsys):
    out = tmp_path / "runs"
    empty = _fake_model(tmp_path / "run_e" / "ckpt" / "global_step9_hf", weights=False)
    with pytest.raises(JobsFailed, match=r"global_step9_hf: no weight files"):
        generate([tiny_ckpt, str(empty)], _opts(out))
    assert len(list(out.glob(f"*/*/{GEN_FILE}"))) == 2  # the good checkpoint was still evaluated
    # a sample without 'response': that job is reported, the other one is scored
    broken = next(out.glob(f"*/aime24-*/{GEN_FILE}"))
    rows = [json.loads(line) for line in broken.read_text().splitlines()]
    del rows[1]["response"]
    broken.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(["--no-progress", "score", "--runs", str(out), "--workers", "1", "--no-majority"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert f"{broken}:2: row has no 'response' field" in err
    assert len(list(out.glob("*/*/metrics.json"))) == 1  # amc23 scored
    code = main(["generate", "--ckpts", str(empty), "--out", str(out), "--benchmarks", "aime24", "--engine", "hf"])
    err = capsys.readouterr().err
    assert code == 1 and "no weight files" in err and "Traceback" not in err
    (tmp_path / "noconfig").mkdir()
    code = main(["generate", "--ckpts", str(tmp_path / "noconfig"), "--out", str(out), "--benchmarks", "aime24"])
    err = capsys.readouterr().err
    assert code == 2 and "is not a model directory (no config.json in it or below it)" in err and len(err.strip().splitlines()) == 1
