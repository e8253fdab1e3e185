"""The Megatron Ray actor's sleep and checkpoint mixins around a bare :class:`~openrlhf_lpo.megatron.actor.MegatronActor`,
without Ray: what ``init_model_from_pretrained`` sets up for them (the actor, its HF config, the checkpoint flags, the
sleep state). The gloo world's offload check and ``gpu_check``'s colocated rows drive the real sleep
(``megatron/sleep.py``) and save (``megatron/actor_checkpoints.py``) through it.
"""

from __future__ import annotations

from types import SimpleNamespace

from openrlhf_lpo.megatron.actor_checkpoints import CheckpointMixin
from openrlhf_lpo.megatron.sleep import SleepMixin


class SleepingActor(SleepMixin, CheckpointMixin):
    """``actor`` (a MegatronActor), ``hf_config``; checkpoints under ``ckpt_path`` (``--ckpt.path``), no HF export."""

    def __init__(self, actor, hf_config, ckpt_path: str):
        self.actor, self.hf_config = actor, hf_config
        self.args = SimpleNamespace(ckpt=SimpleNamespace(path=str(ckpt_path), max_num=None, max_mem=None, save_hf=False))
        self._weights_off = self._state_off = None
        self.sleep_log = []

    def checkpoint_files(self, tag: str = "global_step1") -> dict:
        """{(file, tensor name): tensor} of the safetensors files of checkpoint ``tag`` under ``--ckpt.path``."""
        import os

        from safetensors.torch import load_file

        from openrlhf_lpo.megatron.actor_checkpoints import CKPT_SUBDIR

        d = os.path.join(self.args.ckpt.path, CKPT_SUBDIR, tag)
        return {(f, k): v for f in sorted(os.listdir(d)) if f.endswith(".safetensors")
                for k, v in load_file(os.path.join(d, f)).items()}
