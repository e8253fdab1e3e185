"""Megatron actor step vs DeepSpeed actor step: the same tiny Qwen3, the same LPO rollout batch, one process.

    python benchmarks/megatron_step.py [--groups 4] [--k 8] [--resp-len 64] [--rounds 7] [--json out.json]

Both sides train the LPO objective on identical experiences (made once by the real LPOExperienceMaker),
interleaved round after round, fp32, one rank, with the same micro-batches and optimizer windows:

* one_pass      micro-batch = K, one optimizer step: whole groups per micro-batch on both sides
* two_windows   micro-batch = 2 < K, two optimizer steps per rollout batch: window 1 takes c from s_t (no
                pre-pass) and window 2 runs one no-grad pre-pass, on both sides

DeepSpeed side: OpenRLHF 0.11.2's training loop with ``LPOActorTrainer.ppo_train`` and the HF actor (sdpa),
the engine steps done in plain torch by tests/openrlhf/lpo_fixtures.CPUStrategy (no DeepSpeed engine runs on
a CPU). Megatron side: the Ray policy actor's ``fit`` (``--backend megatron``, TP1, packed THD micro-batches,
megatron-core's schedule, DDP, optimizer) on gloo. Learning rate 0 on both sides, so every round does the
same work. It prints the best-of-rounds ratio Megatron / DeepSpeed and the median of the per-round ratios
(process CPU time by default: other jobs on a shared machine do not distort it).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "openrlhf"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--resp-len", type=int, default=64, help="mean response length (tokens)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave default)")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--json", default=None, help="also write the results here (atomically)")
    opts = ap.parse_args(argv)

    import socket

    import torch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from openrlhf_lpo.cpu import megatron_redirect as cpu_megatron

    cpu_megatron.apply()  # megatron-core's accelerator calls answered for the CPU (a no-op on a GPU machine)
    import torch.distributed as dist

    if opts.threads:
        torch.set_num_threads(opts.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)

    import lpo_fixtures as H

    from openrlhf_lpo.megatron.ray_actor import plain_class
    from openrlhf_lpo.openrlhf.actor_trainer import LPOActorTrainer

    G, K = opts.groups, opts.k
    model_dir, samples = H.benchmark_inputs(tempfile.mkdtemp(prefix="lpo-mbench-"), G, K, opts.resp_len, opts.hidden,
                                            opts.layers)

    layouts = {"one_pass": dict(micro=K, train_batch=G * K), "two_windows": dict(micro=2, train_batch=G * K // 2)}
    actor = H.make_actor(model_dir, dtype=torch.float32)
    state = copy.deepcopy(actor.model.state_dict())
    runs = {}
    for name, lay in layouts.items():
        args = H.parse_args(model_dir, K=K, G=G, **lay)
        args.actor.entropy_coef = 0.0
        exps = H.make_experiences(args, H.CPUStrategy(args), actor, samples)
        trainer = H.make_trainer(LPOActorTrainer, args, H.CPUStrategy(args), actor, lr=0.0)
        margs = H.parse_args(model_dir, K=K, G=G, extra=["--backend", "megatron", "--megatron.params_dtype", "fp32",
                                                         "--actor.adam.lr", "0", "--actor.lr_scheduler", "constant",
                                                         "--actor.lr_warmup_ratio", "0"], **lay)
        margs.actor.entropy_coef = 0.0
        cls = plain_class()
        mega = cls.__new__(cls)
        from types import SimpleNamespace as NS

        mega.init_model_from_pretrained(NS(args=margs), model_dir, max_steps=100, vllm_engines=None)
        runs[name] = (trainer, mega, exps)

    clock = time.process_time if opts.clock == "cpu" else time.perf_counter

    def run_deepspeed(name):
        trainer, _, exps = runs[name]
        trainer.replay_buffer.clear()
        for e in exps:
            trainer.replay_buffer.append(copy.deepcopy(e))
        actor.model.load_state_dict(state)
        with H.cpu_cuda_queries("cpu"):
            t0 = clock()
            status = trainer.ppo_train(0.0)
            return clock() - t0, status

    def run_megatron(name):
        _, mega, exps = runs[name]
        for e in exps:
            mega.append(copy.deepcopy(e))
        t0 = clock()
        status = mega.fit(0.0)
        return clock() - t0, status

    passes = {}
    for name in layouts:  # warm-up, and the windows each side ran (they must match)
        _, st_ds = run_deepspeed(name)
        _, st_m = run_megatron(name)
        passes[name] = {side: {k: st[k] for k in ("lpo/one_pass_windows", "lpo/shortcut_windows", "lpo/pre_pass_windows")}
                        for side, st in (("deepspeed", st_ds), ("megatron", st_m))}
        if passes[name]["deepspeed"] != passes[name]["megatron"]:
            raise SystemExit(f"{name}: the two sides ran different passes: {passes[name]}")
    times = {f"{n}/{side}": [] for n in layouts for side in ("deepspeed", "megatron")}
    for _ in range(opts.rounds):
        for name in layouts:
            times[f"{name}/deepspeed"].append(run_deepspeed(name)[0])
            times[f"{name}/megatron"].append(run_megatron(name)[0])
    ratio = {n: min(times[f"{n}/megatron"]) / min(times[f"{n}/deepspeed"]) for n in layouts}
    ratio_median = {n: statistics.median(m / d for m, d in zip(times[f"{n}/megatron"], times[f"{n}/deepspeed"]))
                    for n in layouts}
    result = {
        "setup": {"groups": G, "k": K, "resp_len": opts.resp_len, "hidden": opts.hidden, "layers": opts.layers,
                  "rounds": opts.rounds, "threads": torch.get_num_threads(), "clock": opts.clock},
        "passes": passes,
        "min_seconds": {n: min(t) for n, t in times.items()},
        "median_seconds": {n: statistics.median(t) for n, t in times.items()},
        "megatron_over_deepspeed": ratio,
        "median_of_round_ratios": ratio_median,
    }
    print(f"LPO actor step, {G} prompts x {K} responses (~{opts.resp_len} tokens), hidden {opts.hidden}, "
          f"{opts.layers} layers, {opts.rounds} interleaved rounds, {opts.clock} time:")
    for n in times:
        print(f"  {n:24s} best {result['min_seconds'][n] * 1000:8.1f} ms   median {result['median_seconds'][n] * 1000:8.1f} ms")
    for n in layouts:
        print(f"  {n}: megatron / deepspeed = {ratio[n]:.3f} best-of-rounds, {ratio_median[n]:.3f} median of round "
              f"ratios (passes {passes[n]['megatron']})")
    if opts.json:
        from pathlib import Path

        from openrlhf_lpo.demo.report import atomic_write_json

        atomic_write_json(Path(opts.json), result)
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
