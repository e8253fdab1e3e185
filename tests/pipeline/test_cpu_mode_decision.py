"""How lpo-train decides the CPU mode: from this driver AND the Ray cluster it joins (RAY_ADDRESS).

A GPU cluster's driver often runs on a head or login node without a GPU (KubeRay, Slurm): it must
run the real GPU pipeline, not the CPU mode. Real local Ray clusters declare logical GPU slots here.
"""

import json
import os
import subprocess
import sys

import pytest

HEAD = r"""
import sys, time, ray
ray.init(address="local", num_cpus=1, num_gpus=int(sys.argv[1]), include_dashboard=False)
print(ray.get_runtime_context().gcs_address, flush=True)
time.sleep(600)
"""

DRIVER = r"""
import json, os, sys
from openrlhf_lpo.cpu.mode import decide_cpu_mode, init_ray
on, reason = decide_cpu_mode("auto", os.environ["RAY_ADDRESS"], local_gpu=False)
out = {"on": on, "reason": reason, "off_flag": decide_cpu_mode("off", os.environ["RAY_ADDRESS"])[0],
       "on_flag": decide_cpu_mode("on", os.environ["RAY_ADDRESS"])[0]}
os.environ["LPO_CPU_MODE"] = "1"  # the environment's --cpu.mode on
out["env_on"] = list(decide_cpu_mode("auto", os.environ["RAY_ADDRESS"], local_gpu=False))
del os.environ["LPO_CPU_MODE"]
if os.environ.get("LOST_ADDRESS"):  # a --ckpt.auto_resume supervisor pins the decision for every attempt
    from types import SimpleNamespace
    from openrlhf_lpo.cli import auto_resume
    logged = []
    out["pin"] = auto_resume.child_env(SimpleNamespace(cpu=SimpleNamespace(mode="auto")), logged.append)
    out["pin_log"] = logged
    os.environ.update(out["pin"])  # a restart's environment; its cluster has lost every GPU node meanwhile
    out["restart"] = list(decide_cpu_mode("auto", os.environ["LOST_ADDRESS"], local_gpu=False))
    del os.environ["LPO_CPU_MODE"]
if on:
    import ray
    ray.shutdown()
    try:
        init_ray()
        out["init"] = "ok"
    except RuntimeError as e:
        out["init"] = str(e)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ray_head():
    """``start(gpus)``: the address of a local Ray head with that many logical GPUs, one per count for the
    module (the tests only join it)."""
    procs, heads = [], {}

    def start(gpus):
        if gpus not in heads:
            p = subprocess.Popen([sys.executable, "-c", HEAD, str(gpus)], stdout=subprocess.PIPE, text=True,
                                 start_new_session=True)
            procs.append(p)
            heads[gpus] = p.stdout.readline().strip()
            assert heads[gpus], "the Ray head did not start"
        return heads[gpus]

    yield start
    for p in procs:  # our own heads only (never `ray stop`: other clusters may run on this machine)
        p.terminate()
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()


def _driver(address, **extra):
    env = dict(os.environ, RAY_ADDRESS=address, **extra)
    out = subprocess.run([sys.executable, "-c", DRIVER], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_gpu_less_driver_joining_a_gpu_cluster_keeps_cpu_mode_off(ray_head):
    """... and keeps it off in every --ckpt.auto_resume attempt: a restart whose cluster has lost all its GPU
    nodes (here: a cluster without GPUs, where a fresh decision is "on", next test) does not decide again, so it
    waits for the GPUs (cli/capacity.py) instead of training the GPU recipe on CPUs."""
    res = _driver(ray_head(2), LOST_ADDRESS=ray_head(0))
    assert res["on"] is False and "has 2 GPUs" in res["reason"]
    assert res["off_flag"] is False and res["on_flag"] is True
    assert res["env_on"] == [True, "LPO_CPU_MODE=1"]  # how a CPU cluster with logical GPU slots is joined
    assert res["pin"] == {"LPO_CPU_MODE": "0"}
    assert res["pin_log"] == [f"CPU mode off for every attempt: {res['reason']}"]
    assert res["restart"] == [False, "LPO_CPU_MODE=0"]


def test_cluster_without_gpus_gets_cpu_mode_and_a_clear_error(ray_head):
    res = _driver(ray_head(0))
    assert res["on"] is True and "has none" in res["reason"]
    assert "declares no GPU resources" in res["init"] and "ray start --head --num-gpus" in res["init"]


def test_no_cluster_and_no_gpu_means_cpu_mode(tmp_path, monkeypatch):
    from openrlhf_lpo.cpu.mode import decide_cpu_mode, recorded_cluster

    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # where Ray looks for a cluster `ray start` recorded: none
    nothing = (True, "no GPU here and no Ray cluster to join (RAY_ADDRESS unset)")
    assert recorded_cluster() is None and decide_cpu_mode("auto", None, local_gpu=False) == nothing
    # a record whose cluster is gone (killed without `ray stop`: no raylet serves it) is no cluster to join
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("10.255.255.1:6379")
    assert recorded_cluster() is None and decide_cpu_mode("auto", None, local_gpu=False) == nothing
    assert decide_cpu_mode("auto", None, local_gpu=True)[0] is False
    with pytest.raises(ValueError, match="--cpu.mode"):
        decide_cpu_mode("sometimes", None)


def test_a_recorded_cluster_s_gpus_are_real_on_other_machines_only():
    """A GPU-less driver and the cluster `ray start` recorded: GPUs of nodes on other machines are real (a GPU-less
    head or login node: the GPU pipeline joins it); GPUs of this machine's node are logical slots, unless this
    machine has NVIDIA devices (a driver whose GPUs are hidden). Dead nodes do not count."""
    from openrlhf_lpo.cpu.mode import gpus_elsewhere

    def node(nid, ip, gpus, alive=True):
        return {"NodeID": nid, "NodeManagerAddress": ip, "Alive": alive, "Resources": {"GPU": gpus, "CPU": 8.0}}

    cluster = [node("head", "10.0.0.1", 4.0), node("w1", "10.0.0.2", 8.0), node("w2", "10.0.0.3", 8.0, alive=False),
               node("sim", "10.0.0.1", 2.0)]
    assert gpus_elsewhere(cluster, "head", nvidia_here=False) == (14.0, 8.0)
    assert gpus_elsewhere(cluster[:1] + cluster[3:], "head", nvidia_here=False) == (6.0, 0.0)  # all logical
    assert gpus_elsewhere(cluster[:1], "head", nvidia_here=True) == (4.0, 4.0)



OFF_PROBE = r"""
import contextlib, io, json, os, sys
import ray, torch
from openrlhf_lpo.cpu import mode as cpu
from openrlhf_lpo.cli import flags
from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse

