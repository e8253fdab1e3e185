#!/usr/bin/env python
"""Mutation check: deliberate bugs the test suite must catch.

Each mutation is one exact text replacement in a product file of a temporary copy of the repository
(the working tree is never touched), followed by the few tests that must fail because of it. A
mutation is *killed* when those tests fail and *survives* when they pass; the script prints each
diff, then a table, and exits non-zero if any mutation survives (or a replacement no longer
applies, or the unmutated tests do not pass first: then the check would prove nothing).

    python scripts/mutation_check.py                 # every mutation (~5-8 min on 2 cores)
    python scripts/mutation_check.py --list          # names and the tests that must kill each
    python scripts/mutation_check.py --only stale-c-later-windows,refusal-removed-ring-attn
    python scripts/mutation_check.py --with-e2e      # also run the slow end-to-end tests of a mutation
                                                     # (separately: they must fail on their own too)

Run it with the project's Python (``LPO_VENV``/``.venv``); ``docs/testing.md`` lists the mutations and
the tests that kill them.
"""

from __future__ import annotations

import argparse
import difflib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]

EXACTNESS = [
    "tests/openrlhf/test_lpo_gradient_exactness.py::test_every_step_gradient_equals_window_reference_dp1",
]
INTERNALS = "tests/openrlhf/test_lpo_trainer_internals.py"
DP2_E2E = "tests/pipeline/test_e2e_layouts.py::test_two_ranks_with_split_groups_update_like_the_float64_reference"


@dataclass
class Mutation:
    name: str
    bug: str
    path: str
    old: str
    new: str
    tests: List[str]
    slow_tests: List[str] = field(default_factory=list)  # run too with --with-e2e, in a pytest run of their own


