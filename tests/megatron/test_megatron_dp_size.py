"""Megatron's data-parallel size is world / (tp x pp) wherever LPO uses it (cluster review F9):
flag validation, the ``--dry-run`` plan, the group deal of the experience maker, the partial-batch
drop and the trainer's skip threshold. Real CLI parse and the real LPO experience maker."""

import copy
from types import SimpleNamespace as NS

import pytest

from openrlhf_lpo.core.config import dp_size
from openrlhf_lpo.testing.tiny import build_tiny_model


@pytest.fixture(scope="module")
def tp8_model(tmp_path_factory):
    """Heads that split over TP 8 like Qwen3-8B/14B (8 KV heads)."""
    return build_tiny_model(tmp_path_factory.mktemp("tp8") / "q3", arch="qwen3", hidden_size=64, num_layers=4,
                            num_heads=8, num_kv_heads=8, head_dim=8, intermediate_size=128)


def _argv(model, *extra):
    return ["--actor.model_name_or_path", model, "--reward.remote_url", "http://127.0.0.1:1/reward",
            "--data.prompt_dataset", "unused", "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "8",
            "--vllm.num_engines", "1", "--rollout.n_samples_per_prompt", "8", "--algo.advantage.estimator", "lpo",
            "--train.micro_batch_size", "1", "--algo.kl.init_coef", "0",
            # (the default schedule parses too, test_megatron_flags.py; constant keeps this file about dp)
            "--actor.lr_scheduler", "constant", "--actor.lr_warmup_ratio", "0", *extra]


def _parse(argv):
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse

    return build_parser_and_parse(argv)


def test_dp_size_divides_by_the_model_replica():
    ns = lambda backend, tp, pp: NS(backend=backend, actor=NS(num_nodes=2, num_gpus_per_node=8),  # noqa: E731
                                    megatron=NS(tp=tp, pp=pp), ds=NS(ring_attn_size=1, tensor_parallel_size=1))
    assert dp_size(ns("megatron", 4, 1)) == 4 and dp_size(ns("megatron", 4, 2)) == 2
    assert dp_size(ns("megatron", 8, 2)) == 1
    assert dp_size(ns("deepspeed", 4, 2)) == 16  # --megatron.* do not concern DeepSpeed


def test_tp8_on_8_gpus_accepts_a_batch_of_100_prompts(tp8_model):
    """TP8 on one 8-GPU node is one data-parallel replica: 100 prompts deal to it whole (was refused as
    'not divisible by the actor data-parallel size 8')."""
    a = _parse(_argv(tp8_model, "--backend", "megatron", "--megatron.tp", "8", "--rollout.batch_size", "100",
                     "--train.batch_size", "800"))
    assert dp_size(a) == 1 and a.rollout.batch_size == 100
    # DeepSpeed on the same 8 GPUs has 8 ranks and still refuses it
    with pytest.raises(SystemExit) as e:
        _parse(_argv(tp8_model, "--rollout.batch_size", "100", "--train.batch_size", "800"))
    assert e.value.code == 2


def test_dry_run_of_tp4_x_dp2_says_two_data_parallel_ranks(tp8_model, tmp_path, capsys):
    from openrlhf_lpo.cli.train_ppo_ray import main

    data = tmp_path / "math.jsonl"
    data.write_text("".join('{"prompt": "p", "label": "1"}\n' for _ in range(3 * 16 + 5)))
    argv = _argv(tp8_model, "--backend", "megatron", "--megatron.tp", "4", "--rollout.batch_size", "16",
                 "--train.batch_size", "128", "--data.prompt_dataset", str(data), "--data.input_key", "prompt",
                 "--data.label_key", "label", "--data.max_len", "512", "--rollout.max_new_tokens", "256", "--dry-run")
    main(argv)
    out = capsys.readouterr().out
    assert "data-parallel ranks 2" in out and "megatron actor, TP 4 x PP 1 x DP 2" in out
    assert "data-parallel ranks 8" not in out
    # 53 = 3 x 16 + 5: the last batch drops 1 group (dp - 1 at most), not 5 (world - 1 = 7 at most)
    assert "last batch of each episode: 5 prompts: 2 groups per rank, 1 dropped" in out


class _Tok:
    pad_token_id = 0


def test_partial_batch_drops_at_most_dp_minus_one_groups(tp8_model):
    """The real LPO experience maker at TP4 x DP2 on 8 GPUs: 7 prompt groups train 6 (3 per replica)
    and drop 1; the experiences split into 2 equal runs (one per replica), not 8."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "openrlhf"))
    from lpo_fixtures import make_rollout_samples
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    from openrlhf_lpo.openrlhf.experience_maker import LPOExperienceMaker

    K = 8
    a = _parse(_argv(tp8_model, "--backend", "megatron", "--megatron.tp", "4", "--rollout.batch_size", "8",
                     "--train.batch_size", "64", "--rollout.micro_batch_size", "8"))
    maker = LPOExperienceMaker(None, None, None, None, FixedKLController(0.0), NS(args=a), _Tok())
    maker.args = a
    exps = maker.split_rollout_samples(copy.deepcopy(make_rollout_samples(7, K, seed=3)))
    sizes = [len(e.sequences) for e in exps]
    assert sum(sizes) == 6 * K  # 1 group dropped (dp - 1), not 7 - 7 % 8 = 0 groups trained
    per_replica = len(exps) // 2
    gids = [sorted({int(g) // K for e in exps[r * per_replica:(r + 1) * per_replica] for g in e.index})
            for r in range(2)]
    assert len(exps) % 2 == 0 and [len(g) for g in gids] == [3, 3] and not set(gids[0]) & set(gids[1])


def test_trainer_skips_only_batches_smaller_than_dp(tp8_model):
    """ray_classes' skip threshold: at TP4 x DP2 a batch of 2 groups trains (was skipped: < 8 ranks)."""
    from openrlhf_lpo.openrlhf import ray_classes

    a = _parse(_argv(tp8_model, "--backend", "megatron", "--megatron.tp", "4", "--rollout.batch_size", "8",
                     "--train.batch_size", "64"))
    seen = {}

    class Stock:
        def train_step(self, rollout_samples, global_step):
            seen["trained"] = len(rollout_samples)
            return {}, global_step + 1

    mixin = next(c for c in ray_classes.LPOTrainer.__mro__ if c.__name__ == "_LPOTrainerMixin")
    Trainer = type("T", (mixin, Stock), {})
    t = Trainer.__new__(Trainer)
    t.args = a
    _, step = t.train_step([object()] * (2 * 8), 0)
    assert seen == {"trained": 16} and step == 1
    status, step = t.train_step([object()] * 8, 5)  # 1 group < 2 replicas: skipped
    assert status == {"lpo/skipped_groups": 1.0} and step == 5
