"""Driver-side state of the research-agenda flags (issue 25), owned by the LPO trainers (sync and async).

The trainer is the process that knows the global step and receives every update's logged metrics,
so the divergence schedule and the replay buffer live here and reach the actors through narrow calls:

* ``--lpo.divergence_schedule`` / ``--lpo.divergence_switch_entropy``: before each update the
  schedule's divergence for that global step is sent to every policy rank
  (``LPOPolicyActor.set_lpo_divergence`` -> ``LPOActorTrainer.set_divergence``) when it changes; after
  the update the logged ``response_entropy`` feeds the switch (schedule.py).
* ``--lpo.replay_batches``: the experience maker draws replayed groups from the buffer and adds the
  fresh ones (experience_maker.py, replay.py); its statistics are merged into the step's metrics.
* Checkpoints: the schedule's state (the switch step, the entropy window) goes into OpenRLHF's
  ``client_states`` (saved with the actor's checkpoint, returned by ``get_checkpoint_states`` on
  resume); the replay buffer, too large for client_states (it would be copied to every rank), is
  written by the trainer to ``<ckpt.path>/_lpo_replay/global_step<N>.pt`` (atomically, before the
  actor checkpoint; the newest ``--ckpt.max_num`` kept) and named in client_states. Multi-node runs
  need ``--ckpt.path`` on storage the trainer and the actors share, as OpenRLHF's checkpoints do.

Public names (stable):
    TrainerExtensions(trainer)    .before_step(global_step), .after_step(global_step, status) -> status,
                                  .checkpoint(global_step, client_states) -> client_states,
                                  .fresh_rollout_stats(experiences) -> the stock rollout/* metrics of
                                  the fresh samples only (replayed ones are not new rollouts)
    enabled(args) -> bool         any of the flags above in use
    CLIENT_STATE_KEY = "lpo_research", REPLAY_DIR = "_lpo_replay"
"""

from __future__ import annotations

import glob
import os
import re
from types import SimpleNamespace
from typing import Dict, Optional

import ray

from openrlhf.utils.logging_utils import init_logger

from openrlhf_lpo.openrlhf.replay import ReplayBuffer
from openrlhf_lpo.core.config import LPOConfig
from openrlhf_lpo.core.divergence_schedule import DivergenceSchedule, parse_schedule

__all__ = ["TrainerExtensions", "enabled", "CLIENT_STATE_KEY", "REPLAY_DIR"]

logger = init_logger(__name__)

CLIENT_STATE_KEY = "lpo_research"
REPLAY_DIR = "_lpo_replay"


def enabled(args) -> bool:
    lpo = LPOConfig.from_args(args)
    return bool(lpo.divergence_schedule or lpo.replay_batches)


