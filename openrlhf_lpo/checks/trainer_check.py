"""The DeepSpeed LPO trainer on the device, against a window-by-window float64 reference.

One ``ppo_train`` of :class:`~openrlhf_lpo.openrlhf.actor_trainer.LPOActorTrainer` with OpenRLHF's
real ``DeepspeedStrategy`` (ZeRO-2 or ZeRO-3, NCCL on a GPU, gloo on a CPU) over a synthetic replay
buffer, on a Qwen3-shaped model (tiny dims, the same architecture). Neither vLLM nor a Ray cluster is
needed: the replay buffer is filled here, as ``PolicyModelActor.fit`` would find it. This is the
``deepspeed_lpo_trainer_zero{2,3}`` row of ``examples/scripts/gpu_check.sh``.

The update: K = 4 responses per prompt, micro-batches of K/2 samples (every micro-batch splits its
groups), two optimizer windows per rollout batch and two epochs, so the four windows take their
coefficients c from the shortcut (s = s_t), then three pre-passes at updated parameters; fp32 and
bf16 (the recipes' dtype) parameters, each stage and dtype a fresh engine (bf16 with a wide token clip,
``BF16_CLIP``: at the recipes' clip, bf16 rounding decides which tokens at the clip edge keep a gradient). DeepSpeed runs SGD (its torch-optimizer path, no momentum, no clipping, constant LR), so each
window's gradient is (theta_before - theta_after) / lr of DeepSpeed's fp32 master weights
(``deepspeed.utils.safe_get_full_fp32_param``, ZeRO-3 partitions gathered).

The reference (:func:`reference_window_gradients`) is written from the paper, not from the trainer:
float64 on the CPU, one sequence at a time, for each window the gradient of
(1/G_w) sum_g KL(w*_g || softmax(s_g)) (Eq. 4 for s, Eq. 8 for w* = softmax(R/tau) with tau the
group's std, uniform for all-equal rewards), then an SGD step of the same lr.

Packages: torch, transformers, deepspeed, openrlhf (``--no-deps``), flash-attn's Python files
(openrlhf imports ``flash_attn.bert_padding``; attention is sdpa, and on a GPU flash-attn's Triton
cross-entropy computes the fp32 log-probs as in training unless ``--logprobs torch``) and ``ray`` for
imports only (``openrlhf.trainer.ray.ppo_actor``). Without vLLM, ``openrlhf.trainer.ray``'s package
``__init__`` (which only re-exports the vLLM engine factory) is skipped: :func:`import_trainer`.

Run: ``python -m openrlhf_lpo.checks.trainer_check --zero 3 [--cpu] [--world 2] --json out.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Dict, List, Optional

from openrlhf_lpo.upstream import ContractBroken, module_source, params, patch_point  # stdlib only

K = 4  # responses per prompt
GROUPS_PER_RANK = 4
LR = 0.5  # large, so that the later windows see P far from softmax(s_t)
REL_TOL = {"fp32": 1e-4, "bf16": 5e-2}  # max |grad - reference| / max |reference| per window
MODEL_SHAPE = dict(arch="qwen3", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, intermediate_size=128, tie_word_embeddings=True, max_position_embeddings=256)


def import_trainer():
    """Import the trainer's modules. ``openrlhf/trainer/ray/__init__.py`` imports vLLM only to
    re-export ``create_vllm_engines`` and ``batch_vllm_engine_call``; where vLLM is absent the package
    is registered without running that file (those two names raise if called; nothing here calls
    them), so ``ppo_actor``, ``launcher`` and the stock CLI's parser import as they are."""
    if importlib.util.find_spec("vllm") is None and "openrlhf.trainer.ray" not in sys.modules:
        import openrlhf.trainer

        spec = importlib.util.find_spec("openrlhf.trainer.ray")
        pkg = types.ModuleType("openrlhf.trainer.ray")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__spec__, pkg.__package__, pkg.__file__ = spec, "openrlhf.trainer.ray", spec.origin
        for name in ("create_vllm_engines", "batch_vllm_engine_call"):
            pkg.__dict__[name] = _needs_vllm(name)
        sys.modules["openrlhf.trainer.ray"] = pkg
        openrlhf.trainer.ray = pkg
    from openrlhf_lpo.openrlhf import actor_trainer

    return actor_trainer


def _needs_vllm(name: str):
    def call(*args, **kwargs):
        raise ModuleNotFoundError(f"openrlhf.trainer.ray.{name} needs vLLM, which is not installed here")

    call.__name__ = name
    return call


