"""The dp=2 listwise-metrics job, run by each rank of the gradient matrix's gloo world after its table
(lpo_dp_worker.py; the world costs no second start): ``run(rank, world, model_dir, out)``.

Stock GRPO (group_norm) with --lpo.end_kl through the real LPOActorTrainer on OpenRLHF's chunk
of the rollout batch; the stock split (6 samples per experience, K=4) puts group 1 on both
ranks. Each rank writes its status, the gids it held and rank 0 also the brute-force reference
(json, atomically) to OUT.RANK.
"""

import copy
import json
import os

import torch


def run(rank: int, world: int, model_dir: str, out: str) -> None:
    """Inside an initialised gloo world of ``world`` ranks: this rank's status (and rank 0's reference) to OUT.RANK."""
    from lpo_fixtures import (CPUStrategy, cpu_cuda_queries, make_actor, make_experiences, make_rollout_samples,
                              make_trainer, parse_args, rank_chunk)
    from lpo_references import reference_listwise_stats
    from openrlhf_lpo.openrlhf.actor_trainer import LPOActorTrainer

    K, G = 4, 3
    args = parse_args(model_dir, estimator="group_norm", K=K, G=G, micro=2, train_batch=G * K, dp=world,
                      extra=["--rollout.micro_batch_size", "6", "--lpo.end_kl"])
    actor = make_actor(model_dir)
    exps = make_experiences(args, CPUStrategy(args), actor, make_rollout_samples(G, K, seed=11), noise=0.1)
    strategy = CPUStrategy(args)
    trainer = make_trainer(LPOActorTrainer, args, strategy, actor, lr=2.0)
    mine = rank_chunk(exps, rank, world)
    for e in mine:
        trainer.replay_buffer.append(copy.deepcopy(e))
    torch.manual_seed(5)
    with cpu_cuda_queries():
        status = trainer.ppo_train(0.0)
    result = {
        "status": {k: float(v) for k, v in status.items() if isinstance(v, (int, float))},
        "gids": [int(i) // K for e in mine for i in e.index],
        "steps": len(strategy.step_grads),
    }
    if rank == 0:
        result["ref"] = reference_listwise_stats(actor, exps, K, "std", args.actor.eps_clip_low_high)
    tmp = f"{out}.{rank}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, f"{out}.{rank}")