class TrainerExtensions:
    def __init__(self, trainer):
        self.trainer = trainer
        args = self.args = trainer.args
        lpo = LPOConfig.from_args(args)
        self.schedule: Optional[DivergenceSchedule] = None
        if lpo.divergence_schedule:
            self.schedule = DivergenceSchedule(parse_schedule(lpo.divergence_schedule), lpo.divergence_switch_entropy,
                                               lpo.divergence_switch_window)
        self.replay: Optional[ReplayBuffer] = None
        if lpo.replay_batches:
            self.replay = ReplayBuffer(lpo.replay_batches, int(args.train.seed))
        trainer.experience_maker.replay = self.replay
        self._active: Optional[str] = None
        self._restored = False

    # -- per step
    def before_step(self, global_step: int) -> None:
        if not self._restored:
            self._restore()
            self._restored = True
        if self.schedule is not None:
            divergence = self.schedule.divergence(global_step)
            if divergence != self._active:
                ray.get(self.trainer.actor_model_group.async_run_method(method_name="set_lpo_divergence",
                                                                        divergence=divergence))
                if self._active is not None:
                    logger.info(f"LPO: update {global_step + 1} projects with {divergence} (was {self._active})")
                self._active = divergence
        self.trainer.experience_maker.replay_step = global_step
        self.trainer.experience_maker.last_replay_stats = {}

    def after_step(self, global_step: int, status: Dict) -> Dict:
        if self.schedule is not None:
            if self.schedule.observe(global_step, status.get("response_entropy")):
                logger.info(f"LPO: mean response entropy {self.schedule.running_entropy:.4f} < "
                            f"{self.schedule.switch_entropy} after step {global_step + 1}: from step "
                            f"{global_step + 2} on, the schedule moves to {self.schedule.divergence(global_step + 1)}")
            status.update(self.schedule.metrics(global_step))
        if self.replay is not None:
            status.update(self.trainer.experience_maker.last_replay_stats)
        return status

    def fresh_rollout_stats(self, experiences, stock):
        """The stock ``_compute_rollout_stats`` over the fresh samples only."""
        if self.replay is None:
            return stock(experiences)
        views = []
        for exp in experiences:
            fresh = exp.info["lpo_replayed"].reshape(-1) == 0 if "lpo_replayed" in exp.info else None
            if fresh is None:
                views.append(exp)
                continue
            views.append(SimpleNamespace(info={"reward": exp.info["reward"][fresh]},
                                         response_length=exp.response_length[fresh], truncated=exp.truncated[fresh]))
        return stock(views)

    # -- checkpoints
    def _replay_path(self, global_step: int) -> str:
        return os.path.join(self.args.ckpt.path, REPLAY_DIR, f"global_step{int(global_step)}.pt")

    def checkpoint(self, global_step: int, client_states: Optional[Dict]) -> Dict:
        """Add our state to ``client_states``; on checkpoint steps write the replay buffer first."""
        client_states = dict(client_states or {})
        state = {"schedule": self.schedule.state_dict() if self.schedule is not None else None, "replay_file": None}
        save_steps = self.args.ckpt.save_steps
        if self.replay is not None and save_steps and global_step % save_steps == 0:
            path = self._replay_path(global_step)
            self.replay.save(path)
            state["replay_file"] = os.path.basename(path)
            self._prune()
        client_states[CLIENT_STATE_KEY] = state
        return client_states

    def _prune(self) -> None:
        keep = max(int(getattr(self.args.ckpt, "max_num", 3) or 3), 1)
        files = glob.glob(os.path.join(self.args.ckpt.path, REPLAY_DIR, "global_step*.pt"))
        steps = sorted(files, key=lambda f: int(re.search(r"global_step(\d+)\.pt$", f).group(1)))
        for path in steps[:-keep]:
            os.remove(path)

    def _restore(self) -> None:
        if not (self.args.ckpt.load_enable and (self.schedule is not None or self.replay is not None)):
            return
        states = self.trainer.init_checkpoint_states() or {}
        state = states.get(CLIENT_STATE_KEY)
        if not state:
            if int(states.get("global_step", 0) or 0) > 0:
                logger.warning("LPO: the checkpoint holds no divergence-schedule / replay state (saved without "
                               "these flags?): starting them afresh")
            return
        if self.schedule is not None and state.get("schedule"):
            self.schedule.load_state_dict(state["schedule"])
            logger.info(f"LPO: divergence schedule restored (switched at {self.schedule.switched_at})")
        if self.replay is not None:
            name = state.get("replay_file")
            path = os.path.join(self.args.ckpt.path, REPLAY_DIR, name) if name else None
            if path is None or not os.path.exists(path):
                raise RuntimeError(f"resuming with --lpo.replay_batches: the checkpoint's replay buffer {path or name!r} "
                                   f"is missing (it lives in {os.path.join(self.args.ckpt.path, REPLAY_DIR)}); restore "
                                   "it or resume without --lpo.replay_batches")
            self.replay.load_file(path)
            logger.info(f"LPO: replay buffer restored from {path} ({self.replay.num_groups} groups)")
