"""``lpo-train --backend megatron`` flags: parsed through the real CLI, bad layouts rejected
with a message naming the numbers, and the policy actor group swapped only for megatron."""

import pytest

from openrlhf_lpo.tiny import build_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "q3", arch="qwen3", hidden_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)


def _argv(d, *extra):
    return ["--actor.model_name_or_path", d, "--reward.remote_url", "http://127.0.0.1:1/reward",
            "--data.prompt_dataset", "unused", "--actor.num_gpus_per_node", "4",
            "--rollout.n_samples_per_prompt", "2", "--algo.advantage.estimator", "group_norm",
            "--train.batch_size", "8", "--rollout.batch_size", "4", "--train.micro_batch_size", "2",
            "--actor.lr_scheduler", "constant", "--actor.lr_warmup_ratio", "0", *extra]


def _parse(argv):
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse

    return build_parser_and_parse(argv)


def test_megatron_flags_parse(tiny_dir):
    a = _parse(_argv(tiny_dir, "--backend", "megatron", "--megatron.tp", "2", "--megatron.pp", "2"))
    assert (a.backend, a.megatron.tp, a.megatron.pp, a.megatron.vpp) == ("megatron", 2, 2, 1)
    assert a.megatron.timeout_minutes == 60  # OpenRLHF's DeepSpeed strategy uses 60 minutes too
    assert _parse(_argv(tiny_dir)).backend == "deepspeed"  # default stays DeepSpeed


def test_stock_flags_reach_the_megatron_config(tiny_dir):
    from openrlhf_lpo.megatron.ray_actor import loss_spec_from_args, megatron_config_from_args

    a = _parse(_argv(tiny_dir, "--backend", "megatron", "--actor.gradient_checkpointing_enable",
                     "--actor.eps_clip_low_high", "0.2", "0.28", "--megatron.timeout_minutes", "90"))
    cfg = megatron_config_from_args(a)
    assert cfg.recompute is True and cfg.timeout_minutes == 90
    assert loss_spec_from_args(a, 2).clip_eps == (0.2, 0.28)


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--megatron.pp", "3"], "world size 4"),
        (["--megatron.tp", "4"], "num_key_value_heads=2"),
        (["--megatron.pp", "4"], "num_hidden_layers=2"),
        (["--actor.entropy_coef", "0.01"], "--actor.entropy_coef"),
        (["--train.colocate_all"], "--train.colocate_all is not supported with --backend megatron"),
        (["--algo.advantage.is_correction_level", "token"], "is_correction_level token"),
        (["--megatron.tp", "4", "--actor.num_gpus_per_node", "2", "--actor.num_nodes", "2"],
         "must divide --actor.num_gpus_per_node 2"),
        (["--actor.lr_scheduler", "cosine_with_min_lr"], "--actor.lr_scheduler constant"),
        (["--megatron.timeout_minutes", "0"], "--megatron.timeout_minutes must be >= 1"),
    ],
)
def test_bad_megatron_layouts_exit_2(tiny_dir, capsys, extra, needle):
    with pytest.raises(SystemExit) as e:
        _parse(_argv(tiny_dir, "--backend", "megatron", *extra))
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_policy_group_swap_only_for_policy_actor():
    from types import SimpleNamespace as NS

    from openrlhf.trainer.ray import launcher, ppo_actor

    from openrlhf_lpo.megatron import flags

    seen = {}
    original = launcher.RayActorGroup.__init__

    def fake_init(self, num_nodes, num_gpus_per_node, ray_actor_type, *a, **kw):
        seen[ray_actor_type] = kw.get("duplicate_actors")

    launcher.RayActorGroup.__init__ = fake_init
    try:
        args = NS(megatron=NS(tp=2, pp=2))
        with flags.use_megatron_policy(args) as remote:
            policy = launcher.RayActorGroup(1, 4, ppo_actor.PolicyModelActor, duplicate_actors=1)
            ref = launcher.RayActorGroup(1, 4, launcher.ReferenceModelActor, duplicate_actors=1)
        assert launcher.RayActorGroup.__init__ is fake_init  # restored on exit
    finally:
        launcher.RayActorGroup.__init__ = original
    assert seen[remote] == 4 and seen[launcher.ReferenceModelActor] == 1
    assert ppo_actor.PolicyModelActor not in seen
    from openrlhf_lpo.megatron.ray_actor import MegatronActorGroup

    assert type(policy) is MegatronActorGroup and type(ref) is launcher.RayActorGroup


def test_megatron_group_returns_one_result_per_replica(monkeypatch):
    """4 actors, tp*pp = 2: every actor runs its replica's chunk, one result per replica returns."""
    from types import SimpleNamespace as NS

    from openrlhf.trainer.ray import launcher

    from openrlhf_lpo.megatron.ray_actor import MegatronActorGroup

    calls = []

    def handle(i):
        def remote(method, chunk, start, end):
            calls.append((i, method, list(chunk["x"])))
            return (i, list(chunk["x"]))

        return NS(execute_batch=NS(remote=remote))

    monkeypatch.setattr(launcher.ray, "put", lambda x: x)
    g = MegatronActorGroup.__new__(MegatronActorGroup)
    g._actor_handlers = [handle(i) for i in range(4)]
    g.duplicate_actors = 2
    refs = g.async_run_method_batch("forward", x=[10, 11, 12, 13])
    assert refs == [(0, [10, 11]), (2, [12, 13])]
    assert sorted(c[0] for c in calls) == [0, 1, 2, 3]  # every rank of each replica ran
    assert calls[1] == (1, "forward", [10, 11]) and calls[3] == (3, "forward", [12, 13])


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from openrlhf_lpo.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "qwen2.5-vl")


@pytest.mark.parametrize("images", [False, True])
def test_megatron_refuses_vision_language_models(tiny_dir, tiny_vlm, capsys, images):
    """A Qwen2.5-VL checkpoint, or image data with a text model: exit 2 naming the reason and the way out."""
    extra = ["--data.max_images_per_prompt", "1"] if images else []
    with pytest.raises(SystemExit) as e:
        _parse(_argv(tiny_dir if images else tiny_vlm, "--backend", "megatron", "--megatron.tp", "2", *extra))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "does not support vision-language models" in err and "DeepSpeed backend" in err
    assert _parse(_argv(tiny_vlm)).backend == "deepspeed"  # the same VLM parses on DeepSpeed
