"""gloo worker for the dp=2 gradient-exactness tests: python lpo_dp_worker.py RANK WORLD PORT MODEL_DIR OUT [vlm].

With ``vlm`` the model is the tiny Qwen2.5-VL and the rollout batch holds images (vlm_harness.py:
its cases, no packing, which OpenRLHF 0.11.2 does not support for VLMs).

Every rank runs the real LPOActorTrainer on its OpenRLHF chunk of the rollout batch; rank 0
writes, per case, the max abs difference between the DP-averaged step gradient and the
window-by-window reference (float64) to OUT (json, written atomically). The text world then runs the
dp=2 listwise-metrics job (listwise_metrics_job.py) to OUT.metrics.RANK.
"""

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
    from lpo_matrix import gradient_matrix

    kwargs = {}
    if len(sys.argv) > 6 and sys.argv[6] == "vlm":
        from vlm_harness import vlm_matrix_kwargs

        kwargs = vlm_matrix_kwargs(model_dir, dp=world)
    table = gradient_matrix(model_dir, dp=world, rank=rank, **kwargs)
    if not kwargs:  # the text world also runs the listwise-metrics job (OUT.metrics.RANK) before the table lands
        from listwise_metrics_job import run as listwise_metrics

        listwise_metrics(rank, world, model_dir, out + ".metrics")
    if rank == 0:
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(table, f, indent=1)
        os.replace(tmp, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
