"""gloo worker for the dp=2 listwise-metrics test: python listwise_metrics_worker.py RANK WORLD PORT MODEL_DIR OUT.

Stock GRPO (group_norm) with --lpo.end_kl through the real LPOActorTrainer on OpenRLHF's chunk
of the rollout batch; the stock split (6 samples per experience, K=4) puts group 1 on both
ranks. Each rank writes its status, the gids it held and rank 0 also the brute-force reference
(json, atomically) to OUT.RANK.
"""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    rank, world, port, model_dir, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank)
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
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
