"""Every script in examples/scripts/ dry-runs on this GPU-less machine (LPO_DRY_RUN=1 -> ``lpo-train
--dry-run``): the flags validate, the plan names the GPUs the recipe needs and what happens to each
rollout batch, nothing starts. Datasets of the real sizes are generated (MATH 7500 = 29 x 256 + 76,
Countdown 2000 = 15 x 128 + 80, Geometry3k train 2101 = 16 x 128 + 53), so the partial last batch of an episode is planned as it will run."""

import base64
import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from dry_run_batch import run_batch

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "examples" / "scripts"
ALL_SCRIPTS = sorted(p.name for p in SCRIPTS.glob("*.sh"))

# script -> (dataset rows, GPUs in the header's cluster, expected last-batch line or None)
RECIPES = {
    "train_countdown_qwen3_4b.sh": (2000, 8, "last batch of each episode: 80 prompts: 10 groups per rank"),
    "train_math_qwen3_1.7b.sh": (7500, 8, "last batch of each episode: 76 prompts: 9 groups per rank, 4 dropped"),
    "train_math_qwen3_8b.sh": (7500, 8, "last batch of each episode: 76 prompts: 9 groups per rank, 4 dropped"),
    "train_math_qwen3_8b_long_context.sh": (7500, 8, "groups may exceed --train.max_tokens_per_gpu"),
    "train_math_qwen3_8b_async.sh": (7500, 8, "last batch of each episode: 76 prompts: 19 groups per rank;"),
    "train_math_qwen3_8b_megatron.sh": (7500, 8, None),
    "train_math_qwen3_14b_megatron.sh": (7500, 8, None),
    "train_math_qwen3_32b_megatron.sh": (7500, 16, None),
    "train_math_r1_distill_llama_70b_megatron.sh": (7500, 32, None),
    "train_code_qwen3_1.7b.sh": (25276, 8, "last batch of each episode: 188 prompts: 23 groups per rank, 4 dropped"),
    "train_geometry_qwen2.5_vl_3b.sh": (2101, 8, "last batch of each episode: 53 prompts: 6 groups per rank, 5 dropped"),
}
OTHERS = {"cpu_debug.sh": 2, "gpu_smoke.sh": 1, "gpu_check.sh": 1, "gpu_smoke_megatron.sh": 1}


def _png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), "white").save(buf, format="PNG")
    return buf.getvalue()


def test_every_script_is_covered():
    assert set(RECIPES) | set(OTHERS) == set(ALL_SCRIPTS)


HANDOFF = "train_math_qwen3_8b.sh"  # the recipe whose own dry run (bash -> python) is compared with its batched one


def _script_args(script: str, env: dict, cwd: Path):
    """The flags ``script`` hands to ``lpo-train`` (its ``LPO_PRINT_ARGS=1`` output: bash only)."""
    out = subprocess.run(["bash", str(SCRIPTS / script)], env=dict(env, LPO_PRINT_ARGS="1"), capture_output=True,
                         text=True, timeout=60, cwd=str(cwd))
    assert out.returncode == 0, (script, out.stderr[-2000:])
    return out.stdout.splitlines()


