"""Per-request sampling seeds (openrlhf_lpo/openrlhf/request_seeds.py): every sample's seed comes from the
run seed and the prompt/sample position, so which engine serves a prompt does not change its samples.

Real Ray, the real stock dispatch loop (SamplesGenerator._dispatch_prompts_to_vllm with its load
balancer) and real rollout engines behind OpenRLHF's engine interface (the CPU engine: vLLM needs a GPU;
both take the seed from SamplingParams.seed), the stock single-turn executor and a reward file."""

import json
import subprocess
import sys

import pytest

from openrlhf_lpo.openrlhf.request_seeds import prompt_seed, sample_seed

PROBE = r"""
import json, os, sys
from types import SimpleNamespace
from openrlhf_lpo.cpu import mode as cpu
cpu.enable_cpu_mode()
import ray
# the test process's shared cluster (tests/shared_ray.py) when it has one, else a local one
where = {"address": os.environ["RAY_ADDRESS"]} if os.environ.get("RAY_ADDRESS") else \
    {"address": "local", "num_cpus": 2, "num_gpus": 0, "include_dashboard": False}
ray.init(**where, runtime_env=cpu.ray_runtime_env())
from transformers import AutoTokenizer
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse
from openrlhf_lpo.engines.cpu_engine import create_cpu_engines
from openrlhf_lpo.openrlhf.request_seeds import SeededSamplesGenerator

model, reward = sys.argv[1], sys.argv[2]
args = build_parser_and_parse(["--actor.model_name_or_path", model, "--reward.remote_url", reward,
                               "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "2",
                               "--train.seed", "7"])
tok = AutoTokenizer.from_pretrained(model)
two = create_cpu_engines(2, 1, model, seed=7, remote_rm_url=reward)
engines = {1: two[:1], 2: two}
prompts, labels = [f"Say something {i}:" for i in range(4)], ["x"] * 4
kw = dict(temperature=1.0, top_p=1.0, max_new_tokens=6, min_new_tokens=1, max_len=256, n_samples_per_prompt=2)

def generator(cls, n):
    return cls(strategy=SimpleNamespace(args=args), prompts_dataloader=None, eval_dataloader=None, tokenizer=tok,
               vllm_engines=engines[n])

def dispatch(gen):
    return [[o["observation_tokens"] for o in ray.get(ref)] for ref in gen._dispatch_prompts_to_vllm(prompts, labels, **kw)]

out = {}
for n in (1, 2):
    gen = generator(SeededSamplesGenerator, n)
    out[f"seeded{n}"], out[f"seeded{n}_next"] = dispatch(gen), dispatch(gen)
out["engine_info"] = [ray.get(e.backend_info.remote()) for e in two]
for n in (1, 2):
    out[f"stock{n}"] = dispatch(generator(SamplesGenerator, n))
resumed = generator(SeededSamplesGenerator, 2)
resumed.prompts_dispatched = 4  # a resume restores total_consumed_prompts
out["resumed"] = dispatch(resumed)
# dynamic sampling: groups of constant fractional scores (labels const:x) are dropped and replaced under DAPO's
# criterion (openrlhf/dynamic_filter.py); upstream's mean-in-(0, 1) test keeps them
rows = [(f"Say something {i}:", lab) for i, lab in enumerate(["const:0.5", "x", "const:0.25", "x", "x", "x"])]
for name, cls in (("dapo", SeededSamplesGenerator), ("stock_filter", SamplesGenerator)):
    it = iter([(None, [p], [lab], [None]) for p, lab in rows])
    exps, consumed, exhausted = generator(cls, 2)._generate_vllm(it, 4, True, **kw)
    out[name] = {"scores": [[float(e.scores.reshape(-1)[0]) for e in exps[i:i + 2]] for i in range(0, len(exps), 2)],
                 "consumed": consumed, "exhausted": exhausted}
print(json.dumps(out))
"""


