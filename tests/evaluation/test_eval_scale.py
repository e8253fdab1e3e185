"""Scale: per-sample seeds make shards (``--shard i/n``), data-parallel engine processes (``--dp N``) and
larger n (reusing a smaller run's samples) give the samples of one plain run. Real transformers engine
on the tiny model; engine requests counted by wrapping the real ``HFEngine.generate``."""

import json
import os
from pathlib import Path

import pytest

from evaluation.engines import HFEngine
from evaluation.generate import GEN_FILE, GenOptions, sample_seed
from evaluation.launch import generate
from evaluation.score import find_jobs, score
from evaluation.shards import SHARD_DIR, Shard

REPO = Path(__file__).resolve().parents[2]


def _opts(out, **kw):
    base = dict(benchmarks=["math500"], out=str(out), engine="hf", n={"*": 2}, k={"*": 1}, limit=3,
                batch_problems=2, progress=False, max_tokens=5, template="qwen-boxed", temperature=1.0, top_p=1.0)
    base.update(kw)
    return GenOptions(**base)


def _gen_file(out: Path) -> Path:
    (f,) = out.glob(f"*/*/{GEN_FILE}")
    return f


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


@pytest.fixture
def requests(monkeypatch):
    """Every (prompt, seed) the real hf engine is asked for, and how many engines were built."""
    log = {"seeds": [], "engines": 0}
    real_generate, real_init = HFEngine.generate, HFEngine.__init__

    def generate_(self, prompts, n, sampling, seeds, **kw):
        assert n == 1  # one request per sample
        log["seeds"] += list(seeds)
        return real_generate(self, prompts, n, sampling, seeds, **kw)

    def init_(self, *a, **kw):
        log["engines"] += 1
        real_init(self, *a, **kw)

    monkeypatch.setattr(HFEngine, "generate", generate_)
    monkeypatch.setattr(HFEngine, "__init__", init_)
    return log


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tiny_ckpt):
    """One unsharded single-process run with n = 4: the reference every other layout must reproduce."""
    out = tmp_path_factory.mktemp("plain")
    generate([tiny_ckpt], _opts(out, n={"*": 4}))
    return _gen_file(out)


def test_shards_are_disjoint_and_complete():
    for count in range(1, 6):
        parts = [Shard(i, count).units(7, 3) for i in range(count)]
        flat = [u for part in parts for u in part]
        assert sorted(flat) == [(p, j) for p in range(7) for j in range(3)]  # complete, and disjoint
        assert max(map(len, parts)) - min(map(len, parts)) <= 1  # balanced
    assert Shard(1, 2).compose(1, 4) == Shard(5, 8)  # node 1 of 2, local engine 1 of 4
    for bad in ("2/2", "1", "a/b", "-1/3"):
        with pytest.raises(ValueError, match="expected i/n"):
            Shard.parse(bad)


