"""``lpo-train --backend megatron`` flags: parsed through the real CLI, bad layouts rejected
with a message naming the numbers, and the policy actor group swapped only for megatron."""

import re

import pytest

from openrlhf_lpo.testing.tiny import build_tiny_model

from .flag_args import flag_argv

_argv = flag_argv


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
    assert loss_spec_from_args(a).clip_eps == (0.2, 0.28)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_the_kl_flags_reach_the_megatron_loss(tiny_dir, estimator):
    """--algo.kl.estimator / --algo.kl.use_loss / --algo.kl.init_coef as the Ray actor hands them to the loss
    (its loss_spec_from_args, with the KL controller's value); without --algo.kl.use_loss no KL term."""
    from openrlhf_lpo.megatron.ray_actor import loss_spec_from_args

    for est in ("lpo", "group_norm"):
        a = _parse(_argv(tiny_dir, "--backend", "megatron", "--algo.advantage.estimator", est, "--algo.kl.use_loss",
                         "--algo.kl.init_coef", "0.05", "--algo.kl.estimator", estimator))
        spec = loss_spec_from_args(a, kl_ctl=0.05)
        assert (spec.kl_estimator, spec.kl_coef) == (estimator, 0.05), (est, spec)
    off = _parse(_argv(tiny_dir, "--backend", "megatron", "--algo.kl.estimator", estimator))
    assert loss_spec_from_args(off, kl_ctl=0.05).kl_coef == 0.0


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--megatron.pp", "3"], "world size 4"),
        (["--megatron.tp", "4"], "num_key_value_heads=2"),
        (["--megatron.pp", "4"], "num_hidden_layers=2"),
        (["--train.colocate_all", "--vllm.num_engines", "2"], "--train.colocate_all puts one vLLM worker on each "
                                                               "actor GPU: --vllm.num_engines 2 x"),
        (["--megatron.tp", "4", "--actor.num_gpus_per_node", "2", "--actor.num_nodes", "2"],
         "must divide --actor.num_gpus_per_node 2"),
        (["--actor.lr_scheduler", "reduce_lr_on_plateau"], "--actor.lr_scheduler reduce_lr_on_plateau: OpenRLHF's"),
        (["--actor.lr_scheduler", "warmup_stable_decay"], "the DeepSpeed backend fails on it too"),
        (["--megatron.timeout_minutes", "0"], "--megatron.timeout_minutes must be >= 1"),
        (["--megatron.sync_bucket_mb", "0"], "--megatron.sync_bucket_mb must be > 0 and <= 16384 MiB, got 0: the size"),
        (["--megatron.sync_bucket_mb", "nan"], "--megatron.sync_bucket_mb must be > 0 and <= 16384 MiB, got nan"),
    ],
)
def test_bad_megatron_layouts_exit_2(tiny_dir, capsys, extra, needle):
    with pytest.raises(SystemExit) as e:
        _parse(_argv(tiny_dir, "--backend", "megatron", *extra))
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


# Every other refusal of openrlhf_lpo/megatron/flags.py::_validate, through the real CLI: exit status 2
# and a message naming the flag the user gave (the stock parser turns --ds.packing_samples on for
# dynamic batching and ring attention, so those must still be named as given).
@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--ds.ring_attn_size", "2"], "--ds.ring_attn_size > 1 is not supported with --backend megatron: context parallelism"),
        (["--ds.tensor_parallel_size", "2"], "--ds.tensor_parallel_size > 1 is not supported with --backend "
                                             "megatron: DeepSpeed tensor parallelism; use --megatron.tp"),
        (["--ds.enable_sleep"], "--ds.enable_sleep without --train.colocate_all: with --backend megatron it "
                                "offloads the actor"),
        (["--train.enable_ema"], "--train.enable_ema is not supported with --backend megatron: the Megatron actor "
                                 "keeps no EMA copy"),
        (["--ds.lora.rank", "8"], "--ds.lora.rank is not supported with --backend megatron: the Megatron actor "
                                  "trains full weights"),
        (["--actor.aux_loss_coef", "0.1"], "--actor.aux_loss_coef is not supported with --backend megatron: the "
                                           "mixture-of-experts"),
        (["--megatron.vpp", "2"], "--megatron.vpp 2 needs --megatron.pp > 1"),
        (["--train.batch_size", "6"], "--train.batch_size 6 must be divisible by the Megatron data-parallel size 4"),
        (["--train.batch_size", "6", "--megatron.tp", "2", "--actor.num_gpus_per_node", "8"],
         "--train.batch_size 6 must be divisible by the Megatron data-parallel size 4 = 8 / (--megatron.tp 2 x"),
    ],
)
def test_every_megatron_refusal_exits_2_naming_the_flag(tiny_dir, capsys, extra, needle):
    with pytest.raises(SystemExit) as e:
        _parse(_argv(tiny_dir, "--backend", "megatron", "--vllm.num_engines", "1", *extra))
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_virtual_pipeline_stages_reach_the_megatron_config(tmp_path, capsys):
    """4 layers = pp 2 x vpp 2 parses and reaches the actor config (tests/megatron/test_megatron_parallel.py
    runs it); 4 layers do not split into pp 2 x vpp 4."""
    from openrlhf_lpo.megatron.ray_actor import megatron_config_from_args

    four = build_tiny_model(tmp_path / "q3l4", arch="qwen3", hidden_size=64, num_layers=4, num_heads=4,
                            num_kv_heads=2, head_dim=16, intermediate_size=128)
    a = _parse(_argv(four, "--backend", "megatron", "--megatron.pp", "2", "--megatron.vpp", "2"))
    assert megatron_config_from_args(a).vpp == 2
    with pytest.raises(SystemExit) as e:
        _parse(_argv(four, "--backend", "megatron", "--megatron.pp", "2", "--megatron.vpp", "4"))
    assert e.value.code == 2
    assert "num_hidden_layers=4 is not divisible by --megatron.pp 2 x --megatron.vpp 4" in capsys.readouterr().err