def plan_lines(stdout: str):
    """A dry run's printed plan and preflight details, without the preflight's timings and library log lines."""
    return [line for line in stdout.splitlines()
            if not line.startswith("[") and not line.startswith("preflight: ") and "Failed to load" not in line]


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory, megatron_layout_model):
    """Every recipe's dry run: the flags its script hands to lpo-train, dry-run in one Python process
    (tests/pipeline/dry_run_batch.py: the imports paid once, not once per recipe); beside it, run as a user
    would (bash, then Python), the scripts that are not recipes and the HANDOFF recipe."""
    root = tmp_path_factory.mktemp("dry")
    base = {k: v for k, v in os.environ.items()
            if k not in ("MODEL", "DATA", "EXTRA_ARGS", "METHOD", "BACKEND", "MEGATRON_TP", "MEGATRON_PP", "NNODES",
                         "GPUS_PER_NODE", "VLLM_ENGINES", "VLLM_TP", "ACTOR_NODES", "ACTOR_GPUS", "LPO_PRINT_ARGS")}
    base.update(LPO_DRY_RUN="1", WORK=str(root / "work"), RAY_ADDRESS="")
    envs = {}
    image = "data:image/png;base64," + base64.b64encode(_png()).decode()
    for script, (rows, _, _) in RECIPES.items():
        vision = "geometry" in script  # the VLM recipe's rows carry one image each (the preflight checks them)
        data = root / (f"{rows}_images.jsonl" if vision else f"{rows}.jsonl")
        if not data.exists():
            data.write_text("".join(json.dumps({"prompt": f"<image>p{i}", "label": "1", "images": [image]} if vision
                                               else {"prompt": f"p{i}", "label": "1"}) + "\n" for i in range(rows)))
        env = dict(base, DATA=str(data))
        if "megatron" in script:  # the Megatron layout check reads the model's config: offline, a tiny one
            env["MODEL"] = megatron_layout_model
        envs[script] = env
    envs["invalid"] = dict(envs["train_math_qwen3_8b.sh"], EXTRA_ARGS="--train.batch_size 1000")
    jobs = [{"name": name, "env": env, "argv": _script_args("train_math_qwen3_8b.sh" if name == "invalid" else name,
                                                            env, root) + ["--dry-run"]}
            for name, env in envs.items()]
    shell = {script: dict(base) for script in OTHERS}
    shell[HANDOFF + " (bash)"] = envs[HANDOFF]

    def run(item):
        name, env = item
        if name == "batch":
            return name, run_batch(jobs, root)
        script = name.split(" ")[0]
        return name, subprocess.run(["bash", str(SCRIPTS / script)], env=env, capture_output=True, text=True,
                                    timeout=600, cwd=str(root))

    with ThreadPoolExecutor(max_workers=2) as pool:
        done = dict(pool.map(run, [("batch", None), *shell.items()]))
    results = done.pop("batch")
    results.update(done)
    return results


def test_a_script_hands_its_recipe_to_lpo_train_as_the_batch_does(dry_runs):
    """The batched dry runs are what the scripts run: the HANDOFF recipe's own dry run (bash, python.sh, then
    ``python -m openrlhf_lpo.cli.train_ppo_ray ... --dry-run``) prints the same plan and preflight."""
    own, batched = dry_runs[HANDOFF + " (bash)"], dry_runs[HANDOFF]
    assert own.returncode == 0 == batched.returncode, own.stderr[-3000:]
    assert "flags are valid; nothing was started" in own.stdout
    assert plan_lines(own.stdout) == plan_lines(batched.stdout)


@pytest.mark.parametrize("script", sorted(RECIPES))
def test_recipe_dry_run_prints_the_plan(dry_runs, script):
    out = dry_runs[script]
    assert out.returncode == 0, out.stderr[-3000:]
    rows, gpus, last = RECIPES[script]
    text = out.stdout
    assert "flags are valid; nothing was started" in text
    assert f"GPUs needed: {gpus}\n" in text
    assert f"dataset: {rows} prompts" in text
    if last:
        assert last in text, text


@pytest.mark.parametrize("script", sorted(OTHERS))
def test_other_scripts_dry_run(dry_runs, script):
    out = dry_runs[script]
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"GPUs needed: {OTHERS[script]}" in out.stdout


def test_invalid_flags_still_fail_in_a_dry_run(dry_runs):
    out = dry_runs["invalid"]
    assert out.returncode == 2 and "--train.batch_size 1000" in out.stderr


