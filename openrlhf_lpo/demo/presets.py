"""Named demo presets: a warm-up, an RL configuration, the methods to compare and the backend.

``cpu-demo`` is the README's first command (2 CPU cores, well under 15 minutes with warm-up);
``ci`` is the shortened version a test runs (a few warm-up steps, 2 RL steps per method).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, Tuple

from openrlhf_lpo.demo.loop import RLConfig
from openrlhf_lpo.demo.warmup import WarmupConfig


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    warmup: WarmupConfig
    rl: RLConfig
    methods: Tuple[str, ...] = ("lpo-fwd", "grpo")
    backend: str = "pipeline"


PRESETS: Dict[str, Preset] = {}


def register_preset(p: Preset) -> Preset:
    if p.name in PRESETS:
        raise ValueError(f"preset {p.name!r} is already registered")
    PRESETS[p.name] = p
    return p


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"--preset {name!r} is unknown; choose one of {sorted(PRESETS)}") from None


register_preset(Preset(
    name="cpu-demo",
    description="tiny offline Qwen3, 2-digit addition, LPO-fwd vs GRPO through lpo-train on CPU",
    warmup=WarmupConfig(),
    rl=RLConfig(k=8, prompts_per_step=16, steps=40),
))

register_preset(Preset(
    name="ci",
    description="shortened cpu-demo for tests: 20 warm-up steps, 2 RL steps per method",
    warmup=WarmupConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32,
                        intermediate_size=128, batch_size=16, max_steps=20, eval_every=10,
                        eval_prompts=16, target_accuracy=1.0),
    rl=RLConfig(k=4, prompts_per_step=4, steps=2, eval_every=2, eval_prompts=16),
))
