"""Supervised warm-up of a tiny offline Qwen3 on a demo task, cached by configuration hash.

RL with a 0/1 reward needs a policy that already succeeds sometimes: a random tiny model never
writes a correct sum, so every group has zero reward variance and nothing is learned. The warm-up
trains the model (plain torch + transformers, deterministic, ``threads`` CPU threads) on
``question -> answer<|im_end|>`` pairs until its *sampled* accuracy (temperature 1, the RL
sampling policy) reaches ``target_accuracy`` or ``max_steps`` pass.

The result is a complete HF model directory (weights, config, tokenizer, ``warmup.json`` with
the loss/accuracy history) stored under ``$LPO_CACHE_DIR`` (default ``~/.cache/openrlhf-lpo``)
in ``warmup/<hash>``, where the hash covers every field of :class:`WarmupConfig` and
:data:`WARMUP_VERSION`. The directory is written to a temporary sibling and moved into place
with ``os.replace``, so an interrupted warm-up never leaves a half-written cache entry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Optional

# Bump when the training procedure changes in a way that changes the weights it produces.
WARMUP_VERSION = 1


@dataclass(frozen=True)
class WarmupConfig:
    """Everything that determines the warmed-up weights (all fields enter the cache key)."""

    task: str = "addition"
    seed: int = 0
    # tiny model (openrlhf_lpo.testing.tiny.build_tiny_model)
    arch: str = "qwen3"
    # 0.4M parameters: learns 2-digit addition in ~250 steps at lr 3e-3 (the 3.2M-parameter
    # default of openrlhf_lpo.testing.tiny needed ~900 steps at lr 2e-3, see docs/demo.md)
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    # optimisation
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    max_steps: int = 1500
    # stopping rule: sampled accuracy (temperature 1) on eval_prompts held-out problems
    eval_every: int = 25
    eval_prompts: int = 128
    target_accuracy: float = 0.6
    threads: int = 1  # 1 thread: small matmuls gain little from 2, and 2 OpenMP threads stall badly on a busy machine

    def key(self) -> str:
        blob = json.dumps({"version": WARMUP_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def validate(self) -> None:
        from openrlhf_lpo.demo.task import get_task

        get_task(self.task)
        for name in ("batch_size", "max_steps", "eval_every", "eval_prompts", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"warm-up {name} must be >= 1 (got {getattr(self, name)})")
        if not 0.0 <= self.target_accuracy <= 1.0:
            raise ValueError(f"warm-up target_accuracy must be in [0, 1] (got {self.target_accuracy})")
        if self.lr <= 0:
            raise ValueError(f"warm-up lr must be > 0 (got {self.lr})")


def cache_root() -> Path:
    """``$LPO_CACHE_DIR`` or ``~/.cache/openrlhf-lpo``."""
    root = os.environ.get("LPO_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "openrlhf-lpo"


def cached_path(cfg: WarmupConfig) -> Path:
    return cache_root() / "warmup" / cfg.key()


def is_complete(path: Path) -> bool:
    return (path / "warmup.json").exists() and (path / "config.json").exists()


# Held-out evaluation problems use a seed stream disjoint from training.
_EVAL_SEED_OFFSET = 1_000_003


def sampled_accuracy(model, tokenizer, task, questions_answers, temperature: float = 1.0,
                     greedy: bool = False) -> float:
    """Fraction of ``(question, label)`` problems answered correctly (one sample each, or greedy)."""
    import torch

    from openrlhf_lpo.demo.policy import decode, encode_prompts, greedy_responses, sample_responses
    from openrlhf_lpo.demo.task import score

    questions = [q for q, _ in questions_answers]
    ids, mask = encode_prompts(tokenizer, questions)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        if greedy:
            resp = greedy_responses(model, tokenizer, ids, mask, task.max_answer_chars + 2)
        else:
            resp, _ = sample_responses(model, tokenizer, ids, mask, 1, task.max_answer_chars + 2, temperature)
    model.train(was_training)
    texts = decode(tokenizer, resp)
    return sum(score(t, a) for t, (_, a) in zip(texts, questions_answers)) / len(texts)


def train_warmup(cfg: WarmupConfig, out_dir: Path, progress: bool = True,
                 log: Optional[Callable[[Dict], None]] = None) -> Dict:
    """Build the tiny model in ``out_dir``, train it in place, save it; return the summary dict."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from openrlhf_lpo.demo.policy import encode_sft_batch
    from openrlhf_lpo.demo.task import get_task
    from openrlhf_lpo.testing.tiny import build_tiny_model

    cfg.validate()
    task = get_task(cfg.task)
    torch.set_num_threads(cfg.threads)
    t0 = time.time()
    build_tiny_model(
        out_dir, arch=cfg.arch, seed=cfg.seed, overwrite=True, hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
    )
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:  # linear warm-up, then constant
        return cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup_steps))

    # training problems never come from the task's held-out split; answers are drawn uniformly
    # among each problem's correct answers (a diverse starting policy)
    train_stream = task.sft_stream(cfg.seed)
    eval_set = task.problems(cfg.eval_prompts, cfg.seed + _EVAL_SEED_OFFSET, split="heldout")
    history = []
    bar = _bar(cfg.max_steps, "warm-up (SFT)", progress)
    accuracy, step, loss_ema = 0.0, 0, math.nan
    try:
        for step in range(1, cfg.max_steps + 1):
            pairs = [next(train_stream) for _ in range(cfg.batch_size)]
            ids, att, labels = encode_sft_batch(tokenizer, pairs)
            for group in opt.param_groups:
                group["lr"] = lr_at(step - 1)
            loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            loss_ema = loss.item() if math.isnan(loss_ema) else 0.9 * loss_ema + 0.1 * loss.item()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss_ema:.3f}", acc=f"{accuracy:.2f}")
            if step % cfg.eval_every == 0 or step == cfg.max_steps:
                torch.manual_seed(cfg.seed * 7919 + step)  # evaluation sampling is seeded per step
                accuracy = sampled_accuracy(model, tokenizer, task, eval_set)
                torch.manual_seed(cfg.seed + step)  # training randomness unaffected by evaluation
                row = {"step": step, "loss": loss_ema, "sampled_accuracy": accuracy,
                       "elapsed_s": time.time() - t0}
                history.append(row)
                if log is not None:
                    log(row)
                if bar is not None:
                    bar.set_postfix(loss=f"{loss_ema:.3f}", acc=f"{accuracy:.2f}")
                if accuracy >= cfg.target_accuracy:
                    break
    finally:
        if bar is not None:
            bar.close()
    greedy = sampled_accuracy(model, tokenizer, task, eval_set, greedy=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    summary = {
        "config": dataclasses.asdict(cfg), "key": cfg.key(), "version": WARMUP_VERSION, "steps": step,
        "sampled_accuracy": accuracy, "greedy_accuracy": greedy,
        "reached_target": accuracy >= cfg.target_accuracy, "wall_s": time.time() - t0, "history": history,
    }
    with open(out_dir / "warmup.json", "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def ensure_warmup(cfg: WarmupConfig, progress: bool = True, force: bool = False,
                  log: Optional[Callable[[Dict], None]] = None) -> Dict:
    """Return ``{"path", "cached", **summary}`` for a warmed-up model, training it only if needed.

    A complete cache entry is reused as is; otherwise the model is trained in a temporary sibling
    directory and moved into place atomically (a concurrent writer's finished entry wins).
    """
    cfg.validate()
    final = cached_path(cfg)
    if is_complete(final) and not force:
        with open(final / "warmup.json") as f:
            summary = json.load(f)
        return {"path": str(final), "cached": True, **summary}
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
    try:
        summary = train_warmup(cfg, tmp, progress=progress, log=log)
        if final.exists():
            if force or not is_complete(final):
                shutil.rmtree(final, ignore_errors=True)
        if not final.exists():
            os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return {"path": str(final), "cached": False, **summary}


def _bar(total: int, desc: str, enabled: bool):
    """The demo's progress bars (warm-up, every method's steps, held-out evaluation; the benchmarks that
    reuse them): plain lines when stderr is a file or a pipe (openrlhf_lpo.runtime.progress), a bar on a terminal."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency of the venv; keep the warm-up usable without it
        return None
    from openrlhf_lpo.runtime.progress import install

    install()
    return tqdm(total=total, desc=desc, dynamic_ncols=True, leave=True)