@pytest.mark.e2e
def test_samples_depend_on_their_position_not_on_the_engine(tiny_model_dir, repo_env, tmp_path):
    from e2e_common import TOY_REWARD

    from shared_ray import shared_ray_env

    out = subprocess.run([sys.executable, "-c", PROBE, tiny_model_dir, str(TOY_REWARD)],
                         env=dict(repo_env, **shared_ray_env()), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    assert all(len(group) == 2 for group in r["seeded1"])  # one list of K per prompt, as the stock caller expects
    # one engine or two (the balancer sends prompts 1 and 3 to the second): the same samples
    assert r["seeded1"] == r["seeded2"] and r["seeded1_next"] == r["seeded2_next"]
    assert sum(len({tuple(s) for s in group}) > 1 for group in r["seeded1"]) >= 3  # K different seeds per prompt
    assert r["seeded1_next"] != r["seeded1"]  # the next batch of the same prompts: new positions, new samples
    assert r["resumed"] == r["seeded2_next"]  # restored position: the uninterrupted run's samples
    # one call per prompt with its K settings (no per-sample call, no gathering task), plain settings: the HF
    # engine never imports vLLM; an engine unpickles a generator's tokenizer once, however many calls arrive
    # meanwhile (engine 0 served two generators)
    info = r["engine_info"]
    assert [i["calls"] for i in info] == [12, 4]  # 3 batches x 4 prompts on engine 0, 2 x 2 on engine 1
    assert [i["vllm_imported"] for i in info] == [False, False] and [i["tokenizers"] for i in info] == [2, 1]
    # upstream (no seed in SamplingParams): the samples depend on the engine (seeded --train.seed + i) and on
    # what it generated before
    assert r["stock1"] != r["stock2"]
    # DAPO's dynamic sampling: the two constant-score groups (0.5, 0.25: mean inside (0, 1), zero variance) are
    # dropped and each replaced by one new prompt; upstream's mean test keeps them
    dapo, stock = r["dapo"], r["stock_filter"]
    assert [0.5, 0.5] in stock["scores"] and [0.25, 0.25] in stock["scores"], stock
    assert dapo["scores"] and all(max(g) > min(g) for g in dapo["scores"]), dapo
    assert dapo["consumed"] == 6, dapo  # at least two dropped: the two remaining prompts were drawn


def test_seeds_are_a_fixed_function_of_run_seed_and_position():
    seeds = {prompt_seed(7, "train", p) for p in range(1000)} | {prompt_seed(8, "train", 0), prompt_seed(7, "eval", 0, 0)}
    assert len(seeds) == 1002 and all(0 <= s < 2 ** 63 for s in seeds)
    assert prompt_seed(7, "train", 3) == prompt_seed(7, "train", 3)
    assert len({sample_seed(prompt_seed(7, "train", 0), k) for k in range(64)}) == 64


def test_plain_settings_carry_the_dispatch_settings_without_vllm():
    """The CPU engine's settings: the stock dispatch's SamplingParams round-trip through the plain form, which
    unpickles in a process that has not imported vLLM; a setting that is not a builtin is refused, not dropped."""
    import pickle

    from vllm import SamplingParams

    from openrlhf_lpo.engines.responses import PlainSamplingParams

    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, max_tokens=None, min_tokens=1,
                        skip_special_tokens=False, logprobs=1, seed=12345)
    plain = PlainSamplingParams.from_vllm(sp)
    assert plain.to_vllm() == sp and plain.max_tokens is None and plain.stop == [] and plain.n == 1
    probe = ("import pickle, sys; p = pickle.loads(sys.stdin.buffer.read()); "
             "print('vllm' in sys.modules, p.temperature, p.seed, p.max_tokens, p.repetition_penalty)")
    out = subprocess.run([sys.executable, "-c", probe], input=pickle.dumps(plain), capture_output=True, timeout=120)
    assert out.stdout.decode().split() == ["False", "0.7", "12345", "None", "1.0"], out.stderr[-2000:]
    from vllm.sampling_params import StructuredOutputsParams

    with pytest.raises(ValueError, match="structured_outputs"):
        PlainSamplingParams.from_vllm(SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")))


def test_vllm_engines_get_per_sample_settings_and_other_engines_stay():
    """lpo-train's swap: vLLM's stock RolloutRayActor becomes a subclass whose generate_responses takes one
    setting per sample (vLLM objects, not plain ones); any other engine class (the CPU mode's) stays; an engine
    without the method is refused by name."""
    from openrlhf.trainer.ray import vllm_engine

    from openrlhf_lpo.engines.cpu_engine import CPURolloutActorClass
    from openrlhf_lpo.engines.responses import PerSampleResponses
    from openrlhf_lpo.openrlhf.request_seeds import engine_settings, seeded_rollout_actor

    stock = vllm_engine.RolloutRayActor
    seeded = seeded_rollout_actor(stock).__ray_actor_class__
    assert issubclass(seeded, stock.__ray_actor_class__)
    assert seeded.generate_responses is PerSampleResponses.generate_responses and seeded.PLAIN_PARAMS is False
    cpu_class = CPURolloutActorClass()
    assert seeded_rollout_actor(cpu_class) is cpu_class
    with pytest.raises(RuntimeError, match="one sampling setting per prompt"):
        engine_settings(object())
