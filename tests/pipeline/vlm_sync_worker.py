"""The CPU mode's weight sync for a VLM, run in its own process: python vlm_sync_worker.py MODEL OUT.

For ``--actor.freeze_visual_encoder`` off and on: an OpenRLHF ``Actor`` (fp32, CPU mode) whose
trainable parameters are moved, a real CPU rollout engine behind Ray, and the product's
``cpu_broadcast_to_engines`` (the ``ActorPPOTrainer.broadcast_to_vllm`` of the CPU mode). Writes
the parity-log records and, independently, the engine's image-probe log-probs before/after the
sync and the actor's, as JSON.
"""

import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn


class EngineLike(nn.Module):  # DeepSpeed's engine: the HF model under .module
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *a, **k):
        return self.module(*a, **k)


def main():
    model_dir, out = sys.argv[1], sys.argv[2]
    os.environ["LPO_CPU_PARITY_LOG"] = out + ".parity.jsonl"
    from openrlhf_lpo.cpu.mode import cpu_broadcast_to_engines, enable_cpu_mode, init_ray

    enable_cpu_mode()
    import ray
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[3], world_size=1, rank=0)
    init_ray(num_cpus=2, num_gpus=1)
    from openrlhf.models import Actor
    from transformers import AutoProcessor

    from openrlhf_lpo.engines.cpu_engine import RemoteCPURolloutEngine
    from openrlhf_lpo.runtime.parity import actor_image_log_probs, image_probe

    processor = AutoProcessor.from_pretrained(model_dir, trust_remote_code=True)
    ids, images, mm = image_probe(processor)
    results = {}
    for freeze in (False, True):
        engine = RemoteCPURolloutEngine.options(num_cpus=1, num_gpus=0).remote(model_dir, backend="hf")
        actor = Actor(model_dir, attn_implementation="sdpa", param_dtype="bf16", freeze_visual_encoder=freeze)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in actor.model.parameters():
                if p.requires_grad:
                    p.add_(0.05 * torch.randn_like(p))
        actor.model = EngineLike(actor.model)
        before = ray.get(engine.log_probs_of.remote(ids, 1.0, images=images))
        trainer = SimpleNamespace(
            strategy=SimpleNamespace(args=SimpleNamespace(ds=SimpleNamespace(zero_stage=2),
                                                          actor=SimpleNamespace(model_name_or_path=model_dir))),
            actor=actor, vllm_engines=[engine], tokenizer=processor.tokenizer)
        cpu_broadcast_to_engines(trainer)
        results[str(freeze)] = {
            "before": before,
            "after": ray.get(engine.log_probs_of.remote(ids, 1.0, images=images)),
            "actor": actor_image_log_probs(actor, ids, mm).tolist(),
            "trainable": sum(p.requires_grad for p in actor.model.module.parameters()),
            "total": sum(1 for _ in actor.model.module.parameters()),
        }
        ray.kill(engine)
    with open(os.environ["LPO_CPU_PARITY_LOG"]) as f:
        results["parity"] = [json.loads(line) for line in f if line.strip()]
    with open(out, "w") as f:
        json.dump(results, f)
    ray.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
