"""Checkpoints and HF exports of the Megatron policy actor (a mixin of ``MegatronPolicyActor``).

``save_checkpoint(tag, client_states)`` writes ``ckpt.path/_actor/<tag>`` (OpenRLHF passes ``global_step<N>``);
``--ckpt.max_num`` / ``--ckpt.max_mem`` prune the oldest; ``--ckpt.save_hf`` also writes ``<tag>_hf``.
"""

from __future__ import annotations

import os

# checkpoints live where OpenRLHF's PPOTrainer looks for the policy's (ckpt.path/_actor)
CKPT_SUBDIR = "_actor"


class CheckpointMixin:
    """Needs ``self.actor``, ``self.args``, ``self.tokenizer``, ``self.checkpoint_states`` and the sleep mixin's
    ``_awake``."""

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        """``ckpt.path/_actor/<tag>`` (OpenRLHF passes ``global_step<N>``); ``--ckpt.max_num`` /
        ``--ckpt.max_mem`` prune the oldest; ``--ckpt.save_hf`` also writes ``<tag>_hf`` (rotated with them)."""
        with self._awake():  # asleep: everything comes back for the save, and goes again after it
            self._save_checkpoint(tag, client_states)

    def _save_checkpoint(self, tag, client_states=None):
        args = self.args
        state = {"client_states": client_states or {}}
        self.actor.save_checkpoint(os.path.join(args.ckpt.path, CKPT_SUBDIR), tag, state,
                                   max_num=getattr(args.ckpt, "max_num", None),
                                   max_mem_gb=getattr(args.ckpt, "max_mem", None))
        if getattr(args.ckpt, "save_hf", False):
            self._save_hf(os.path.join(args.ckpt.path, f"{tag}_hf"))
            import torch.distributed as dist

            from openrlhf_lpo.runtime.hf_exports import rotate_for_args

            if dist.get_rank() == 0:  # the exports follow the state's rotation (--ckpt.max_num / --ckpt.hf_max_num)
                rotate_for_args(args.ckpt, CKPT_SUBDIR, keep=[tag])

    def get_checkpoint_states(self):
        return self.checkpoint_states

    def _save_hf(self, out_dir: str):
        import torch.distributed as dist

        from openrlhf_lpo.megatron.checkpoint import save_barrier

        self.actor.save_hf(out_dir)
        if dist.get_rank() == 0:
            self.tokenizer.save_pretrained(out_dir)
        save_barrier(self.actor.cfg.save_timeout_minutes)  # rank 0 wrote the export

    def save_model(self):
        with self._awake(state=False):
            self._save_hf(self.args.ckpt.output_dir)
