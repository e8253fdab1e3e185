"""lpo-train flags shared by the Megatron flag and dry-run tests."""


def flag_argv(model_dir, *extra):
    """lpo-train flags of a small GRPO run on 4 GPUs (``extra`` last: it overrides)."""
    return ["--actor.model_name_or_path", str(model_dir), "--reward.remote_url", "http://127.0.0.1:1/reward",
            "--data.prompt_dataset", "unused", "--actor.num_gpus_per_node", "4",
            "--rollout.n_samples_per_prompt", "2", "--algo.advantage.estimator", "group_norm",
            "--train.batch_size", "8", "--rollout.batch_size", "4", "--train.micro_batch_size", "2",
            "--actor.lr_scheduler", "constant", "--actor.lr_warmup_ratio", "0", *extra]