base = ["--actor.model_name_or_path", "x", "--reward.remote_url", "r.py", "--algo.advantage.estimator", "group_norm",
        "--rollout.n_samples_per_prompt", "2", "--cpu.engine", "vllm"]
results = {}
for name, extra, env in (("flag", ["--cpu.mode", "off"], None), ("env", [], "0")):
    if env is not None:
        os.environ["LPO_CPU_MODE"] = env
    args = build_parser_and_parse(base + extra)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        direct = cpu._cpu_before_train(args)
        with contextlib.ExitStack() as stack:  # every flag group's before_train, as lpo-train enters them
            flags.enter_before_train(stack, args)
            inside = {"ray": ray.is_initialized(), "cpu_patched": cpu._STATE["torch"],
                      "engine_env": os.environ.get("LPO_CPU_ENGINE")}
    results[name] = {"mode": args.cpu.mode, "decision": list(cpu.decide_cpu_mode(args.cpu.mode, None, local_gpu=False)),
                     "direct": direct is None, "inside": inside, "log": err.getvalue()}
    os.environ.pop("LPO_CPU_MODE", None)
try:
    torch.cuda.current_device()
    results["cuda"] = "works"
except Exception as e:
    results["cuda"] = type(e).__name__
results["auto"] = list(cpu.decide_cpu_mode("auto", None, local_gpu=False))
print(json.dumps(results))
"""


@pytest.mark.e2e
def test_cpu_mode_off_leaves_the_run_on_the_gpu_path():
    """--cpu.mode off (or LPO_CPU_MODE=0) on a machine without a GPU: no CPU mode. decide_cpu_mode says
    off, the flag group's before_train returns None, nothing is patched (torch.cuda keeps raising on a
    CPU-only machine), no Ray is started and --cpu.engine is not exported; auto would have been on."""
    env = dict(os.environ)
    for key in ("RAY_ADDRESS", "LPO_CPU_ENGINE", "LPO_CPU_MODE"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, "-c", OFF_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["auto"][0] is True  # the same machine and flags with auto: CPU mode on
    for name, mode, reason in (("flag", "off", "--cpu.mode off"), ("env", "auto", "LPO_CPU_MODE=0")):
        r = res[name]
        assert r["mode"] == mode and r["decision"] == [False, reason], r
        assert r["direct"] is True
        assert r["inside"] == {"ray": False, "cpu_patched": False, "engine_env": None}, r
        assert f"[openrlhf_lpo.cpu.mode] CPU mode off: {reason}" in r["log"]
    if not __import__("torch").cuda.is_available():
        assert res["cuda"] != "works"  # the real torch.cuda, not the CPU mode's redirection


JOIN = r"""
import contextlib, json, os, time
import ray
from openrlhf_lpo.cli import flags, plan
from openrlhf_lpo.cli.train_ppo_ray import _check_cluster, build_parser_and_parse