MUTATIONS = [
    Mutation(
        "stale-c-later-windows",
        "stale coefficients: every optimizer window takes c at s_t (the rollout policy) instead of a no-grad "
        "pass at the current parameters",
        "openrlhf_lpo/openrlhf/actor_trainer.py",
        "                s_win = self._log_ratios(items, plan.micro_batches, prev_ctx)",
        "                s_win = prev[idx]",
        [f"{INTERNALS}::test_partial_last_window_steps_once_and_is_exact"] + EXACTNESS,
    ),
    Mutation(
        "pre-pass-skipped-after-first-window",
        "stale coefficients: the first window of every epoch (not only of epoch 0) skips the pre-pass",
        "openrlhf_lpo/openrlhf/actor_trainer.py",
        "mode = update.choose_mode(projection, whole_groups, epoch == 0 and w == 0,",
        "mode = update.choose_mode(projection, whole_groups, w == 0,",
        EXACTNESS,
    ),
    Mutation(
        "groups-split-across-ranks",
        "groups split across data-parallel ranks: the experience maker deals samples round-robin",
        "openrlhf_lpo/openrlhf/experience_maker.py",
        "per_rank = [[g * K + k for g in gs for k in range(K)] for gs in ranks]",
        "per_rank = [list(range(r, n * K, len(ranks))) for r in range(len(ranks))]",
        [f"{INTERNALS}::test_split_keeps_groups_on_one_rank_and_forward_chunks_follow_rollout_micro_batch",
         f"{INTERNALS}::test_partial_batch_drops_only_what_does_not_divide"],
        [DP2_E2E],
    ),
    Mutation(
        "groups-split-across-windows",
        "groups split across optimizer windows: the window shuffle permutes samples, not whole groups",
        "openrlhf_lpo/core/layout.py",
        "        perm = torch.randperm(len(members), generator=generator).tolist()\n"
        "        members = [members[p] for p in perm]",
        "        flat = [i for m in members for i in m]\n"
        "        perm = torch.randperm(len(flat), generator=generator).tolist()\n"
        "        k = len(members[0])\n"
        "        members = [[flat[p] for p in perm[j:j + k]] for j in range(0, len(flat), k)]",
        [f"{INTERNALS}::test_window_groups_and_micro_batches",
         f"{INTERNALS}::test_partial_last_window_steps_once_and_is_exact"] + EXACTNESS,
    ),
    Mutation(
        "resume-replays-window-order",
        "resume replays from step 0: the window shuffle is keyed by this process's call counter, not by the "
        "engine's restored step count",
        "openrlhf_lpo/openrlhf/actor_trainer.py",
        "return int(steps) if isinstance(steps, int) else self._ppo_calls",
        "return self._ppo_calls",
        # not an e2e resume: on the demo job's resume each rank ordered 2 windows per step and the two keys
        # happened to give the same order (docs/testing.md)
        [f"{INTERNALS}::test_window_shuffle_follows_the_engines_step_count"],
    ),
    Mutation(
        "refusal-removed-ring-attn",
        "a refusal removed: lpo-train accepts --ds.ring_attn_size > 1 with the LPO estimator",
        "openrlhf_lpo/cli/flags.py",
        '        (args.ds.ring_attn_size > 1, "--ds.ring_attn_size > 1",\n'
        '         "ring attention splits one sequence over ranks; the LPO trainer\'s no-grad passes and group "\n'
        '         "windows do not implement it"),\n',
        "",
        ["tests/openrlhf/test_lpo_cli_flags.py::test_invalid_combinations_fail_at_parse_time"],
    ),
    Mutation(
        "refusal-removed-megatron-sleep",
        "a refusal removed: --backend megatron accepts --ds.enable_sleep",
        "openrlhf_lpo/megatron/flags.py",
        '        (args.ds.enable_sleep, "--ds.enable_sleep",\n',
        '        (False, "--ds.enable_sleep",\n',
        ["tests/megatron/test_megatron_flags.py::test_every_megatron_refusal_exits_2_naming_the_flag"],
    ),
    Mutation(
        "fast-path-changes-verdict",
        "the grading fast path changes a verdict: it accepts a response whose final text merely contains the gold",
        "openrlhf_lpo/rewards/math_grading.py",
        "if fast_path and from_box and extracted == gold.strip():",
        "if fast_path and gold.strip() in text:",
        ["tests/evaluation/test_eval_grading_faults.py"],
    ),
    Mutation(
        "reward-error-ends-the-run",
        "one failed reward ends the run again: the reward file lets a task's exception through",
        "openrlhf_lpo/rewards/reward_func.py",
        "    except Exception as e:  # noqa: BLE001  (one failed reward must not end the run)",
        "    except ZeroDivisionError as e:",
        ["tests/pipeline/test_reward_errors.py"],
        ["tests/pipeline/test_e2e_reward_errors.py"],
    ),
    Mutation(
        "pre-pass-per-sample",
        "the pre-pass runs one forward per sample instead of the window's token-budget micro-batches",
        "openrlhf_lpo/openrlhf/actor_trainer.py",
        "self._log_ratios(items, plan.micro_batches, prev_ctx)",
        "self._log_ratios(items, [[i] for i in idx.tolist()], prev_ctx)",
        [f"{INTERNALS}::test_pre_pass_and_end_kl_follow_the_token_budget"],
    ),
    Mutation(
        "job-key-without-temperature",
        "the job key forgets the sampling temperature: a temperature sweep is served the first run's samples",
        "evaluation/generate.py",
        '"sampling": {**dataclasses.asdict(opts.sampling(stop)), "stop": list(stop)},',
        '"sampling": {**{k: v for k, v in dataclasses.asdict(opts.sampling(stop)).items() if k != "temperature"}, '
        '"stop": list(stop)},',
        ["tests/evaluation/test_eval_keys.py::test_two_runs_differing_in_one_sampling_setting_leave_two_jobs"],
    ),
    Mutation(
        "checkpoint-id-weights-by-name",
        "the checkpoint id hashes weight files by name only: a checkpoint re-saved in the same folder is never "
        "evaluated again",
        "evaluation/checkpoints.py",
        'h.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}:{weights_fingerprint(f)}")',
        "h.append(f.name)",
        ["tests/evaluation/test_eval_keys.py::test_checkpoint_id_changes_when_the_weights_are_resaved"],
    ),
    Mutation(
        "majority-without-grader",
        "score votes maj@k without the grader: 1/2, 0.5 and \\frac{1}{2} count as three answers",
        "evaluation/score.py",
        'votes = vote_labels(problems, cfg["kind"], pool, timeout=min(timeout, 5.0))',
        'votes = vote_labels(problems, cfg["kind"], None, timeout=min(timeout, 5.0))',
        ["tests/evaluation/test_eval_keys.py::test_score_majority_votes_with_the_graders_equivalence"],
    ),
    Mutation(
        "sample-seed-by-batch-position",
        "a sample's seed follows its position in the engine call, not its index: shards, --dp and a larger n "
        "draw other samples than one plain run",
        "evaluation/generate.py",
        'seeds = [sample_seed(opts.seed, cfg["benchmark"], problems[p].id, j) for p, j in missing]',
        'seeds = [sample_seed(opts.seed, cfg["benchmark"], problems[p].id, i) for i, (p, j) in enumerate(missing)]',
        ["tests/evaluation/test_eval_scale.py::test_two_shards_merge_to_the_plain_run_and_score_counts_each_sample_once",
         "tests/evaluation/test_eval_scale.py::test_larger_n_draws_only_the_new_samples"],
    ),
    Mutation(
        "bootstrap-unpaired",
        "compare's bootstrap resamples the two checkpoints' problems independently instead of in pairs",
        "evaluation/stats.py",
        "    means = bootstrap_means(d, resamples, seed)\n",
        "    means = bootstrap_means(np.asarray(b, dtype=np.float64), resamples, seed) - bootstrap_means(\n"
        "        np.asarray(a, dtype=np.float64), resamples, seed + 1)\n",
        ["tests/evaluation/test_eval_stats.py::test_paired_bootstrap_matches_the_exact_bootstrap_distribution"],
    ),
    Mutation(
        "dp-dead-engine-unreported",
        "a --dp engine process that dies is not reported: the run ends as if finished, with a shard missing",
        "evaluation/dp.py",
        '                    report.failed.append(f"engine process {r}/{opts.dp} exited with code {rc} (its log is above); "\n'
        '                                         "rerun to resume")\n',
        "                    pass\n",
        ["tests/evaluation/test_eval_scale.py::test_dp2_engine_processes_give_the_samples_of_one_even_when_one_dies"],
    ),
    Mutation(
        "budget-credits-unboxed-prefix",
        "a response cut at a token budget is graded without its box: unfinished text whose last number is the "
        "gold gets credit",
        "evaluation/budget.py",
        'if cfg["kind"] == "math" and not _has_box(text):',
        "if False:",
        ["tests/evaluation/test_eval_budget.py::test_pass1_at_token_budgets_regrades_the_cut_prefixes"],
    ),
]


