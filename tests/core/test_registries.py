"""The four registries of openrlhf_lpo.listwise (temperature, divergence, projection, PG estimator):
a new entry works end to end (the core functions, lpo-train's flags, lpo-explain, the two-pass
coefficients), a duplicate name is rejected and an unknown name's error lists the valid ones."""

import contextlib

import numpy as np
import pytest
import torch

from openrlhf_lpo import listwise as lw

T = lambda x: torch.tensor(np.asarray(x, dtype=np.float64))  # noqa: E731
R = np.array([[1.0, 0.0, 0.5, 0.0], [0.2, 0.9, 0.9, 0.1], [3.0, 3.0, 3.0, 3.0]])
S = np.random.default_rng(0).normal(scale=0.3, size=R.shape)


@contextlib.contextmanager
def registered(registry, register, name, fn):
    register(name)(fn)
    try:
        yield fn
    finally:
        registry.pop(name, None)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _lpo_argv(*extra):
    return ["--actor.model_name_or_path", "unused", "--reward.remote_url", "http://unused", "--actor.num_gpus_per_node",
            "1", "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "2", "--train.batch_size", "8",
            "--train.micro_batch_size", "4", "--algo.advantage.estimator", "lpo", *extra]


def test_new_temperature_end_to_end(capsys):
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse
    from openrlhf_lpo.cli.explain import main as explain

    def reward_range(rewards):  # tau = max - min (degenerate groups give 0; gibbs_target handles them)
        return rewards.amax(1, keepdim=True) - rewards.amin(1, keepdim=True)

    with registered(lw.TEMPERATURES, lw.register_temperature, "test_range", reward_range):
        tau = lw.group_temperature(T(R), "test_range")
        np.testing.assert_array_equal(tau.numpy()[:, 0], R.max(1) - R.min(1))
        w = lw.gibbs_target(T(R), tau, T(S))
        want = _softmax(R[:2] / (R.max(1) - R.min(1))[:2, None] + S[:2])
        np.testing.assert_allclose(w.numpy()[:2], want, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(w.numpy()[2], _softmax(S[2]), rtol=1e-12)  # equal rewards: softmax(s_t)
        assert lw.parse_temperature("test_range") == "test_range"
        args = build_parser_and_parse(_lpo_argv("--lpo.temperature", "test_range"))
        assert args.lpo.temperature == "test_range"
        explain(["--rewards", "1", "0", "0.5", "0", "--temperature", "test_range"])
        out = capsys.readouterr().out
        assert "temperature='test_range' -> tau=1" in out and "A_k(PG)" not in out  # no paired PG estimator
        with pytest.raises(ValueError, match="temperature 'test_range' is already registered"):
            lw.register_temperature("test_range")(reward_range)
        with pytest.raises(ValueError, match="valid: batch_std, loo, mean, one, pop_std, std, test_range or a positive number"):
            lw.group_temperature(T(R), "median")
    with pytest.raises(SystemExit) as e:  # gone again: the CLI names the flag and the valid modes
        build_parser_and_parse(_lpo_argv("--lpo.temperature", "test_range"))
    assert e.value.code == 2 and "--lpo.temperature: unknown temperature 'test_range'; valid: batch_std, loo, mean, one, pop_std, std" in (
        capsys.readouterr().err)


def test_new_divergence_end_to_end(capsys):
    """Registered before lpo-train builds its parser, a divergence is a --lpo.divergence choice; its
    coefficients (autograd) equal the gradient of the one-pass loss, so the two-pass path is exact."""
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse

    def sq_hellinger(log_p, target):
        return ((log_p.exp().sqrt() - target.sqrt()) ** 2).sum(-1)

    with registered(lw.DIVERGENCES, lw.register_divergence, "test_hellinger", sq_hellinger):
        args = build_parser_and_parse(_lpo_argv("--lpo.divergence", "test_hellinger"))
        assert args.lpo.divergence == "test_hellinger"
        w = lw.gibbs_target(T(R), "std")
        s = T(S).requires_grad_(True)
        lw.listwise_loss(s, w, "test_hellinger").backward()  # mean over the G groups
        c = lw.listwise_coefficients(T(S), w, "test_hellinger")
        torch.testing.assert_close(s.grad * R.shape[0], c, rtol=1e-12, atol=1e-15)
        p = _softmax(S)  # independent: d/ds of sum (sqrt P - sqrt w)^2
        dldp = 1 - np.sqrt(w.numpy() / p)
        np.testing.assert_allclose(c.numpy(), p * (dldp - (p * dldp).sum(-1, keepdims=True)), rtol=1e-10, atol=1e-13)
        with pytest.raises(ValueError, match="divergence 'test_hellinger' is already registered"):
            lw.register_divergence("test_hellinger")(sq_hellinger)
        with pytest.raises(ValueError, match="valid: fwd, hellinger, js, rev, test_hellinger, tv or alpha:<a>"):
            lw.listwise_divergence(T(S), w, "chi2")
    with pytest.raises(SystemExit) as e:  # gone again: the CLI names the flag and the valid names
        build_parser_and_parse(_lpo_argv("--lpo.divergence", "test_hellinger"))
    assert e.value.code == 2 and ("--lpo.divergence: unknown divergence 'test_hellinger'; valid: fwd, hellinger, js, "
                                  "rev, tv or alpha:<a> (any real a)") in capsys.readouterr().err


@pytest.mark.parametrize("projection", ["listwise", "pointwise", "test_l2"])
def test_projection_coefficients_give_the_projection_gradient(projection):
    """The two-pass surrogate's c for every projection (built-in or registered) is d(per-group loss)/ds:
    pointwise gives -w* (not the divergence's P - w*)."""

    def l2(log_ratio, target, divergence):  # a registered projection: squared distance of P to w*
        return ((torch.softmax(log_ratio, -1) - target) ** 2).sum(-1)

    ctx = registered(lw.PROJECTIONS, lw.register_projection, "test_l2", l2) if projection == "test_l2" \
        else contextlib.nullcontext()
    with ctx:
        w = lw.gibbs_target(T(R), "std")
        for div in ("fwd", "rev"):
            s = T(S).requires_grad_(True)
            (lw.listwise_loss(s, w, div, projection) * R.shape[0]).backward()
            c = lw.projection_coefficients(T(S), w, div, projection)
            torch.testing.assert_close(c, s.grad, rtol=1e-12, atol=1e-15)
            assert not c.requires_grad
        if projection == "pointwise":
            np.testing.assert_array_equal(c.numpy(), -w.numpy())
            assert (c - lw.listwise_coefficients(T(S), w, "fwd")).abs().max() > 0.1  # not the divergence's


def test_new_projection_registry_and_cli(capsys):
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse

    def l1(log_ratio, target, divergence):
        return (torch.softmax(log_ratio, -1) - target).abs().sum(-1)

    with registered(lw.PROJECTIONS, lw.register_projection, "test_l1", l1):
        w = lw.gibbs_target(T(R), "one")
        got = lw.listwise_loss(T(S), w, "fwd", "test_l1")
        assert float(got) == pytest.approx(np.abs(_softmax(S) - w.numpy()).sum(-1).mean(), rel=1e-12)
        args = build_parser_and_parse(_lpo_argv("--lpo.projection", "test_l1"))
        assert args.lpo.projection == "test_l1"
        with pytest.raises(ValueError, match="projection 'test_l1' is already registered"):
            lw.register_projection("test_l1")(l1)
        with pytest.raises(ValueError, match="valid: listwise, pointwise, test_l1"):
            lw.listwise_loss(T(S), w, "fwd", "ranked")
        with pytest.raises(ValueError, match="valid: listwise, pointwise, test_l1"):
            lw.projection_coefficients(T(S), w, "fwd", "ranked")
    with pytest.raises(SystemExit) as e:
        build_parser_and_parse(_lpo_argv("--lpo.projection", "test_l1"))
    assert e.value.code == 2 and "invalid choice: 'test_l1'" in capsys.readouterr().err


def test_new_pg_estimator():
    def loo(rewards):  # RLOO: R_k - mean of the others
        k = rewards.shape[1]
        return (rewards - (rewards.sum(1, keepdim=True) - rewards) / (k - 1))

    with registered(lw.PG_ESTIMATORS, lw.register_pg_estimator, "test_rloo", loo):
        k = R.shape[1]
        want = R - (R.sum(1, keepdims=True) - R) / (k - 1)
        np.testing.assert_allclose(lw.pg_advantages(T(R), "test_rloo").numpy(), want, rtol=1e-12, atol=1e-15)
        with pytest.raises(ValueError, match="PG estimator 'test_rloo' is already registered"):
            lw.register_pg_estimator("test_rloo")(loo)
        with pytest.raises(ValueError, match="valid: dr_grpo, grpo, maxrl, reinforce_pp, rloo, test_rloo"):
            lw.pg_advantages(T(R), "ppo")
        with pytest.raises(ValueError, match="rewards"):  # the registry keeps the input checks
            lw.pg_advantages(T(R[:, :1]), "test_rloo")
    with pytest.raises(ValueError, match="unknown PG estimator 'test_rloo'"):
        lw.pg_advantages(T(R), "test_rloo")


def test_registry_helper():
    """openrlhf_lpo.registry, the one rule of every named table: a name once, an unknown name lists the valid ones."""
    from openrlhf_lpo.registry import lookup, register_unique, registrar

    table = {}
    assert register_unique(table, "widget", "b", 1) == 1
    assert registrar(table, "widget", "a")(len) is len  # the decorator form returns what it decorates
    with pytest.raises(ValueError, match="^widget 'a' is already registered$"):
        register_unique(table, "widget", "a", 2)
    with pytest.raises(ValueError, match="^widget 'b' is already registered$"):
        registrar(table, "widget", "b")(print)
    assert table == {"a": len, "b": 1}  # a refused entry changes nothing
    assert lookup(table, "widget", "b") == 1
    with pytest.raises(ValueError, match="^unknown widget 'c'; valid: a, b$"):
        lookup(table, "widget", "c")
    with pytest.raises(ValueError, match="^unknown widget"):
        lookup(table, "widget", ["unhashable"])


def _registries():
    """(table, register an entry under an existing name, that name, the message) for each table on the helper."""
    import importlib

    def mod(name):
        return importlib.import_module(f"openrlhf_lpo.{name}" if not name.startswith("evaluation") else name)

    rf, pre = mod("rewards.reward_func"), mod("cli.preflight")
    task, presets, methods = mod("demo.task"), mod("demo.presets"), mod("demo.methods")
    model, losses, policy = mod("megatron.model"), mod("megatron.losses"), mod("core.policy_loss")
    geo, backends = mod("data.geometry"), mod("engines.backends")
    flags, ckpt = mod("cli.flags"), mod("cli.preflight.checkpoint")
    tb = mod("core.training_backends")
    tb.training_backend("deepspeed")  # (a lookup registers a built-in backend)
    engines, bench, templates = mod("evaluation.engines"), mod("evaluation.benchmark_registry"), mod("evaluation.templates")
    pre.checks()  # imports the modules that register the checks
    mod("evaluation.benchmarks")  # registers the benchmark families
    first = lambda table: next(iter(table))  # noqa: E731
    return [
        (lw.TEMPERATURES, lambda n: lw.register_temperature(n)(len), "std", "temperature"),
        (lw.DIVERGENCE_FAMILIES, lambda n: lw.register_divergence_family(n, float, "")(len), "alpha", "divergence family"),
        (rf.REWARDS, lambda n: rf.register_reward(n)(len), first(rf.REWARDS), "reward task"),
        (rf.LABELS, lambda n: rf.register_label(n)(len), first(rf.LABELS), "label parser of task"),
        (pre.CHECKS, lambda n: pre.register_check(n)(len), first(pre.CHECKS), "preflight check"),
        (task.TASKS, lambda n: task.register_task(task.TASKS[n]), "addition", "task"),
        (presets.PRESETS, lambda n: presets.register_preset(presets.PRESETS[n]), "cpu-demo", "preset"),
        (methods.METHODS, lambda n: methods.register_method(methods.METHODS[n]), "grpo", "method"),
        (model.ARCHITECTURES, lambda n: model.register_architecture(n, model.ArchSpec()), "llama", "architecture"),
        (losses.POLICY_LOSSES, lambda n: losses.register_policy_loss(n)(len), first(losses.POLICY_LOSSES), "policy loss"),
        (policy.POLICY_LOSS_TYPES, lambda n: policy.register_policy_loss_type(n)(len), "cispo", "policy loss type"),
        (geo.KINDS, lambda n: geo.register_kind(n)(len), first(geo.KINDS), "geometry kind"),
        (backends.BACKENDS, lambda n: backends.register_backend(n)(len), first(backends.BACKENDS), "engine backend"),
        (engines.ENGINES, lambda n: engines.register_engine(n)(len), first(engines.ENGINES), "engine"),
        (bench.BENCHMARKS, lambda n: bench.register_benchmark(bench.BENCHMARKS[n]), first(bench.BENCHMARKS),
         "benchmark name"),
        (templates.TEMPLATES, lambda n: templates.register_template(n)(len), "qwen-boxed", "template"),
        (flags.FLAG_GROUPS, lambda n: flags.register_flag_group(flags.FLAG_GROUPS[n]), "lpo", "flag group"),
        (ckpt.RESUME_FORMATS, lambda n: ckpt.register_resume_format(ckpt.RESUME_FORMATS[n]), "deepspeed",
         "resume format of backend"),
        (tb.TRAINING_BACKENDS, lambda n: tb.register_training_backend(tb.TRAINING_BACKENDS[n]), "deepspeed",
         "training backend"),
    ]


def test_every_registry_refuses_a_taken_name():
    """Each table on the helper refuses a second entry under a name it holds, naming its kind, and keeps the first."""
    for table, register, name, kind in _registries():
        before = dict(table)
        with pytest.raises(ValueError, match=f"^{kind} '{name}' is already registered$"):
            register(name)
        assert table == before, kind
    from openrlhf_lpo.megatron.losses import POLICY_LOSSES, get_policy_loss

    with pytest.raises(ValueError, match=f"^unknown policy loss 'nope'; valid: {', '.join(sorted(POLICY_LOSSES))}$"):
        get_policy_loss("nope")


def test_a_benchmark_alias_is_a_taken_name():
    from dataclasses import replace

    from evaluation import benchmark_registry as bench
    from evaluation.benchmarks import BENCHMARKS

    spec = next(s for s in BENCHMARKS.values() if s.aliases)
    aliases = dict(bench._ALIASES)
    for clash in (spec.aliases[0], spec.name):  # a new benchmark whose alias is taken (an alias, a name): nothing added
        with pytest.raises(ValueError, match=f"^benchmark name '{clash}' is already registered$"):
            bench.register_benchmark(replace(spec, name="test-new-bench", aliases=("test-new-alias", clash)))
        assert "test-new-bench" not in BENCHMARKS and bench._ALIASES == aliases
