"""The CPU rollout engine's HF backend against HF transformers computed independently."""

from types import SimpleNamespace

import pytest
import torch

from openrlhf_lpo.engines.cpu_engine import BACKENDS, HFBackend


def sp(**kw):
    base = dict(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=8, min_tokens=0, logprobs=None)
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    return HFBackend(tiny_model_dir, seed=0, dtype=torch.float32)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64, attn_implementation="eager")
    return model.eval()


def ref_log_probs(model, ids, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double() / temperature
    lp = torch.log_softmax(logits[:-1], -1)
    return lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


IDS = [5, 17, 30, 8, 44, 9, 61, 12, 70, 33, 4, 21]


def test_backends_registered():
    assert set(BACKENDS) >= {"hf", "vllm"}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_match_float64_reference(backend, reference, temperature):
    got = torch.tensor(backend.log_probs_of(IDS, temperature), dtype=torch.float64)
    want = ref_log_probs(reference, IDS, temperature)
    assert got.shape == want.shape == (len(IDS) - 1,)
    assert (got - want).abs().max() < 2e-5


def test_update_weights_changes_the_model_exactly(tiny_model_dir, reference):
    from transformers import AutoModelForCausalLM

    eng = HFBackend(tiny_model_dir, seed=0, dtype=torch.float32)
    before = torch.tensor(eng.log_probs_of(IDS))
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    state = {n: p.detach().clone() for n, p in other.named_parameters()}
    eng.update_weights(state)
    after = torch.tensor(eng.log_probs_of(IDS), dtype=torch.float64)
    want = ref_log_probs(other.double(), IDS)
    assert (after - want).abs().max() < 2e-5 and (after - before.double()).abs().max() > 1e-3
    bad = dict(state)
    bad.pop(next(iter(bad)))
    with pytest.raises(ValueError, match="missing"):
        eng.update_weights(bad)


def test_greedy_matches_hf_generate(backend, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = IDS[:6]
    out = backend.generate(prompt, sp(temperature=0.0, max_tokens=10))
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
    toks = out.outputs[0].token_ids
    assert toks == ref[: len(toks)]
    assert (out.outputs[0].finish_reason == "length") == (len(toks) == 10)


def test_stop_min_tokens_and_logprobs(tiny_model_dir):
    eng = HFBackend(tiny_model_dir, seed=0, dtype=torch.float32)
    first = eng.generate(IDS[:6], sp(temperature=0.0, max_tokens=1)).outputs[0].token_ids[0]
    eng.stop_ids = {first}
    out = eng.generate(IDS[:6], sp(temperature=0.0, max_tokens=5)).outputs[0]
    assert out.token_ids == [first] and out.finish_reason == "stop"
    out = eng.generate(IDS[:6], sp(temperature=0.0, max_tokens=5, min_tokens=3)).outputs[0]
    assert first not in out.token_ids[:3]
    # sampled log-probs equal the full-forward log-probs of the same tokens (temperature 1)
    eng.stop_ids = set()
    res = eng.generate(IDS[:6], sp(max_tokens=6, logprobs=1)).outputs[0]
    sampled = [d[t].logprob for d, t in zip(res.logprobs, res.token_ids)]
    full = eng.log_probs_of(IDS[:6] + res.token_ids)[5:]
    assert max(abs(a - b) for a, b in zip(sampled, full)) < 1e-4


def test_sampling_is_seeded_and_top_k_one_is_greedy(tiny_model_dir):
    a = HFBackend(tiny_model_dir, seed=3, dtype=torch.float32)
    b = HFBackend(tiny_model_dir, seed=3, dtype=torch.float32)
    a.stop_ids = b.stop_ids = set()
    ta = [a.generate(IDS[:4], sp(max_tokens=12)).outputs[0].token_ids for _ in range(3)]
    tb = [b.generate(IDS[:4], sp(max_tokens=12)).outputs[0].token_ids for _ in range(3)]
    assert ta == tb and len({tuple(t) for t in ta}) > 1
    greedy = a.generate(IDS[:4], sp(temperature=0.0, max_tokens=6)).outputs[0].token_ids
    assert a.generate(IDS[:4], sp(top_k=1, max_tokens=6)).outputs[0].token_ids == greedy
    assert a.generate(IDS[:4], sp(top_p=1e-6, max_tokens=6)).outputs[0].token_ids == greedy


def test_sampling_params_field_names_match_vllm():
    from vllm import SamplingParams

    p = SamplingParams(temperature=0.5, top_p=0.9, top_k=-1, max_tokens=3, min_tokens=1, logprobs=1)
    for name in ("temperature", "top_p", "top_k", "max_tokens", "min_tokens", "logprobs"):
        assert hasattr(p, name)