def test_unsupported_or_unreadable_models_are_refused(tmp_path, capsys):
    from transformers import GPT2Config

    gpt2 = tmp_path / "gpt2"
    GPT2Config(n_layer=2, n_embd=64, n_head=4).save_pretrained(gpt2)
    with pytest.raises(SystemExit) as e:
        _parse(_argv(str(gpt2), "--backend", "megatron"))
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--backend megatron supports model_type" in err and "'gpt2'" in err
    with pytest.raises(SystemExit) as e:
        _parse(_argv(str(tmp_path / "missing"), "--backend", "megatron"))
    assert e.value.code == 2
    assert "--backend megatron: cannot read the HF config of --actor.model_name_or_path" in capsys.readouterr().err
    # the same model directories are fine for DeepSpeed: the checks belong to the megatron backend only
    assert _parse(_argv(str(gpt2))).backend == "deepspeed"


def test_the_ray_actor_refuses_again_at_start_up():
    """The refusals hold for a namespace that skipped the CLI (checked again before any process group)."""
    from types import SimpleNamespace as NS

    import torch.distributed as dist

    from openrlhf_lpo.megatron.ray_actor import MegatronPolicyActor

    args = NS(train=NS(colocate_all=False), ds=NS(enable_sleep=True), algo=NS(advantage=NS(is_correction_level="token")))
    actor = MegatronPolicyActor()
    before = dist.is_initialized()
    with pytest.raises(ValueError, match=re.escape("--ds.enable_sleep without --train.colocate_all")):
        actor.init_model_from_pretrained(NS(args=args), "unused")
    assert dist.is_initialized() == before and not hasattr(actor, "actor")  # refused before any set-up


