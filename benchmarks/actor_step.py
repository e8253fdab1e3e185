"""Actor-step cost of LPO vs GRPO in OpenRLHF 0.11.2's real training loop, on identical batches.

    python benchmarks/actor_step.py [--layout standard|long_context|all] [--groups 4] [--k 8] [--rounds 9]

Runs, interleaved round after round on the same rollout batch (same tiny Qwen3, same
micro-batches, lr = 0 so every round does identical work), each LPO configuration against stock GRPO
(``ActorPPOTrainer.ppo_train``, ``--algo.advantage.estimator group_norm``) in the same layout:

standard (micro-batch = K, one optimizer step per rollout batch)
* LPO single-pass   micro-batches hold whole groups                        goal <= 1.02
* LPO two-pass      ``--lpo.force_two_pass`` (no-grad s pass + detached surrogate)   goal <= 1.40

long_context (OpenRLHF's long-context recipe: ``--train.micro_batch_size 1 --train.dynamic_batch_enable
--train.max_tokens_per_gpu B --ds.packing_samples``; a group's tokens exceed B, so micro-batches split groups)
* LPO 1 step        one optimizer step per rollout batch: c from s_t, no extra forward   goal <= 1.05
* LPO 2 steps       two optimizer steps (the paper's batch = 2 x mini-batch): the second
                    window needs a no-grad pre-pass over its half of the batch           goal <= 1.20

It prints the best-of-rounds time ratios and the median of per-round ratios (process CPU time by
default, so other jobs on a shared machine do not distort them; ``--clock wall`` for wall time). The
strategy is tests/openrlhf/lpo_fixtures.CPUStrategy (DeepspeedStrategy with the engine steps in plain
torch), so this runs on CPU; everything else is the real OpenRLHF code.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "openrlhf"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", choices=["standard", "long_context", "all"], default="all")
    ap.add_argument("--budget", type=int, default=384, help="long_context: --train.max_tokens_per_gpu")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--resp-len", type=int, default=64, help="mean response length (tokens)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave default)")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="cpu: process CPU time (robust on a shared machine; default), wall: wall clock")
    ap.add_argument("--json", default=None, help="also write the results here (atomically)")
    opts = ap.parse_args(argv)

    import socket

    import torch
    import torch.distributed as dist

    if opts.threads:
        torch.set_num_threads(opts.threads)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)

    import lpo_fixtures as H
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

    from openrlhf_lpo.openrlhf.actor_trainer import LPOActorTrainer

    G, K = opts.groups, opts.k
    # rollout batch: G prompts x K responses of ~resp_len tokens
    model_dir, samples = H.benchmark_inputs(tempfile.mkdtemp(prefix="lpo-bench-"), G, K, opts.resp_len, opts.hidden,
                                            opts.layers)

    # name -> (trainer class, args, experience-maker class, baseline name, goal)
    configs = {}
    if opts.layout in ("standard", "all"):
        common = dict(K=K, G=G, micro=K, train_batch=G * K)
        configs["grpo"] = (ActorPPOTrainer, H.parse_args(model_dir, estimator="group_norm", **common),
                           RemoteExperienceMaker, None, None)
        configs["lpo_single_pass"] = (LPOActorTrainer, H.parse_args(model_dir, **common), None, "grpo", 1.02)
        configs["lpo_two_pass"] = (LPOActorTrainer, H.parse_args(model_dir, extra=["--lpo.force_two_pass"], **common),
                                   None, "grpo", 1.40)
    if opts.layout in ("long_context", "all"):
        dyn = ["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", str(opts.budget),
               "--rollout.max_tokens_per_gpu", str(opts.budget)]
        for steps, goal in ((1, 1.05), (2, 1.20)):
            common = dict(K=K, G=G, micro=1, train_batch=G * K // steps, packing=True)
            base = f"grpo_long_{steps}step"
            configs[base] = (ActorPPOTrainer, H.parse_args(model_dir, estimator="group_norm", extra=dyn, **common),
                             RemoteExperienceMaker, None, None)
            configs[f"lpo_long_{steps}step"] = (LPOActorTrainer, H.parse_args(model_dir, extra=dyn, **common), None,
                                                base, goal)
    for _, args, _, _, _ in configs.values():
        args.actor.entropy_coef = 0.0  # the same response-entropy computation everywhere

    from torch.distributed.device_mesh import init_device_mesh

    actors = {p: H.make_actor(model_dir, packing=p, dtype=torch.float32) for p in (False, True)}
    state = copy.deepcopy(actors[False].model.state_dict())
    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp", "sp", "tp"))  # stock dynamic batching reads it
    batches, trainers = {}, {}
    for name, (cls, args, maker, _, _) in configs.items():
        kwargs = {"maker_cls": maker} if maker else {}
        actor = actors[bool(args.ds.packing_samples)]
        batches[name] = H.make_experiences(args, H.CPUStrategy(args), actor, samples, **kwargs)
        strategy = H.CPUStrategy(args)
        strategy.ds_device_mesh = mesh
        trainers[name] = H.make_trainer(cls, args, strategy, actor, lr=0.0)

    def run(name):
        trainer = trainers[name]
        actor = trainer.actor
        trainer.replay_buffer.clear()
        for e in batches[name]:
            trainer.replay_buffer.append(copy.deepcopy(e))
        actor.model.load_state_dict(state)
        torch.manual_seed(0)
        clock = time.process_time if opts.clock == "cpu" else time.perf_counter
        with H.cpu_cuda_queries("cpu"):
            t0 = clock()
            trainer.ppo_train(0.0)
            return clock() - t0

    for name in configs:  # warm-up
        run(name)
    times = {name: [] for name in configs}
    for _ in range(opts.rounds):
        for name in configs:
            times[name].append(run(name))
    # best-of-rounds ratio: other load on a shared machine only ever adds time
    pairs = {name: (base, goal) for name, (_, _, _, base, goal) in configs.items() if base}
    ratio = {name: min(times[name]) / min(times[base]) for name, (base, _) in pairs.items()}
    ratio_median = {name: statistics.median(t / g for t, g in zip(times[name], times[base]))
                    for name, (base, _) in pairs.items()}
    result = {
        "setup": {"groups": G, "k": K, "resp_len": opts.resp_len, "hidden": opts.hidden, "layers": opts.layers,
                  "budget": opts.budget, "rounds": opts.rounds, "threads": torch.get_num_threads(),
                  "clock": opts.clock, "layout": opts.layout},
        "min_seconds": {n: min(t) for n, t in times.items()},
        "median_seconds": {n: statistics.median(t) for n, t in times.items()},
        "ratio_vs_baseline": ratio,
        "median_of_round_ratios": ratio_median,
        "baselines": {n: b for n, (b, _) in pairs.items()},
        "goals": {n: g for n, (_, g) in pairs.items()},
    }
    print(f"actor step, {G} prompts x {K} responses (~{opts.resp_len} tokens), {opts.rounds} interleaved rounds, "
          f"{opts.clock} time:")
    for n in times:
        print(f"  {n:18s} best {result['min_seconds'][n] * 1000:8.1f} ms   median {result['median_seconds'][n] * 1000:8.1f} ms")
    for n, r in ratio.items():
        base, goal = pairs[n]
        print(f"  {n} / {base} = {r:.3f} best-of-rounds, {ratio_median[n]:.3f} median of round ratios "
              f"(goal <= {goal:.2f}: {'met' if r <= goal else 'NOT met'})")
    if opts.json:
        tmp = opts.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, opts.json)
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