def test_two_shards_merge_to_the_plain_run_and_score_counts_each_sample_once(tmp_path, tiny_ckpt, plain, requests,
                                                                               kill_engine_after, monkeypatch, capsys):
    out = tmp_path / "sharded"
    import evaluation.generate as gen

    generate([tiny_ckpt], _opts(out, n={"*": 4}, shard=(1, 2)))
    (job,) = [p.parent.parent for p in out.glob(f"*/*/{SHARD_DIR}/1-of-2.jsonl")]
    assert not (job / GEN_FILE).exists()
    # half of the samples: score names the job and does not score part of it
    assert find_jobs(out) == []
    assert f"{job}: 6 of 12 samples generated so far" in capsys.readouterr().err
    # shard 0 is killed after its first engine call, then resumed: it draws only what it lacked
    restore = kill_engine_after(1)
    with pytest.raises(KeyboardInterrupt):
        generate([tiny_ckpt], _opts(out, n={"*": 4}, shard=(0, 2)))
    kept = len(_lines(job / SHARD_DIR / "0-of-2.jsonl.partial"))
    assert 0 < kept < 6
    restore()
    # the last shard renames its file, and the merge is left to `score` (as after a kill right there)
    monkeypatch.setattr(gen, "finish_shard", lambda d, shard, keys: os.replace(shard.partial(d), shard.output(d)))
    requests["seeds"].clear()
    generate([tiny_ckpt], _opts(out, n={"*": 4}, shard=(0, 2)))
    assert len(requests["seeds"]) == 6 - kept  # the resumed shard drew only its missing samples
    assert not (job / GEN_FILE).exists() and (job / SHARD_DIR / "0-of-2.jsonl").exists()
    (m,) = score(out, workers=1, timeout=20, show_progress=False, budgets=())
    assert (job / GEN_FILE).read_bytes() == plain.read_bytes()  # merged = the unsharded run, byte for byte
    assert not (job / SHARD_DIR).exists()
    rows = [json.loads(x) for x in (job / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and len({(r["problem_id"], r["sample_idx"]) for r in rows}) == 12
    assert m["n_problems"] == 3 and m["n"] == 4
    assert m["pass@1"] == pytest.approx(sum(r["correct"] for r in rows) / 12)


DYING_ENGINE = """
import os
if os.environ.get("LPO_EVAL_DP_RANK") == os.environ.get("LPO_TEST_DIE_RANK"):
    import signal
    from evaluation.engines import HFEngine
    real, calls = HFEngine.generate, [0]
    def dying(self, *a, **k):
        calls[0] += 1
        if calls[0] > 1:
            os.kill(os.getpid(), signal.SIGKILL)  # the engine process dies mid-job (OOM killer, preemption)
        return real(self, *a, **k)
    HFEngine.generate = dying
"""


def test_dp2_engine_processes_give_the_samples_of_one_even_when_one_dies(tmp_path, tiny_ckpt, plain, capfd,
                                                                         monkeypatch):
    from evaluation.generate import JobsFailed

    hook = tmp_path / "hook"  # a sitecustomize that SIGKILLs engine process 1/2 in its second engine call
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(DYING_ENGINE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("LPO_TEST_DIE_RANK", "1/2")
    out = tmp_path / "dp2"
    with pytest.raises(JobsFailed, match=r"engine process 1/2 exited with code -9 .*rerun to resume"):
        generate([tiny_ckpt], _opts(out, n={"*": 4}, dp=2))
    err = capfd.readouterr().err
    assert "engine process 0/2" in err and "engine process 1/2" in err  # two processes drew
    assert "shard 0/2" in err and "shard 1/2" in err
    (job,) = [p.parent.parent for p in out.glob(f"*/*/{SHARD_DIR}/0-of-2.jsonl")]  # engine 0 finished its shard
    kept = len(_lines(job / SHARD_DIR / "1-of-2.jsonl.partial"))  # engine 1's first batch was kept
    assert 0 < kept < 6 and not (job / GEN_FILE).exists()
    monkeypatch.delenv("LPO_TEST_DIE_RANK")
    rep = generate([tiny_ckpt], _opts(out, n={"*": 4}, dp=2))  # rerun: engine 1 resumes its shard
    assert (job / GEN_FILE).read_bytes() == plain.read_bytes()  # = the one-engine run, byte for byte
    assert rep.done == [str(job)] and not rep.failed and not (job / SHARD_DIR).exists()
    capfd.readouterr()
    rep = generate([tiny_ckpt], _opts(out, n={"*": 4}, dp=2))  # finished: nothing to do, no engine started
    assert not rep.done and not rep.failed
    assert "engine process" not in capfd.readouterr().err


def test_dp_device_sets_and_errors(monkeypatch):
    from evaluation.dp import device_sets, worker_plan

    assert device_sets(2, 2, ["0", "1", "2", "3"]) == [["0", "1"], ["2", "3"]]
    assert device_sets(3, 1, ["4", "5", "6", "7"]) == [["4"], ["5"], ["6"]]
    with pytest.raises(ValueError, match=r"--dp 4 x --tp 2 needs 8 devices, 4 visible \(0,1,2,3\)"):
        device_sets(4, 2, ["0", "1", "2", "3"])
    monkeypatch.setenv("LPO_DEVICE_ENV", "LPO_TEST_VISIBLE")
    monkeypatch.setenv("LPO_TEST_VISIBLE", "2,3,5,7")
    opts = _opts("/unused", dp=2, engine="vllm", tp=2)
    assert worker_plan(opts) == ("LPO_TEST_VISIBLE", [["2", "3"], ["5", "7"]])
    assert worker_plan(_opts("/unused", dp=2, devices=["7", "5"])) == ("LPO_TEST_VISIBLE", [["7"], ["5"]])


def test_preflight_refuses_missing_dp_devices_before_the_checkpoints(monkeypatch, tmp_path, capsys):
    from evaluation.cli import main

    monkeypatch.setenv("LPO_DEVICE_ENV", "LPO_TEST_VISIBLE")
    monkeypatch.setenv("LPO_TEST_VISIBLE", "0")
    assert main(["generate", "--ckpts", str(tmp_path / "no_such_ckpt"), "--benchmarks", "math500", "--engine", "hf",
                 "--dp", "2", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--dp 2 x --tp 1 needs 2 devices, 1 visible (0)" in err and "no_such_ckpt" not in err


def test_shards_need_per_sample_seeds(tiny_ckpt, tmp_path):
    with pytest.raises(ValueError, match="--dp / --shard .* drop --no-per-request-seed"):
        generate([tiny_ckpt], _opts(tmp_path, engine="vllm", per_request_seed=False, shard=(0, 2)))


def test_larger_n_draws_only_the_new_samples(tmp_path, tiny_ckpt, plain, requests):
    out = tmp_path / "grow"
    generate([tiny_ckpt], _opts(out, n={"*": 2}))
    small = _gen_file(out)
    assert len(requests["seeds"]) == 3 * 2
    requests["seeds"].clear()
    generate([tiny_ckpt], _opts(out, n={"*": 4}))
    (big,) = [f for f in out.glob(f"*/*/{GEN_FILE}") if f != small]  # n is part of the job key: two jobs
    # the engine was asked for samples 2 and 3 of each problem only
    problems = [json.loads(x)["problem_id"] for x in (small.parent / "problems.jsonl").read_text().splitlines()]
    assert sorted(requests["seeds"]) == sorted(sample_seed(0, "math500", p, j) for p in problems for j in (2, 3))
    old, new = _lines(small), _lines(big)
    assert [new[4 * i + j] for i in range(3) for j in range(2)] == old  # the first two of each problem, byte for byte
    assert big.read_bytes() == plain.read_bytes()  # and the whole file is a fresh n = 4 run
    # fewer samples than a finished run holds: nothing is drawn and no engine is even built
    requests["seeds"].clear()
    requests["engines"] = 0
    generate([tiny_ckpt], _opts(out, n={"*": 3}))
    assert requests["seeds"] == [] and requests["engines"] == 0
    (three,) = [f for f in out.glob(f"*/*/{GEN_FILE}") if f not in (small, big)]
    assert _lines(three) == [new[4 * i + j] for i in range(3) for j in range(3)]
    # more problems (--limit) as well: only the new problem's samples are drawn
    requests["seeds"].clear()
    generate([tiny_ckpt], _opts(out, n={"*": 2}, limit=4))
    assert len(requests["seeds"]) == 2


def test_no_reuse_across_other_sampling_settings(tmp_path, tiny_ckpt, requests):
    out = tmp_path / "temps"
    generate([tiny_ckpt], _opts(out, n={"*": 2}))
    requests["seeds"].clear()
    generate([tiny_ckpt], _opts(out, n={"*": 4}, temperature=0.7))  # another distribution: all drawn anew
    assert len(requests["seeds"]) == 3 * 4


def test_reuse_sources_need_the_same_generation_settings(tmp_path):
    from evaluation.reuse import sources

    base = {"benchmark": "b", "seeding": "sample", "per_request_seed": True, "sampling": {"temperature": 1.0},
            "n": 8, "k": 8, "n_problems": 30, "data_sha": "d1", "prompts_sha": "p1", "template": "none"}

    def job(name, **cfg):
        d = tmp_path / "ck" / name
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({**base, **cfg}))
        (d / GEN_FILE).write_text("")
        return d / GEN_FILE

    more_n = job("b-1", n=4, k=4)
    more_problems = job("b-2", n_problems=20, data_sha="d0", prompts_sha="p0")  # --limit 20
    job("b-3", sampling={"temperature": 0.6})
    job("b-4", template="qwen-boxed")
    job("c-5")  # another benchmark
    me = tmp_path / "ck" / "b-me"
    me.mkdir()
    assert sources(me, {**base, "n": 16}) == [more_n, more_problems]
    # image benchmarks: no row records the images, so the data must be the same
    assert sources(me, {**base, "n": 16}, images=True) == [more_n]
    assert sources(me, {**base, "per_request_seed": False}) == []  # vLLM without per-request seeds
    assert sources(me, {k: v for k, v in base.items() if k != "seeding"}) == []  # seeded per problem (old runs)