@pytest.mark.parametrize("extra", [
    [],  # OpenRLHF's defaults: --actor.lr_scheduler cosine_with_min_lr, --actor.lr_warmup_ratio 0.03
    ["--algo.kl.use_loss", "--algo.kl.init_coef", "0.01", "--algo.kl.estimator", "k3", "--actor.entropy_coef", "0.01"],
    ["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "4096", "--ds.packing_samples"],
    ["--train.async_enable", "--train.partial_rollout_enable", "--algo.advantage.is_correction_level", "token",
     "--algo.advantage.is_correction_mode", "clip", "--algo.advantage.is_correction_threshold", "0.5", "5.0",
     "--vllm.enable_prefix_caching"],
])
def test_deepspeed_recipes_options_parse_on_megatron(tiny_dir, extra):
    """What a DeepSpeed user's recipe passes (the default learning-rate schedule, KL loss, entropy bonus,
    token budgets with packing, async + partial rollout + IS correction) is accepted with --backend megatron."""
    argv = [a for a in _argv(tiny_dir, "--backend", "megatron", "--vllm.num_engines", "1", *extra)]
    if not extra:  # drop the harness's constant schedule: the stock default must parse
        i = argv.index("--actor.lr_scheduler")
        del argv[i:i + 4]
    a = _parse(argv)
    assert a.backend == "megatron"
    if not extra:
        assert (a.actor.lr_scheduler, a.actor.lr_warmup_ratio) == ("cosine_with_min_lr", 0.03)


def test_the_ray_actor_refuses_packed_sequences():
    import torch

    from openrlhf_lpo.megatron.ray_actor import MegatronPolicyActor

    with pytest.raises(ValueError, match="packs each micro-batch itself .* not packed_seq_lens"):
        MegatronPolicyActor().forward(torch.ones(1, 4, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool),
                                      torch.ones(1, 4, dtype=torch.long), packed_seq_lens=[4])


def test_policy_group_swap_only_for_policy_actor(monkeypatch):
    """Patch point megatron-policy-group: inside ``use_megatron_policy`` the stock ``train()``'s name
    ``RayActorGroup`` builds the policy group as a ``MegatronPolicyGroup`` of the Megatron Ray actor with its layout
    in the constructor (tp x pp duplicates; TP blocks node-strict, which the placement reads when upstream's
    ``__init__`` starts the actors) and every other group as upstream's, with upstream's arguments."""
    import importlib
    from types import SimpleNamespace as NS

    from openrlhf.trainer.ray import launcher, ppo_actor

    from openrlhf_lpo.megatron import flags
    from openrlhf_lpo.megatron.actor_group import MegatronPolicyGroup

    stock = importlib.import_module("openrlhf.cli.train_ppo_ray")
    started = {}

    def _initiate_actors(self, pg, num_gpus_per_actor):  # upstream's __init__ calls it last: no actor starts here
        started[self.ray_actor_type] = (type(self), self.duplicate_actors, getattr(self, "node_block", None),
                                        getattr(self, "node_block_strict", False), pg, num_gpus_per_actor)

    monkeypatch.setattr(launcher.RayActorGroup, "_initiate_actors", _initiate_actors)
    with flags.use_megatron_policy(NS(megatron=NS(tp=2, pp=2))) as remote:
        policy = stock.RayActorGroup(1, 4, ppo_actor.PolicyModelActor, pg="pg", num_gpus_per_actor=0.2,
                                     duplicate_actors=1)
        ref = stock.RayActorGroup(1, 4, launcher.ReferenceModelActor, pg="pg", num_gpus_per_actor=0.2,
                                  duplicate_actors=1)
    assert stock.RayActorGroup is launcher.RayActorGroup  # restored on exit
    # the policy's TP groups (not its tp x pp replicas) must each sit on one node, before any actor starts
    assert started[remote] == (MegatronPolicyGroup, 4, 2, True, "pg", 0.2)
    assert started[launcher.ReferenceModelActor] == (launcher.RayActorGroup, 1, None, False, "pg", 0.2)
    assert ppo_actor.PolicyModelActor not in started
    assert type(policy) is MegatronPolicyGroup and type(ref) is launcher.RayActorGroup
    assert not hasattr(launcher.RayActorGroup, "node_block")  # nothing hung on upstream's class


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

    from openrlhf_lpo.megatron import ray_actor

    monkeypatch.setattr(launcher.ray, "put", lambda x: x)
    waited = []
    monkeypatch.setattr(ray_actor, "await_all_refs",  # the real one is a Ray task (tests/megatron/test_megatron_ray_failures.py)
                        lambda refs, picked: waited.append(list(refs)) or [refs[i] for i in picked])
    g = MegatronActorGroup.__new__(MegatronActorGroup)
    g._actor_handlers = [handle(i) for i in range(4)]
    g.duplicate_actors = 2
    refs = g.async_run_method_batch("forward", x=[10, 11, 12, 13])
    assert refs == [(0, [10, 11]), (2, [12, 13])]
    assert [[r[0] for r in w] for w in waited] == [[0, 1], [2, 3]]  # each replica's result waits on both its ranks
    assert sorted(c[0] for c in calls) == [0, 1, 2, 3]  # every rank of each replica ran
    assert calls[1] == (1, "forward", [10, 11]) and calls[3] == (3, "forward", [12, 13])


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from openrlhf_lpo.testing.tiny_vlm import build_tiny_vlm

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


def test_transformer_engine_flag_reaches_the_actor_and_on_needs_it(tiny_dir):
    """--megatron.te: off by default (the local spec every test runs), auto defers to what is importable, on
    stops the actor at start where Transformer Engine is missing (this machine: not installed)."""
    import importlib.util

    from transformers import AutoConfig

    from openrlhf_lpo.megatron.actor import MegatronActor
    from openrlhf_lpo.megatron.ray_actor import megatron_config_from_args

    got = {}
    for choice in (None, "off", "auto", "on"):
        extra = ("--megatron.te", choice) if choice else ()
        got[choice] = megatron_config_from_args(_parse(_argv(tiny_dir, "--backend", "megatron", *extra))).use_te
    assert got == {None: False, "off": False, "auto": None, "on": True}
    assert importlib.util.find_spec("transformer_engine") is None
    cfg = megatron_config_from_args(_parse(_argv(tiny_dir, "--backend", "megatron", "--megatron.te", "on")))
    with pytest.raises(ValueError, match="--megatron.te on: Transformer Engine is not importable"):
        MegatronActor(AutoConfig.from_pretrained(tiny_dir), cfg)
