"""The CPU demo (``lpo-demo``): a tiny offline Qwen3 warmed up on a verifiable toy task, then LPO-fwd
vs the matched GRPO baseline through the ``lpo-train`` pipeline, with metrics, a plot and a summary.

Modules: ``task`` (toy tasks + reward), ``reward_func`` (OpenRLHF ``--reward.remote_url`` file),
``warmup`` (cached supervised warm-up), ``methods`` / ``presets`` (registries), ``pipeline`` (one
``lpo-train`` job per method), ``loop`` (in-process loop for the benchmark and debugging),
``report`` (jsonl, PNG, summary), ``cli`` (the ``lpo-demo`` command). See docs/demo.md.
"""