def copy_repo(dest: Path) -> None:
    """Tracked and untracked-but-not-ignored files of the repository (no .git, no build outputs)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    for rel in filter(None, out.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_tests(repo: Path, tests: List[str], timeout: int) -> tuple[int, float, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "2")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("LPO_BENCHMARKS_DIR", str((ROOT / ".." / "shared" / "benchmarks").resolve()))
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f"--timeout={timeout}", *tests]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout + 60)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, f"timed out after {timeout + 60}s\n{e.stdout or ''}"
    return rc, time.time() - t0, out


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="comma-separated mutation names")
    ap.add_argument("--list", action="store_true", help="list the mutations and their tests, run nothing")
    ap.add_argument("--with-e2e", action="store_true", help="add the slow end-to-end tests (minutes each)")
    ap.add_argument("--skip-baseline", action="store_true", help="do not run the unmutated tests first")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per pytest run (default 900)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy")
    args = ap.parse_args(argv)

    chosen = MUTATIONS
    if args.only:
        names = set(args.only.split(","))
        unknown = names - {m.name for m in MUTATIONS}
        if unknown:
            ap.error(f"--only: unknown mutation(s) {sorted(unknown)}; valid: {', '.join(m.name for m in MUTATIONS)}")
        chosen = [m for m in MUTATIONS if m.name in names]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.bug}\n  {m.path}\n  tests: " + "\n         ".join(
                m.tests + [f"(--with-e2e) {t}" for t in m.slow_tests]))
        return 0

    tmp = Path(tempfile.mkdtemp(prefix="lpo-mutants-"))
    repo = tmp / "repo"
    repo.mkdir()
    copy_repo(repo)
    print(f"[mutation-check] copy of {ROOT} in {repo}", flush=True)
    results = []
    try:
        # every replacement must apply exactly once, before anything runs
        for m in chosen:
            count = (repo / m.path).read_text().count(m.old)
            if count != 1:
                print(f"[mutation-check] {m.name}: the text to replace occurs {count} times in {m.path} "
                      "(the product changed: update the mutation)", flush=True)
                return 2
        if not args.skip_baseline:
            union = list(dict.fromkeys(t for m in chosen for t in m.tests))
            rc, secs, out = run_tests(repo, union, args.timeout)
            print(f"[mutation-check] baseline (unmutated): rc={rc} in {secs:.0f}s", flush=True)
            if rc != 0:
                print(tail(out, 40))
                print("[mutation-check] the unmutated tests fail: fix the suite first")
                return 2
        for m in chosen:
            path = repo / m.path
            original = path.read_text()
            mutated = original.replace(m.old, m.new, 1)
            diff = "".join(difflib.unified_diff(original.splitlines(True), mutated.splitlines(True),
                                                f"a/{m.path}", f"b/{m.path}", n=1))
            print(f"\n=== {m.name}: {m.bug}\n{diff}", end="", flush=True)
            runs = [m.tests] + ([m.slow_tests] if args.with_e2e and m.slow_tests else [])
            path.write_text(mutated)
            try:
                for tests in runs:
                    rc, secs, out = run_tests(repo, tests, args.timeout)
                    status = {0: "SURVIVED", 1: "killed"}.get(rc, f"error (rc {rc})")
                    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in out.splitlines()
                              if line.startswith(("FAILED ", "ERROR "))]
                    results.append((m, tests, status, secs, failed))
                    print(f"tests: {' '.join(tests)}\n-> {status} in {secs:.0f}s"
                          + (f"; first failure: {failed[0]}" if failed else ""), flush=True)
                    if rc not in (0, 1):
                        print(tail(out))
            finally:
                path.write_text(original)
    finally:
        if args.keep:
            print(f"[mutation-check] kept {repo}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    print("\n| mutation | file | tests run | result | first failing test | seconds |")
    print("|---|---|---|---|---|---:|")
    for m, tests, status, secs, failed in results:
        shown = "<br>".join(t.replace("tests/", "") for t in tests)
        first = failed[0].replace("tests/", "") if failed else "-"
        print(f"| {m.name} | {m.path} | {shown} | {status} | {first} | {secs:.0f} |")
    # every pytest run of a mutation must fail (a slow e2e that misses the bug is reported too)
    survivors = list(dict.fromkeys(m.name for m, _, status, _, _ in results if status != "killed"))
    n = len({m.name for m, *_ in results})
    print(f"\n{n - len(survivors)}/{n} mutations killed by every test run"
          + (f"; not killed everywhere: {', '.join(survivors)}" if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