def test_scripts_find_the_project_venv_or_say_what_to_do(tmp_path):
    """A script run with a Python that lacks the project tells the user how to install it."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    out = subprocess.run(["bash", str(SCRIPTS / "cpu_debug.sh")], env=dict(os.environ, PYTHON=str(fake)),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "scripts/setup_env.sh" in out.stderr


@pytest.fixture
def ray_start_cluster():
    """A cluster started by ``ray start --head`` (4 logical GPUs) that records its address, as ``ray start`` does,
    in ``$RAY_TMPDIR/ray/ray_current_cluster`` (a folder of its own, so only launches given the same RAY_TMPDIR
    find it). Yields that RAY_TMPDIR and the address; stopped after by killing its own processes (never
    ``ray stop``: it stops every Ray on the machine)."""
    import shutil
    import sys
    import tempfile
    import time

    import psutil

    tmp = tempfile.mkdtemp(prefix="lpo-rs-", dir="/tmp")  # short: Ray's sockets live under it
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--num-cpus", "1",
                             "--num-gpus", "4", "--include-dashboard", "false", "--disable-usage-stats", "--block"],
                            env=dict(env, RAY_TMPDIR=tmp), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)
    record = Path(tmp) / "ray" / "ray_current_cluster"
    t0 = time.time()
    while not record.exists() and head.poll() is None and time.time() - t0 < 180:
        time.sleep(0.2)
    try:
        assert record.exists(), "ray start did not record its cluster"
        yield tmp, record.read_text().strip()
    finally:
        for p in psutil.Process(head.pid).children(recursive=True) + [psutil.Process(head.pid)]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        head.wait()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.e2e
def test_a_recipe_that_cannot_fit_stops_at_once(tiny_model_dir, tmp_path, ray_start_cluster):
    """A real launch compares the GPUs its placement groups need with the Ray cluster before any actor
    starts: 2 actor GPUs + 1 engine on a cluster of 2 logical GPUs stops with the need per role (exit 5).

    Beside it runs a cluster ``ray start`` recorded on the machine, with 4 logical GPUs, and no RAY_ADDRESS:
    the CPU mode starts a cluster of its own (2 GPUs, ``LPO_CPU_NUM_GPUS``) and says why. It used to join the
    recorded one and die in Ray's ``ValueError: When connecting to an existing cluster, num_cpus and num_gpus
    must not be provided``; joined with that cluster's own resources it would have fit and trained."""
    import sys
    import time

    ray_tmpdir, address = ray_start_cluster
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "label": "1"}) + "\n" for i in range(8)))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "LPO_CPU_MODE")}
    env.update(LPO_CPU_NUM_GPUS="2", PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
               RAY_TMPDIR=ray_tmpdir)
    t0 = time.time()
    out = subprocess.run(
        [sys.executable, "-m", "openrlhf_lpo.cli.train_ppo_ray", "--actor.model_name_or_path", tiny_model_dir,
         "--data.prompt_dataset", str(data), "--data.input_key", "prompt", "--data.label_key", "label",
         "--reward.remote_url", str(REPO / "openrlhf_lpo" / "rewards" / "reward_func.py"), "--actor.num_gpus_per_node", "2",
         "--vllm.num_engines", "1", "--algo.kl.init_coef", "0", "--rollout.n_samples_per_prompt", "4",
         "--rollout.batch_size", "4", "--train.batch_size", "16", "--train.micro_batch_size", "2",
         "--data.max_len", "512", "--algo.advantage.estimator", "lpo"],
        env=env, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert out.returncode == 5, out.stderr[-3000:]
    assert "needs 3 GPUs (actor 2, vLLM engines 1) but the Ray cluster has 2" in out.stderr
    assert time.time() - t0 < 240 and "Global step" not in out.stdout + out.stderr
    assert (f"CPU mode on: no GPU here; the Ray cluster `ray start` recorded on this machine ({address}, 4 logical "
            f"GPUs) is not joined: the CPU mode starts a cluster of its own (to run on that one: RAY_ADDRESS={address} "
            "LPO_CPU_MODE=1)") in out.stderr
    assert "When connecting to an existing cluster" not in out.stderr


# the actor's rank-to-node map of the big recipes, worked out from their headers' layouts (14B: one node, colocated)
PLACEMENT = {
    "train_math_qwen3_14b_megatron.sh": ["actor ranks by node (node-major: each node's Ray bundles in rank order, "
                                         "1 x 8 GPUs):", "node 0: ranks 0-7 = replica 0, replica 1 (TP 4 each)"],
    "train_math_qwen3_32b_megatron.sh": ["actor ranks by node (node-major: each node's Ray bundles in rank order, "
                                         "2 x 8 GPUs):", "node 0: ranks 0-7 = replica 0 stage 0 (TP 8 each)",
                                         "node 1: ranks 8-15 = replica 0 stage 1 (TP 8 each)"],
    "train_math_r1_distill_llama_70b_megatron.sh": [
        "actor ranks by node (node-major: each node's Ray bundles in rank order, 4 x 8 GPUs):",
        "node 0: ranks 0-7 = replica 0 stage 0 (TP 8 each)", "node 1: ranks 8-15 = replica 0 stage 1 (TP 8 each)",
        "node 2: ranks 16-23 = replica 0 stage 2 (TP 8 each)", "node 3: ranks 24-31 = replica 0 stage 3 (TP 8 each)"],
}


@pytest.mark.parametrize("script", sorted(PLACEMENT))
def test_big_recipes_dry_run_prints_the_rank_to_node_layout(dry_runs, script):
    lines = [line.strip() for line in dry_runs[script].stdout.splitlines()]
    start = lines.index(PLACEMENT[script][0])
    assert lines[start:start + len(PLACEMENT[script])] == PLACEMENT[script]
    assert not lines[start + len(PLACEMENT[script])].startswith("node ")