# ----------------------------------------------------------------------------- the check's patch points
# (registered in openrlhf_lpo.upstream's registry when this module is imported; the contracts import no vLLM)


@patch_point("trainer-check-ray-package", "openrlhf.trainer.ray", "create_vllm_engines, batch_vllm_engine_call",
             "stand-in", "import_trainer registers the package without running its __init__.py where vLLM is absent, "
             "with stand-ins for the two names that file binds (re-exported from vllm_engine); read from the files, "
             "which import vLLM", imports=False)
def _ray_package_contract() -> None:
    import ast

    stand_ins = {"create_vllm_engines", "batch_vllm_engine_call"}
    bound = set()
    for node in ast.parse(module_source("openrlhf.trainer.ray")).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module == "vllm_engine":
            bound |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__all__"]:
            continue
        elif not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):  # (a docstring)
            raise ContractBroken(f"openrlhf/trainer/ray/__init__.py now also runs {ast.unparse(node)[:60]!r}")
    if bound != stand_ins:
        raise ContractBroken(f"openrlhf/trainer/ray/__init__.py binds {sorted(bound)}, the stand-in "
                             f"{sorted(stand_ins)}")
    defs = {n.name for n in ast.parse(module_source("openrlhf.trainer.ray.vllm_engine")).body
            if isinstance(n, ast.FunctionDef)}
    if not stand_ins <= defs:
        raise ContractBroken(f"vllm_engine no longer defines {sorted(stand_ins - defs)}")


@patch_point("trainer-check-strategy", "openrlhf.utils.deepspeed",
             "DeepspeedStrategy.get_ds_train_config, DeepspeedStrategy.optimizer_step", "contract",
             "the check's SnapshotStrategy overrides both: SGD and fp32 in the train config (its bf16 section), "
             "a snapshot of the master weights after each optimizer step")
def _strategy_contract() -> None:
    import inspect

    from openrlhf.utils.deepspeed import DeepspeedStrategy
    from openrlhf.utils.deepspeed import deepspeed_utils

    config = inspect.signature(DeepspeedStrategy.get_ds_train_config).parameters
    max_norm = config.get("max_norm")
    if list(config) != ["self", "optim_dict", "max_norm"] or max_norm.kind is not max_norm.KEYWORD_ONLY:
        raise ContractBroken(f"DeepspeedStrategy.get_ds_train_config{list(config)} changed")
    expected = ["self", "_optimizer", "model", "_scheduler", "name", "kwargs"]
    if params(DeepspeedStrategy.optimizer_step) != expected:
        raise ContractBroken(f"DeepspeedStrategy.optimizer_step{params(DeepspeedStrategy.optimizer_step)} != "
                             f"{expected}")
    if '"bf16": {' not in inspect.getsource(deepspeed_utils.get_train_ds_config):
        raise ContractBroken("get_train_ds_config no longer has a bf16 section")


@patch_point("trainer-check-dtype", "openrlhf.utils.utils", "convert_to_torch_dtype", "scoped-swap",
             "run_rank patches it (fp32) around Actor(...): Actor.__init__ imports it from openrlhf.utils.utils at "
             "call time, so the module attribute is the one it calls")
def _dtype_contract() -> None:
    import inspect

    from openrlhf.models import actor as actor_mod
    from openrlhf.utils import utils

    if params(utils.convert_to_torch_dtype) != ["param_dtype"]:
        raise ContractBroken(f"convert_to_torch_dtype{params(utils.convert_to_torch_dtype)} != (param_dtype)")
    if "from openrlhf.utils.utils import convert_to_torch_dtype" not in inspect.getsource(actor_mod.Actor.__init__) \
            or hasattr(actor_mod, "convert_to_torch_dtype"):
        raise ContractBroken("Actor.__init__ no longer imports convert_to_torch_dtype from openrlhf.utils.utils at "
                             "call time")


# ----------------------------------------------------------------------------- synthetic rollout


