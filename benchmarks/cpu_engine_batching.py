"""CPU rollout engine: one rollout batch generated request by request vs. as one batch.

    python benchmarks/cpu_engine_batching.py [--prompts 16] [--k 8] [--max-tokens 8] [--rounds 3]

The demo's setting: the warm-up-sized tiny Qwen3 (2 layers, hidden 128), 16 prompts x K=8 samples,
temperature 1, up to 8 new tokens, stop on EOS disabled so both paths generate the same number of
tokens. ``sequential`` calls ``HFBackend.generate`` once per sample (what the engine did before it
batched concurrent requests); ``batched`` is one ``HFBackend.generate_many`` call over all samples.
Prints the best-of-rounds wall time of each and the ratio sequential / batched (same run, same model,
one torch thread like the CPU mode).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from openrlhf_lpo.engines.cpu_engine import HFBackend  # noqa: E402
from openrlhf_lpo.testing.tiny import build_tiny_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "tiny", arch="qwen3", seed=0, hidden_size=128, num_layers=2,
                                 num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=384)
        engine = HFBackend(model, seed=0)
        engine.stop_ids = set()
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(4, 100, (int(torch.randint(8, 14, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(args.prompts)]
        params = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=args.max_tokens, min_tokens=0,
                                 logprobs=None)
        requests = [(p, params) for p in prompts for _ in range(args.k)]

        def sequential():
            return [engine.generate(p, sp) for p, sp in requests]

        def batched():
            return engine.generate_many(requests)

        times = {}
        for name, fn in (("sequential", sequential), ("batched", batched)):
            fn()  # warm-up
            best = float("inf")
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                outs = fn()
                best = min(best, time.perf_counter() - t0)
            assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outs)
            times[name] = best
    result = {
        "samples": len(requests), "max_tokens": args.max_tokens,
        "sequential_s": round(times["sequential"], 4), "batched_s": round(times["batched"], 4),
        "speedup_sequential_over_batched": round(times["sequential"] / times["batched"], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
