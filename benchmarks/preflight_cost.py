"""What ``lpo-train``'s preflight costs on a 7,500-row MATH training file (the MATH recipes' data).

    python benchmarks/preflight_cost.py [--rows 7500] [--rounds 3]

Setting: a MATH-like source written with MATH's schema (``problem``, ``solution`` ending in a
``\\boxed{}`` answer, ``level``, ``type``; problem lengths log-normal around MATH's, a few long ones)
and turned into training rows by ``python -m openrlhf_lpo.data.prepare math`` (the verl prompt, the
``{"task": "math", "answer": ...}`` label); a tiny Qwen3 whose tokenizer is a byte-level BPE (16k
merges, trained on the generated text, so it splits text like a real BPE tokenizer rather than per
character) and chat template; the 8B MATH recipe's data flags (``--data.apply_chat_template
--rollout.max_new_tokens 4096 --data.max_len 5120``, rollout batch 256) and our reward file.

Prints, best of ``--rounds``: ``lpo-train --dry-run`` wall time with ``--preflight on`` and with
``--preflight off`` (same flags, fresh processes, same run), their ratio, and the preflight's own time
per check as it reports it. The dataset cache of ``datasets`` is warm after the first round (a real
launch reads the file the same way in the trainer, which then reuses it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORDS = ("let be the real number such that find value of triangle area circle radius compute integer prime "
         "sum product remainder when divided by how many ways probability $x$ $y$ $n$ $\\frac{1}{2}$ "
         "$x^2+y^2=1$ $\\sqrt{2}$ $f(x)=3x+1$ points on a line with positive digits").split()


def math_source(path: Path, rows: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            n = min(int(rng.lognormvariate(3.7, 0.6)), 900)  # words; MATH problems ~ 50-1000 tokens
            problem = " ".join(rng.choice(WORDS) for _ in range(n)) + "?"
            answer = str(rng.randint(0, 999)) if rng.random() < 0.7 else f"\\frac{{{rng.randint(1, 9)}}}{{{rng.randint(2, 9)}}}"
            f.write(json.dumps({"problem": problem, "solution": f"... so the answer is $\\boxed{{{answer}}}$.",
                                "level": f"Level {rng.randint(1, 5)}", "type": "Algebra"}) + "\n")


def bpe_model(out: Path, corpus: Path) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from openrlhf_lpo.testing.tiny import CHAT_TEMPLATE, build_tiny_model

    path = build_tiny_model(out, seed=0, vocab_size=16384, max_position_embeddings=32768)
    texts = [json.loads(line)["problem"] for line in corpus.read_text().splitlines()]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=16000, special_tokens=[
        "<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


def dry_run(model: str, data: Path, work: Path, mode: str) -> tuple[float, str]:
    argv = [sys.executable, "-m", "openrlhf_lpo.cli.train_ppo_ray", "--actor.model_name_or_path", model,
            "--data.prompt_dataset", str(data), "--data.input_key", "prompt", "--data.label_key", "label",
            "--data.apply_chat_template", "--reward.remote_url", str(REPO / "openrlhf_lpo/rewards/reward_func.py"),
            "--rollout.max_new_tokens", "4096", "--data.max_len", "5120", "--rollout.batch_size", "256",
            "--train.batch_size", "1024", "--rollout.n_samples_per_prompt", "8", "--train.micro_batch_size", "1",
            "--algo.kl.init_coef", "0", "--algo.advantage.estimator", "lpo", "--vllm.num_engines", "4",
            "--actor.num_gpus_per_node", "8", "--ckpt.path", str(work / "ckpt"), "--ckpt.output_dir",
            str(work / "final"), "--ckpt.save_steps", "20", "--ckpt.save_hf", "--preflight", mode, "--dry-run"]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    out = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=str(REPO), timeout=900)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"dry run ({mode}) failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return wall, out.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=7500)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from openrlhf_lpo.data.loaders import load_math, write_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        math_source(work / "math_src.jsonl", args.rows)
        data = work / "math_train.jsonl"
        write_jsonl(load_math(str(work / "math_src.jsonl")), str(data))
        model = bpe_model(work / "tiny-bpe", work / "math_src.jsonl")
        best = {"on": float("inf"), "off": float("inf")}
        report = ""
        for _ in range(args.rounds):
            for mode in ("off", "on"):
                wall, stdout = dry_run(model, data, work, mode)
                if wall < best[mode]:
                    best[mode] = wall
                    if mode == "on":
                        report = stdout
        lines = [ln for ln in report.splitlines() if ln.startswith("preflight:") or ln.startswith("  ")]
        own = re.search(r"preflight: \d+ checks passed in ([\d.]+) s \(([^)]*)\)", report)
        print(f"rows {args.rows} ({data.stat().st_size / 1e6:.1f} MB), best of {args.rounds} rounds")
        print(f"lpo-train --dry-run --preflight off: {best['off']:.2f} s")
        print(f"lpo-train --dry-run --preflight on:  {best['on']:.2f} s")
        print(f"ratio on/off: {best['on'] / best['off']:.2f}; preflight's own time {own.group(1)} s ({own.group(2)})")
        print("\n".join(ln for ln in lines if "prompt tokens" in ln or "truncated" in ln or "rows from" in ln))


if __name__ == "__main__":
    main()