def synthetic_rollout(n_groups: int, vocab: int, seed: int = 0):
    """``n_groups`` x K single-sample Experiences as OpenRLHF's SamplesGenerator returns them:
    prompts of 3-6 tokens, responses of 2-12, rewards: group 0 all equal (a degenerate group), the
    others 0/1 with at least one of each."""
    import torch
    from openrlhf.trainer.ppo_utils.experience import Experience

    g = torch.Generator().manual_seed(seed)
    out = []
    for gi in range(n_groups):
        prompt = torch.randint(4, vocab, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g)
        if gi == 0:
            rewards = [1.0] * K
        else:
            rewards = [float(x) for x in torch.randint(0, 2, (K,), generator=g)]
            if len(set(rewards)) == 1:
                rewards[0] = 1.0 - rewards[0]
        for k in range(K):
            response = torch.randint(4, vocab, (int(torch.randint(2, 13, (1,), generator=g)),), generator=g)
            seq = torch.cat([prompt, response])[None]
            action = torch.zeros(1, seq.shape[1] - 1, dtype=torch.bool)
            action[0, prompt.numel() - 1:] = True
            r = torch.tensor([rewards[k]])
            out.append(Experience(sequences=seq, attention_mask=torch.ones_like(seq), action_mask=action,
                                  rewards=r, scores=r.clone(), response_length=torch.tensor([response.numel()]),
                                  truncated=torch.tensor([False]), total_length=torch.tensor([float(seq.shape[1])]),
                                  prompts=[f"prompt {gi}"], labels=[""], images=[None], mm_train_inputs=[None],
                                  info={"reward": r.clone(), "response_clip_ratio": torch.tensor([False])}))
    return out


# ----------------------------------------------------------------------------- reference


def _kl_to_softmax(w, s):
    """KL(w || softmax(s)) of one group, float64 (w may hold zeros)."""
    import torch

    log_p = torch.log_softmax(s, -1)
    return torch.where(w > 0, w * (torch.log(w.clamp(min=1e-300)) - log_p), torch.zeros_like(w)).sum()


def gibbs_target_reference(rewards):
    """w* = softmax(R / std(R)) (Bessel-corrected std, GRPO's tau); uniform when all rewards are equal."""
    import torch

    r = torch.as_tensor(rewards, dtype=torch.float64)
    if float(r.max() - r.min()) == 0.0:
        return torch.full_like(r, 1.0 / r.numel())
    return torch.softmax((r - r.mean()) / r.std(), -1)