args = build_parser_and_parse(["--actor.model_name_or_path", "x", "--reward.remote_url", "r.py",
                               "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "2",
                               "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1",
                               "--algo.kl.init_coef", "0", "--cpu.mode", "auto"])
with contextlib.ExitStack() as stack:
    flags.enter_before_train(stack, args)  # the CPU-mode probe asks the cluster for its GPUs here
    _check_cluster(args, plan)             # then Ray is joined as stock OpenRLHF's train() would

    @ray.remote(num_cpus=0)
    def worker():
        from openrlhf_lpo.runtime import progress
        print("LPO_WORKER_LINE_REACHES_THE_DRIVER", flush=True)
        keys = ("NCCL_DEBUG", "TOKENIZERS_PARALLELISM", "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS")
        return {k: os.environ.get(k) for k in keys}, progress._STATE["installed"]

    env, hooked = ray.get(worker.remote())
    job_env = ray.get_runtime_context().runtime_env
    time.sleep(3)  # worker output is forwarded asynchronously
    print(json.dumps({"env": env, "hooked": hooked, "hook": job_env.get("worker_process_setup_hook"),
                      "job_env_vars": job_env.get("env_vars", {})}), flush=True)
    ray.shutdown()
"""


def test_gpu_less_driver_joins_a_gpu_cluster_as_stock_openrlhf_would(ray_head):
    """After the CPU-mode probe said "off" (the cluster has GPUs), Ray is initialised exactly as the stock
    train() would: the stock runtime env vars reach the workers, worker output reaches the driver, and the
    project's worker_process_setup_hook runs. (The probe used to leave its own connection up, with
    log_to_driver=False and no runtime env, so the stock ray.init was skipped.)"""
    address = ray_head(2)
    env = dict(os.environ, RAY_ADDRESS=address, NCCL_DEBUG="LPO_TEST_VALUE")
    env.pop("LPO_CPU_MODE", None)
    env.pop("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", None)
    out = subprocess.run([sys.executable, "-c", JOIN], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert "[openrlhf_lpo.cpu.mode] CPU mode off: the Ray cluster at" in out.stderr and "has 2 GPUs" in out.stderr
    assert res["env"] == {"NCCL_DEBUG": "LPO_TEST_VALUE", "TOKENIZERS_PARALLELISM": env.get("TOKENIZERS_PARALLELISM", "true"),
                          "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}, res
    assert res["hook"] == "openrlhf_lpo.runtime.progress.worker_setup" and res["hooked"] is True
    assert "LPO_WORKER_LINE_REACHES_THE_DRIVER" in out.stdout + out.stderr  # log_to_driver
