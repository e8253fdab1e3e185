"""Data-parallel generation on one node (``lpo-eval generate --dp N --tp T``).

``--dp N`` starts N engine processes (``python -m evaluation _generate-one``), each seeing its own T
devices through the accelerator's visibility variable (``CUDA_VISIBLE_DEVICES`` on NVIDIA and ROCm,
``ZE_AFFINITY_MASK`` on Intel, ``ASCEND_RT_VISIBLE_DEVICES`` on Ascend; ``LPO_DEVICE_ENV`` names another).
Engine process r draws shard r/N of every job (composed with ``--shard i/m``: shard i*N + r of m*N, so a
job array of m nodes with ``--dp N`` each splits every job m*N ways), loads each checkpoint in turn, and
the last shard of a job to finish merges it (:mod:`evaluation.shards`). Each sample has its own seed,
so the samples are those of a one-engine run.

Processes, not Ray: an engine process is the unit vLLM is robust in (it does not release device
memory reliably within a process, and its TP workers want a process tree of their own), it needs no
cluster, and on a CPU machine the same path runs the transformers engine in N processes (tested).

The devices are ``--devices`` when given, else the visibility variable's list, else every device torch
counts; ``N * T`` of them are needed. Without an accelerator the N engines run on the CPU, each with
``cpus / N`` threads unless ``OMP_NUM_THREADS`` is set.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .checkpoints import resolve_checkpoints
from .generate import GenOptions, GenReport, plan_jobs, shard_of

# torch accelerator type -> the variable that restricts a process to some of its devices (ROCm reports "cuda")
DEVICE_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "xpu": "ZE_AFFINITY_MASK", "npu": "ASCEND_RT_VISIBLE_DEVICES",
              "hpu": "HABANA_VISIBLE_MODULES", "mlu": "MLU_VISIBLE_DEVICES"}
WORKER_ENV = "LPO_EVAL_DP_RANK"  # "r/N" in an engine process (for its banner)


def _accelerator():
    try:
        import torch

        if getattr(torch, "accelerator", None) and torch.accelerator.is_available():
            return torch.accelerator
    except Exception:
        pass
    return None


def device_env_var() -> str | None:
    """The visibility variable of this machine's accelerator (``LPO_DEVICE_ENV`` overrides); None without one."""
    if os.environ.get("LPO_DEVICE_ENV"):
        return os.environ["LPO_DEVICE_ENV"]
    acc = _accelerator()
    return DEVICE_ENV.get(acc.current_accelerator().type) if acc is not None else None


def visible_devices(var: str | None) -> list[str]:
    if var and os.environ.get(var, "").strip():
        return [x.strip() for x in os.environ[var].split(",") if x.strip()]
    acc = _accelerator()
    return [str(i) for i in range(acc.device_count())] if acc is not None else []


def device_sets(dp: int, tp: int, devices: list[str]) -> list[list[str]]:
    """``dp`` disjoint sets of ``tp`` devices, in order."""
    if len(devices) < dp * tp:
        raise ValueError(f"--dp {dp} x --tp {tp} needs {dp * tp} devices, {len(devices)} visible "
                         f"({','.join(devices) or 'none'}): lower --dp or --tp, or name them with --devices")
    return [devices[r * tp : (r + 1) * tp] for r in range(dp)]


def worker_plan(opts: GenOptions) -> tuple[str | None, list[list[str]] | None]:
    """(visibility variable, device set per engine process), or (None, None) for engines on the CPU."""
    var = device_env_var()
    tp = opts.tp if opts.engine.startswith("vllm") else 1
    if opts.devices is not None:
        if var is None:
            raise ValueError("--devices: no accelerator is visible to torch, so there is no device variable to set "
                             "(set LPO_DEVICE_ENV to the variable your engines read)")
        return var, device_sets(opts.dp, tp, list(opts.devices))
    devices = visible_devices(var)
    if var is None or not devices:
        return None, None
    return var, device_sets(opts.dp, tp, devices)


def worker_banner(opts: GenOptions) -> None:
    rank = os.environ.get(WORKER_ENV)
    if rank:
        var = device_env_var()
        where = f"devices {os.environ.get(var, '')} ({var})" if var and os.environ.get(var) else "the CPU"
        print(f"lpo-eval generate: engine process {rank} (pid {os.getpid()}) on {where}, shard {shard_of(opts)}",
              file=sys.stderr, flush=True)


def generate_dp(ckpts: list[str], opts: GenOptions) -> GenReport:
    """Run ``opts.dp`` engine processes over the same checkpoints, one shard each; their reports merged."""
    checkpoints, bad = resolve_checkpoints(ckpts)  # a typo fails here, before any process starts
    var, sets = worker_plan(opts)
    whole = dataclasses.replace(opts, shard=(0, 1))
    report = GenReport(failed=[f"{path}: {why}" for path, why in bad])
    pending = False
    for ck in checkpoints:
        try:
            pending = pending or bool(plan_jobs(ck, whole))  # some job not finished yet
        except ValueError as e:
            report.failed.append(f"{ck.source}: {e}")
    if not pending:  # nothing to draw: no engine process is started
        return report
    report = GenReport()  # the engine processes report every failure themselves
    base = shard_of(opts)
    threads = max(1, (os.cpu_count() or 1) // opts.dp)
    procs = []
    with tempfile.TemporaryDirectory(prefix="lpo-eval-dp-") as tmp:
        for r in range(opts.dp):
            shard = base.compose(r, opts.dp)
            wopts = dataclasses.replace(opts, dp=1, devices=None, shard=(shard.index, shard.count),
                                        progress=opts.progress and r == 0)
            spec, result = Path(tmp) / f"spec{r}.json", Path(tmp) / f"result{r}.json"
            spec.write_text(json.dumps({"ckpts": list(ckpts), "opts": dataclasses.asdict(wopts), "result": str(result)}))
            env = dict(os.environ, **{WORKER_ENV: f"{r}/{opts.dp}"})
            if sets is not None:
                env[var] = ",".join(sets[r])
            else:
                env.setdefault("OMP_NUM_THREADS", str(threads))
            procs.append((r, result, subprocess.Popen([sys.executable, "-m", "evaluation", "_generate-one", str(spec)],
                                                      env=env)))
        try:
            for r, result, proc in procs:
                rc = proc.wait()
                if result.exists():
                    report.merge(GenReport(**json.loads(result.read_text())))
                else:
                    report.failed.append(f"engine process {r}/{opts.dp} exited with code {rc} (its log is above); "
                                         "rerun to resume")
        finally:  # interrupted: stop the engine processes this call started (their shards resume later)
            for _, _, proc in procs:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait()
    report.done = list(dict.fromkeys(report.done))  # what every engine process reports, once
    report.failed = list(dict.fromkeys(report.failed))
    return report
