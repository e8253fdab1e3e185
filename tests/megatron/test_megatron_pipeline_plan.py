"""Pipeline bubbles of the Megatron actor (cluster review 2, N3 / N5): the efficiency of a schedule against
a slot-by-slot simulation of 1F1B, the dry run's lines and warnings, and the virtual-pipeline padding
factor against the real packing of ``MegatronActor._micro_batches`` on long-tail lengths (no process group)."""

import pytest
import torch

from openrlhf_lpo.megatron.pipeline_plan import (packed_row_tokens, pipeline_efficiency, vpp_padded_tokens,
                                                 vpp_padding_factor)


def _simulate_1f1b(M: int, pp: int, fwd: int = 1, bwd: int = 2, forward_only: bool = False) -> int:
    """Makespan of megatron's non-interleaved schedule: stage s runs min(pp-s-1, M) warm-up forwards, then
    one forward / one backward alternately, then the remaining backwards (forward-only: the M forwards).
    Each op starts when its stage is free and its input arrived (F(s,m) after F(s-1,m); B(s,m) after
    B(s+1,m) and F(s,m))."""
    order = []
    for s in range(pp):
        if forward_only:
            order.append([("F", m) for m in range(M)])
            continue
        warm = min(pp - s - 1, M)
        ops = [("F", m) for m in range(warm)]
        f, b = warm, 0
        while f < M:
            ops += [("F", f), ("B", b)]
            f, b = f + 1, b + 1
        ops += [("B", m) for m in range(b, M)]
        order.append(ops)
    done, free, pos = {}, [0] * pp, [0] * pp
    while any(pos[s] < len(order[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            if pos[s] == len(order[s]):
                continue
            kind, m = order[s][pos[s]]
            deps = [("F", s - 1, m)] if kind == "F" and s > 0 else []
            if kind == "B":
                deps = [("F", s, m)] + ([("B", s + 1, m)] if s < pp - 1 else [])
            if all(d in done for d in deps):
                start = max([free[s]] + [done[d] for d in deps])
                free[s] = done[(kind, s, m)] = start + (fwd if kind == "F" else bwd)
                pos[s] += 1
                progressed = True
        assert progressed, "the simulated schedule deadlocked"
    return max(free)


@pytest.mark.parametrize("M,pp", [(2, 2), (2, 4), (8, 2), (16, 4), (1024, 4), (3, 8), (1, 2)])
def test_efficiency_is_the_simulated_busy_fraction(M, pp):
    """M/(M+pp-1) equals busy time / makespan of a simulated 1F1B (backward twice a forward) and of a
    forward-only schedule; with vpp the closed form is 1/(1 + (pp-1)/(vpp M)) when pp divides M."""
    for forward_only, per_mb in ((False, 3), (True, 1)):
        span = _simulate_1f1b(M, pp, forward_only=forward_only)
        assert pipeline_efficiency(M, pp) == pytest.approx(M * per_mb / span, rel=1e-12), (M, pp, forward_only)
    assert pipeline_efficiency(2, 2) == pytest.approx(2 / 3) and pipeline_efficiency(2, 4) == pytest.approx(0.4)
    if M % pp == 0:
        assert pipeline_efficiency(M, pp, vpp=2) == pytest.approx(1 / (1 + (pp - 1) / (2 * M)))
    # interleaving pads the count to a multiple of pp: 3 micro-batches at PP2 run as 4
    assert pipeline_efficiency(3, 2, vpp=2) == pytest.approx(3 / (4 + 0.5))
    with pytest.raises(ValueError, match=">= 1"):
        pipeline_efficiency(0, 2)


# ----------------------------------------------------------------------------- the dry run


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    from openrlhf_lpo.testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("pp") / "q3", arch="qwen3", hidden_size=64, num_layers=4,
                            num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)


def _args(model, *extra):
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse

    return build_parser_and_parse([
        "--actor.model_name_or_path", model, "--reward.remote_url", "http://127.0.0.1:1/reward",
        "--data.prompt_dataset", "unused", "--actor.num_gpus_per_node", "2", "--backend", "megatron",
        "--rollout.n_samples_per_prompt", "2", "--algo.advantage.estimator", "group_norm",
        "--train.batch_size", "64", "--rollout.batch_size", "32", "--train.micro_batch_size", "1",
        "--rollout.micro_batch_size", "2", "--actor.lr_scheduler", "constant", "--actor.lr_warmup_ratio", "0",
        *extra])


def test_dry_run_prints_each_pass_and_warns_below_80_percent(tiny4):
    from openrlhf_lpo.cli.plan import plan_lines

    lines = plan_lines(_args(tiny4, "--megatron.pp", "2"))
    text = "\n".join(lines)
    assert "pipeline efficiency per schedule (PP 2, M/(M+pp-1)):" in text
    assert "  old-log-prob forward: 2 micro-batch(es) -> 66.7% (" in text  # 2/3
    assert "  training (each train_step window; a pre-pass runs the same micro-batches): 64 micro-batch(es) -> " \
           f"{64 / 65:.1%} (" in text
    warn = [x for x in lines if x.startswith("  WARNING:")]
    assert len(warn) == 1 and "old-log-prob forward: pipeline efficiency 66.7% < 80%" in warn[0]
    assert "--rollout.micro_batch_size to >= 4 x pp x --train.micro_batch_size = 8" in warn[0]
    fixed = "\n".join(plan_lines(_args(tiny4, "--megatron.pp", "2", "--rollout.micro_batch_size", "8")))
    assert "old-log-prob forward: 8 micro-batch(es) -> 88.9%" in fixed and "WARNING" not in fixed
    assert "pipeline efficiency" not in "\n".join(plan_lines(_args(tiny4)))  # PP 1: nothing to say


def test_dry_run_under_token_budgets(tiny4):
    """--train.dynamic_batch_enable: a full old-log-prob chunk of 2048 tokens cut under 1024 is about 2
    micro-batches (warned, naming the rollout budget); a window of 64 samples of <= 512 tokens about 32."""
    from openrlhf_lpo.cli.plan import plan_lines

    lines = plan_lines(_args(tiny4, "--megatron.pp", "2", "--train.dynamic_batch_enable", "--vllm.num_engines", "1",
                             "--data.max_len", "512",
                             "--rollout.max_new_tokens", "256", "--train.max_tokens_per_gpu", "1024",
                             "--rollout.max_tokens_per_gpu", "2048"))
    text = "\n".join(lines)
    assert "old-log-prob forward: about 2 micro-batch(es) -> 66.7%" in text
    assert f"a pre-pass runs the same micro-batches): about 32 micro-batch(es) -> {32 / 33:.1%}" in text
    warn = [x for x in lines if x.startswith("  WARNING:")]
    assert len(warn) == 1 and "raise --rollout.max_tokens_per_gpu to >= 8 x --train.max_tokens_per_gpu" in warn[0]


def test_dry_run_warns_about_vpp_with_micro_batch_1(tiny4):
    from openrlhf_lpo.cli.plan import plan_lines

    lines = plan_lines(_args(tiny4, "--megatron.pp", "2", "--megatron.vpp", "2", "--rollout.micro_batch_size", "8"))
    text = "\n".join(lines)
    assert "interleaved 1F1B, bubble (pp-1)/(vpp*M), vpp 2" in text
    assert f"old-log-prob forward: 8 micro-batch(es) -> {8 / 8.5:.1%}" in text
    warn = [x for x in lines if "--megatron.vpp 2 with --train.micro_batch_size 1" in x]
    assert len(warn) == 1 and "padded to the pass's longest sequence" in warn[0]
    assert f"removes is {1 / 64 - 1 / 128:.2%} of a window of 64" in warn[0]
    assert "--megatron.vpp 2 with" not in "\n".join(
        plan_lines(_args(tiny4, "--megatron.pp", "2", "--megatron.vpp", "2", "--train.micro_batch_size", "2",
                         "--rollout.micro_batch_size", "16")))


# ----------------------------------------------------------------------------- VPP padding, real packing

# long-tail response lengths (tokens of prompt + response): most short, a few near the 5120 limit
LONG_TAIL = [5120, 310, 260, 820, 1210, 275, 4090, 330, 298, 512, 365, 280, 2300]


def _actor(pp, vpp, micro, tp=1, sp=False):
    """A MegatronActor without a model or process group: enough for its host-side packing."""
    from openrlhf_lpo.megatron.actor import MegatronActor, MegatronActorConfig

    actor = MegatronActor.__new__(MegatronActor)
    actor.cfg = MegatronActorConfig(tp=tp, pp=pp, vpp=vpp, micro_batch_size=micro, sequence_parallel=sp)
    actor.attention_span = None
    actor.model = torch.nn.Linear(1, 1)  # the device the rows go to: the CPU
    return actor


def _batch(lengths):
    S = max(lengths)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(3, 100, (len(lengths), S), generator=g)
    am = (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]).long()
    return {"sequences": seq * am, "attention_mask": am, "action_mask": torch.ones(len(lengths), S - 1, dtype=torch.bool)}


def test_vpp_padding_factor_is_what_the_real_packing_computes(capsys):
    """PP2 x VPP2, micro-batch 1, 13 long-tail rows: the actor pads every row (and the 14th, loss-free row
    the schedule needs) to 5120 tokens: 14 x 5120 = 71680 computed for 16170 real, max/mean x 14/13 = 4.43."""
    batch = _batch(LONG_TAIL)
    actor = _actor(pp=2, vpp=2, micro=1)
    rows = actor._micro_batches(batch, actor.fixed_micro_batches(len(LONG_TAIL)))
    computed = sum(mb["packed"].num_tokens for mb in rows)
    real = sum(LONG_TAIL)
    assert real == 16170 and len(rows) == 14 and computed == 71680  # hand count
    hand = 71680 / 16170
    assert vpp_padded_tokens(packed_row_tokens(LONG_TAIL, 1), pp=2) == computed
    assert vpp_padding_factor(packed_row_tokens(LONG_TAIL, 1), pp=2) == pytest.approx(hand, rel=1e-12)
    assert actor.vpp_padding == pytest.approx(hand, rel=1e-12)
    assert "computes 4.43x its real tokens" in capsys.readouterr().err
    # an even count: exactly max / mean of the lengths
    even = LONG_TAIL[:12]
    assert vpp_padding_factor(packed_row_tokens(even, 1), pp=2) == pytest.approx(max(even) / (sum(even) / 12))
    # VPP 1: no padding, the rows hold their real tokens
    plain = _actor(pp=2, vpp=1, micro=1)
    assert sum(mb["packed"].num_tokens for mb in plain._micro_batches(batch, plain.fixed_micro_batches(13))) == real


def test_packed_row_tokens_follow_the_real_packing_with_sp_and_larger_micro_batches():
    """Micro-batch 3, TP2 with sequence parallelism (each sequence rounded up to even length): the rows the
    actor packs hold packed_row_tokens tokens, and VPP pads them all to the longest."""
    lengths = [5119, 311, 260, 821, 1210, 275, 4090, 331, 298, 513]
    batch = _batch(lengths)
    plain = _actor(pp=2, vpp=1, micro=3, tp=2, sp=True)
    got = [mb["packed"].num_tokens for mb in plain._micro_batches(batch, plain.fixed_micro_batches(10))]
    hand = [5120 + 312 + 260, 822 + 1210 + 276, 4090 + 332 + 298, 514]
    assert got == hand == packed_row_tokens(lengths, 3, pad_multiple=2)
    vpp = _actor(pp=2, vpp=2, micro=3, tp=2, sp=True)
    rows = vpp._micro_batches(batch, vpp.fixed_micro_batches(10))
    assert [mb["packed"].num_tokens for mb in rows] == [max(hand)] * 4
    assert vpp.vpp_padding == pytest.approx(4 * max(hand) / sum(hand)) == vpp_padding_factor(hand, pp=2)