def reference_window_gradients(model_dir: str, samples: Dict[int, List[dict]], windows: List[List[int]],
                               eps_low_high, lr: float):
    """Float64 CPU gradients of the listwise loss, window by window at the updated parameters.

    ``samples[gid]`` lists the group's K members as dicts with ``sequence`` [T], ``response_start``
    (index of the first response token), ``old`` [n] old log-probs of the response tokens and
    ``reward``; ``windows`` the group ids of each optimizer step in order. Returns one
    {parameter name: gradient} per window."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="eager")
    model.train()  # the tiny configs have no dropout; as the trainer's forward
    params = dict(model.named_parameters())
    lo, hi = math.log(1.0 - eps_low_high[0]), math.log(1.0 + eps_low_high[1])
    grads = []
    for gids in windows:
        loss = torch.zeros((), dtype=torch.float64)
        for gid in gids:
            s = []
            for m in samples[gid]:
                seq = m["sequence"]
                logits = model(seq[None]).logits[0, :-1].double()
                lp = torch.log_softmax(logits, -1).gather(-1, seq[1:, None])[:, 0][m["response_start"] - 1:]
                s.append((lp - m["old"]).clamp(lo, hi).mean())
            w = gibbs_target_reference([m["reward"] for m in samples[gid]])
            loss = loss + _kl_to_softmax(w, torch.stack(s)) / len(gids)
        g = torch.autograd.grad(loss, list(params.values()))
        grads.append({n: x.detach().clone() for n, x in zip(params, g)})
        with torch.no_grad():
            for p, x in zip(params.values(), g):
                p -= lr * x
    return grads


# ----------------------------------------------------------------------------- DeepSpeed run


def _strategy_class(DeepspeedStrategy, Actor, fp32: bool):
    """The real DeepspeedStrategy with SGD as its optimizer and a snapshot of the fp32 master
    weights after every optimizer step (the step's update is -lr x gradient)."""

    class SnapshotStrategy(DeepspeedStrategy):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.snapshots: List[Dict[str, object]] = []

        def get_ds_train_config(self, optim_dict=None, *, max_norm=None):
            cfg = super().get_ds_train_config(optim_dict, max_norm=max_norm)
            if optim_dict is not None:  # DeepSpeed's torch-optimizer path: torch.optim.SGD
                cfg["optimizer"] = {"type": "SGD", "params": {"lr": optim_dict["params"]["lr"]}}
                cfg["zero_allow_untested_optimizer"] = True
            if fp32:
                cfg["bf16"]["enabled"] = False
            return cfg

        def optimizer_step(self, optimizer, model, scheduler, name="model", **kwargs):
            engine = model.model if isinstance(model, Actor) else model
            before = engine.global_steps
            super().optimizer_step(optimizer, model, scheduler, name=name, **kwargs)
            if engine.global_steps != before:
                self.snapshots.append(master_weights(engine))

    return SnapshotStrategy


def master_weights(engine) -> Dict[str, object]:
    """Full fp32 master weights on the CPU, float64 (every rank must call: ZeRO-3 gathers)."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, p in engine.module.named_parameters():
        full = safe_get_full_fp32_param(p)
        out[name] = (p.data if full is None else full).detach().double().cpu().clone()
    return out


# bf16 runs clip the token log-ratios at [log 0.01, log 10] instead of OpenRLHF's [log 0.8, log 1.2]: at
# lr 0.5 many tokens sit at the clip edge, where bf16 rounding decides whether a token is clipped (gradient 0)
# or kept, so a window's gradient jumps (measured on an AMD Zen 5 CPU: relative error 1.0 at ZeRO-3, 0.03 at
# ZeRO-2, against 8e-6 in fp32). fp32 runs keep the recipes' clip, which the reference applies exactly.
BF16_CLIP = ("0.99", "9.0")


def parse_check_args(model_dir: str, zero: int, world: int, train_batch: int, dtype: str = "fp32"):
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse

    clip = ["--actor.eps_clip_low_high", *BF16_CLIP] if dtype == "bf16" else []
    return build_parser_and_parse(clip + [
        "--actor.model_name_or_path", model_dir, "--actor.num_nodes", "1", "--actor.num_gpus_per_node", str(world),
        "--rollout.n_samples_per_prompt", str(K), "--rollout.batch_size", str(GROUPS_PER_RANK * world),
        "--rollout.micro_batch_size", str(K), "--train.batch_size", str(train_batch),
        "--train.micro_batch_size", str(K // 2), "--train.max_epochs", "2", "--vllm.num_engines", "1",
        "--reward.remote_url", "http://unused", "--ds.attn_implementation", "sdpa", "--ds.zero_stage", str(zero),
        "--algo.kl.init_coef", "0", "--algo.advantage.estimator", "lpo", "--lpo.temperature", "std",
        "--actor.adam.lr", str(LR), "--actor.max_norm", "0", "--actor.lr_scheduler", "constant",
    ])


def run_rank(model_dir: str, zero: int, dtype: str = "fp32") -> Optional[dict]:
    """One rank of the check (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* in the environment); rank 0
    returns the result."""
    import copy
    from unittest import mock

    import torch
    import torch.distributed as dist

    actor_trainer = import_trainer()
    import openrlhf.utils.utils as ou
    from openrlhf.models import Actor
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController
    from openrlhf.utils.deepspeed import DeepspeedStrategy
    from transformers import AutoTokenizer

    from openrlhf_lpo.openrlhf.experience_maker import LPOExperienceMaker

    torch.set_float32_matmul_precision("highest")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    n = GROUPS_PER_RANK * world * K
    args = parse_check_args(model_dir, zero, world, train_batch=n // 2, dtype=dtype)  # two windows per epoch
    fp32 = dtype == "fp32"
    strategy = _strategy_class(DeepspeedStrategy, Actor, fp32)(
        seed=args.train.seed, max_norm=0.0, micro_train_batch_size=args.train.micro_batch_size,
        train_batch_size=args.train.batch_size, zero_stage=zero, args=args)
    strategy.setup_distributed()
    rank = dist.get_rank()
    to_dtype = (lambda _name: torch.float32) if fp32 else ou.convert_to_torch_dtype  # upstream knows bf16/fp16 only
    with mock.patch.object(ou, "convert_to_torch_dtype", to_dtype):
        actor = Actor(model_dir, attn_implementation="sdpa", param_dtype=args.ds.param_dtype,
                      ds_config=strategy.get_ds_train_config())
    cfg = dict(optim="adam", muon=vars(args.actor.muon), adam=vars(args.actor.adam), lr_scheduler="constant",
               lr_warmup_ratio=0.0, min_lr_ratio=0.0, max_norm=0.0, scheduler_steps=100)
    actor, optim, sched = strategy.prepare((actor, cfg))
    strategy.snapshots.append(master_weights(actor.model))
    tok = AutoTokenizer.from_pretrained(model_dir)
    device = next(actor.parameters()).device

    # the rollout batch as the driver makes it: split, targets, then each rank's old log-probs
    maker = LPOExperienceMaker(None, None, None, None, FixedKLController(0.0), strategy, tok)
    exps = maker.split_rollout_samples(synthetic_rollout(n // K, MODEL_SHAPE["vocab_size"]))
    for e in exps:
        e.kl, e.values = None, None
        e.info["kl"] = torch.zeros(len(e.sequences))
    exps = maker.compute_advantages_and_returns(exps)
    per = math.ceil(len(exps) / world)  # OpenRLHF's RayActorGroup chunking
    mine = exps[rank * per:(rank + 1) * per]
    actor.eval()
    for e in mine:
        with torch.no_grad():
            e.action_log_probs = actor(e.sequences.to(device), e.action_mask.to(device),
                                       attention_mask=e.attention_mask.to(device)).float().cpu()
    actor.train()
    trainer = actor_trainer.LPOActorTrainer(
        strategy, actor, None, optim, sched, micro_train_batch_size=args.train.micro_batch_size, tokenizer=tok,
        eps_clip=args.actor.eps_clip, dataloader_pin_memory=False, vllm_engines=None)
    for e in mine:
        trainer.replay_buffer.append(copy.deepcopy(e))
    t = time.time()
    status = trainer.ppo_train(0.0)
    train_s = time.time() - t

    # what the reference needs: every rank's samples and windows
    items = trainer.replay_buffer.items
    mine_samples = []
    for it in items:
        am = it.action_mask.reshape(-1).bool()
        start = int(am.nonzero()[0]) + 1
        mine_samples.append({"gid": int(it.info["lpo_gid"]), "sequence": it.sequences.reshape(-1).cpu(),
                             "response_start": start, "old": it.action_log_probs.reshape(-1)[am].double().cpu(),
                             "reward": float(it.info["lpo_reward"])})
    windows = [sorted({int(items[i].info["lpo_gid"]) for mb in p.micro_batches for i in mb})
               for p in trainer.last_update.windows]
    gathered = [None] * world
    dist.all_gather_object(gathered, {"samples": mine_samples, "windows": windows})
    snaps = strategy.snapshots
    modes = [p.mode for p in trainer.last_update.windows]
    engine_gas = int(actor.model.gradient_accumulation_steps())
    dist.barrier()
    if rank != 0:
        return None
    samples: Dict[int, List[dict]] = {}
    for part in gathered:
        for m in part["samples"]:
            samples.setdefault(m["gid"], []).append(m)
    all_windows = [sorted(set().union(*(part["windows"][w] for part in gathered))) for w in range(len(windows))]
    refs = reference_window_gradients(model_dir, samples, all_windows, args.actor.eps_clip_low_high, LR)
    errors, scales = [], []
    for w, ref in enumerate(refs[:len(snaps) - 1]):  # verdict() reports missing steps
        got = {k: (snaps[w][k] - snaps[w + 1][k]) / LR for k in ref}
        scale = max(float(v.abs().max()) for v in ref.values())
        errors.append(max(float((got[k] - ref[k]).abs().max()) for k in ref) / scale)
        scales.append(scale)
    import deepspeed

    # OpenRLHF computes fp32 log-probs with flash-attn's Triton cross-entropy when that imports
    logprobs = "flash-attn triton" if sys.modules.get("flash_attn.ops.triton.cross_entropy") else "torch"
    return {"zero_stage": zero, "engine_stage": int(actor.model.zero_optimization_stage()),
            "partitioned": any(hasattr(q, "ds_id") for q in actor.model.module.parameters()), "logprobs": logprobs,
            "world": world, "dtype": dtype, "device": device.type, "modes": modes,
            "windows": len(refs), "steps": len(snaps) - 1, "rel_errors": errors, "ref_scales": scales,
            "max_rel_error": max(errors, default=math.inf), "tolerance": REL_TOL[dtype], "gas": engine_gas,
            "kl_moved": abs(status["lpo/kl_last"] - status["lpo/kl_start"]), "train_s": round(train_s, 2),
            "params": sum(v.numel() for v in snaps[0].values()), "deepspeed": deepspeed.__version__,
            "torch": torch.__version__}


def verdict(result: dict) -> List[str]:
    """What is wrong with a result (empty: PASS)."""
    problems = []
    if result["steps"] != result["windows"] or result["windows"] != 4:
        problems.append(f"{result['steps']} optimizer steps for {result['windows']} windows (4 expected)")
    if result["modes"] != ["shortcut", "pre_pass", "pre_pass", "pre_pass"]:
        problems.append(f"window modes {result['modes']} (micro-batches of K/2 split every group)")
    if result["max_rel_error"] >= result["tolerance"]:
        problems.append(f"gradient {result['max_rel_error']:.1e} from the float64 reference "
                        f"(limit {result['tolerance']:.0e})")
    if min(result["ref_scales"], default=0.0) <= 1e-4:
        problems.append("the reference gradient is ~0: the comparison would be vacuous")
    if result["kl_moved"] <= 1e-3:
        problems.append("P did not move between windows: the pre-passes would not test fresh coefficients")
    return problems


def _free_port() -> int:
    """A free TCP port below Linux's ephemeral range (where other processes' connections land)."""
    import random

    for port in random.Random().sample(range(20000, 32000), 200):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port in 20000-32000 for torch.distributed")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--zero", default="2,3", help="DeepSpeed ZeRO stages, comma-separated, run one after the other")
    p.add_argument("--world", type=int, default=1, help="data-parallel ranks (processes; one GPU each on a GPU)")
    p.add_argument("--dtype", default="fp32,bf16",
                   help="parameter dtypes, comma-separated: fp32 (limit %.0e) and/or bf16, the recipes' dtype "
                   "(limit %.0e)" % (REL_TOL["fp32"], REL_TOL["bf16"]))
    p.add_argument("--logprobs", choices=("auto", "torch"), default="auto",
                   help="auto: OpenRLHF's choice (flash-attn's Triton cross-entropy where it imports); torch: "
                   "OpenRLHF's torch fallback")
    p.add_argument("--cpu", action="store_true", help="CPU mode (openrlhf_lpo.cpu.mode): gloo")
    p.add_argument("--work_dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "lpo_trainer_check"))
    p.add_argument("--json", required=True, help="rank 0 writes the results (a list, one per stage) here")
    a = p.parse_args(argv)
    stages = [int(z) for z in a.zero.split(",")]
    dtypes = a.dtype.split(",")
    if not stages or set(stages) - {2, 3}:
        p.error(f"--zero {a.zero}: give ZeRO stages 2 and/or 3, e.g. --zero 2,3")
    if not dtypes or set(dtypes) - set(REL_TOL):
        p.error(f"--dtype {a.dtype}: give fp32 and/or bf16, e.g. --dtype fp32,bf16")
    if a.cpu:
        os.environ["LPO_CPU_DTYPE"] = "keep"  # run_rank sets the dtype itself (the CPU mode's default is fp32)
        from openrlhf_lpo.cpu.mode import enable_cpu_mode

        enable_cpu_mode()
    if a.logprobs == "torch":  # OpenRLHF falls back to torch when this import fails
        sys.modules["flash_attn.ops.triton.cross_entropy"] = None
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if "LPO_TRAINER_CHECK_MODEL" not in os.environ:
        from openrlhf_lpo.testing.tiny import build_tiny_model

        model_dir = build_tiny_model(work / "tiny-qwen3-trainer-check", seed=0, **MODEL_SHAPE)
        env = dict(LOCAL_RANK="0", WORLD_SIZE=str(a.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                   LPO_TRAINER_CHECK_MODEL=model_dir)
        if a.world > 1:  # the launcher: one process per rank, this one waits
            cmd = [sys.executable, "-m", "openrlhf_lpo.checks.trainer_check", *(sys.argv[1:] if argv is None else argv)]
            procs = [subprocess.Popen(cmd, env={**os.environ, **env, "RANK": str(r), "LOCAL_RANK": str(r)})
                     for r in range(a.world)]
            return max(q.wait() for q in procs)
        os.environ.update(env, RANK="0")  # one rank: this process (whatever RANK a launcher set)
    results = []
    for zero in stages:
        for dtype in dtypes:
            result = run_rank(os.environ["LPO_TRAINER_CHECK_MODEL"], zero, dtype)
            if result is None:
                continue
            result["problems"] = verdict(result)
            results.append(result)
            print(f"[trainer_check] ZeRO-{zero} {dtype}: {'PASS' if not result['problems'] else 'FAIL'} "
                  f"{json.dumps(result)}", flush=True)
    if results:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 1 if any(r["problems"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
