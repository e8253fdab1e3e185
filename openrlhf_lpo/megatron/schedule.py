"""Learning-rate schedules of the Megatron actor, the same as OpenRLHF 0.11.2's DeepSpeed actor.

OpenRLHF builds ``transformers.get_scheduler(--actor.lr_scheduler, num_warmup_steps=ceil(steps *
--actor.lr_warmup_ratio), num_training_steps=steps)`` (``min_lr_rate=--actor.min_lr_ratio`` for the two
cosine-with-min-lr schedules), ``steps`` being the trainer's ``max_steps`` (optimizer steps of the run),
and DeepSpeed steps it once per optimizer step: the i-th step (from 0) runs at
``lr * lambda(i)``. :class:`LRSchedule` builds that scheduler with the same arguments on a one-parameter
proxy optimizer and writes its learning rate into every parameter group of the Megatron optimizer
before each step (megatron-core's groups share ``--actor.adam.lr``), so the sequence is the upstream
one by construction; its state rides in the checkpoint and a resume continues it.

Public names: LRSchedule, check_lr_scheduler(name, warmup_ratio, min_lr_ratio)
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["LRSchedule", "check_lr_scheduler", "MIN_LR_SCHEDULERS"]

# the schedules OpenRLHF hands --actor.min_lr_ratio to (utils/deepspeed/deepspeed.py, _ds_init_train_model)
MIN_LR_SCHEDULERS = ("cosine_with_min_lr", "cosine_warmup_with_min_lr")


def _hf_scheduler(optimizer, name: str, warmup_ratio: float, min_lr_ratio: float, total_steps: int):
    from transformers.trainer import get_scheduler

    kwargs = {"min_lr_rate": min_lr_ratio} if name in MIN_LR_SCHEDULERS else {}
    return get_scheduler(name, optimizer, num_warmup_steps=math.ceil(total_steps * warmup_ratio),
                         num_training_steps=total_steps, scheduler_specific_kwargs=kwargs)


class LRSchedule:
    """``--actor.lr_scheduler`` over ``total_steps`` optimizer steps, applied to a Megatron optimizer."""

    def __init__(self, base_lr: float, name: str = "constant", warmup_ratio: float = 0.0,
                 min_lr_ratio: float = 0.1, total_steps: Optional[int] = None):
        self.name = name
        self._proxy = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=float(base_lr))
        self._sched = _hf_scheduler(self._proxy, name, float(warmup_ratio), float(min_lr_ratio),
                                    max(int(total_steps or 1), 1))

    @property
    def lr(self) -> float:
        """The learning rate of the next optimizer step."""
        return float(self._proxy.param_groups[0]["lr"])

    def apply(self, optimizer) -> float:
        """Set every parameter group of ``optimizer`` (megatron-core's, chained or not) to :attr:`lr`."""
        lr = self.lr
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def step(self) -> None:
        self._proxy.step()  # the proxy has no gradient: a no-op that keeps torch's step order
        self._sched.step()

    def state_dict(self) -> dict:
        return {"name": self.name, "scheduler": self._sched.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"the checkpoint's learning-rate schedule is {state.get('name')!r}, this run's "
                             f"--actor.lr_scheduler is {self.name!r}")
        self._sched.load_state_dict(state["scheduler"])
        # LambdaLR.load_state_dict restores the counters; the proxy's lr follows them
        for group, lr in zip(self._proxy.param_groups, self._sched.get_last_lr()):
            group["lr"] = lr


def check_lr_scheduler(name: str, warmup_ratio: float, min_lr_ratio: float) -> None:
    """Raise ``ValueError`` naming the flag when OpenRLHF's construction of ``name`` (the DeepSpeed
    backend's) cannot build or step it (an unknown name, or a schedule that needs arguments OpenRLHF
    does not pass, such as reduce_lr_on_plateau's metric or warmup_stable_decay's decay steps)."""
    try:
        s = LRSchedule(1.0, name, warmup_ratio, min_lr_ratio, total_steps=10)
        s.step()
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(
            f"--actor.lr_scheduler {name}: OpenRLHF's scheduler construction (transformers.get_scheduler with "
            f"num_warmup_steps and num_training_steps only) cannot run it ({type(e).__name__}: {e}); the DeepSpeed "
            "backend fails on it too. Use cosine_with_min_lr (the default), linear, cosine, constant, ..."
        ) from None


SCHEDULE_KEY = "_lr_schedule"  # where a checkpoint's client_state holds the learning-rate schedule


def with_schedule(client_state, schedule: LRSchedule) -> dict:
    """``client_state`` plus ``schedule``'s state: what a Megatron checkpoint stores."""
    return dict(client_state or {}, **{SCHEDULE_KEY: schedule.state_dict()})


def restore_schedule(client_state: dict, schedule: LRSchedule) -> dict:
    """Restore ``schedule`` from a loaded checkpoint's client_state (a checkpoint without one leaves it at
    step 0); returns the rest of the client_state."""
    state = dict(client_state)
    saved = state.pop(SCHEDULE_KEY, None)
    if saved is not None:
        schedule.load_state_dict(saved)
    return state
