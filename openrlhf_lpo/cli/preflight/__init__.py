"""Preflight of ``lpo-train`` and ``lpo-train --dry-run``: every input is checked before Ray or a model starts.

Public names (stable):
    Check, PreflightError, Preflight, register_check(name), checks()
    run_preflight(args, dry_run) -> Preflight      every registered check, on one shared context
    preflight_or_exit(args, prog) -> Preflight     the same; prints every failure and exits 2 (None: off)
    summary_lines(ctx) -> list of str              what the plan and a real run's log print
    looks_like_path(name) -> bool                  a local path, not a hub id
    MODES, CHECK_MODULES

Checks are a registry, one concern per module beside this one, run in this order (``CHECK_MODULES``):

==============  ==========================================================================
``model``       ``--actor.model_name_or_path``: folder, config, weights, tokenizer, chat template,
                positions; a hub id that is not in the local cache
``datasets``    ``--data.prompt_dataset`` / ``--eval.dataset`` read as OpenRLHF 0.11.2 reads them
                (its own ``blending_datasets``): parse errors with file and line, keys, empty
                datasets, ``--data.prompt_probs``, prompt and image values, duplicates
``reward``      ``--reward.remote_url``: the file loads in a subprocess (with a timeout) and defines
                ``reward_func``
``labels``      every label parses for its task with the reward's own parsers (our reward file)
``prompts``     prompts rendered as upstream renders them, their tokens with the model's tokenizer,
                rows ``--data.max_len`` / ``--rollout.max_new_tokens`` truncate
``checkpoint``  ``--ckpt.path`` / ``--ckpt.output_dir`` writable with the disk the run needs;
                ``--ckpt.load_enable`` with a checkpoint this run can resume
==============  ==========================================================================

A check reads what earlier checks found (``ctx.model``, ``ctx.datasets``), adds summary lines for the
plan (``ctx.say``) and raises :class:`PreflightError` (path, line or field, and what to do); every check
runs, every failure is reported, and ``lpo-train`` exits 2 before anything starts. ``--preflight off``
skips them all (expert use: a data path that exists only on the worker nodes, for instance).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from openrlhf_lpo.cli import flags as _flags
from openrlhf_lpo.registry import register_unique

__all__ = ["Check", "PreflightError", "Preflight", "register_check", "checks", "run_preflight",
           "preflight_or_exit", "summary_lines", "looks_like_path", "MODES", "CHECK_MODULES"]

MODES = ("on", "off")
# the modules that register the checks, in run order (each one concern)
CHECK_MODULES = ("model", "datasets", "reward", "labels", "prompts", "checkpoint")


class PreflightError(ValueError):
    """A bad input: the message names the path, line or field and what to do."""


def looks_like_path(name: str) -> bool:
    """A name meant as a local path (a hub id is ``org/name``: one slash, no leading ``/ . ~``)."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1


@dataclass
class Preflight:
    """The shared context of one preflight: the namespace, what the checks found, and the outcome."""

    args: argparse.Namespace
    dry_run: bool
    model: Any = None                     # model.ModelFacts
    datasets: Dict[str, Any] = field(default_factory=dict)  # "train" / "eval" -> datasets.DataFacts
    reward_is_ours: bool = False          # the reward file's reward_func is openrlhf_lpo's (labels check)
    lines: List[str] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)
    seconds: Dict[str, float] = field(default_factory=dict)  # check -> wall seconds

    def say(self, line: str) -> None:
        """A summary line for the plan."""
        self.lines.append(line)

    @property
    def train_rows(self) -> Optional[int]:
        facts = self.datasets.get("train")
        return None if facts is None else facts.rows


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[Preflight], None]


CHECKS: Dict[str, Check] = {}


def register_check(name: str):
    """Register ``fn(ctx)`` as check ``name``."""

    def deco(fn):
        register_unique(CHECKS, "preflight check", name, Check(name, fn))
        return fn

    return deco


def checks() -> List[Check]:
    """Every check, in the order of :data:`CHECK_MODULES` (checks registered elsewhere run last)."""
    for module in CHECK_MODULES:
        importlib.import_module(f"{__name__}.{module}")

    def order(check: Check) -> int:
        module = check.run.__module__.rpartition(".")[2]
        return CHECK_MODULES.index(module) if module in CHECK_MODULES else len(CHECK_MODULES)

    return sorted(CHECKS.values(), key=order)  # stable: registration order within a module


def run_preflight(args: argparse.Namespace, dry_run: bool = False) -> Preflight:
    """Run every check; failures are collected in ``ctx.errors`` (``[check] message``)."""
    ctx = Preflight(args=args, dry_run=dry_run)
    for check in checks():
        t0 = time.perf_counter()
        try:
            check.run(ctx)
        except PreflightError as e:
            ctx.errors.append(f"[{check.name}] {e}")
        ctx.seconds[check.name] = time.perf_counter() - t0
    return ctx


def preflight_or_exit(args: argparse.Namespace, prog: str) -> Optional[Preflight]:
    """``run_preflight`` unless ``--preflight off``; on failure print every problem and exit 2."""
    if getattr(args, "preflight", "on") == "off":
        print(f"{prog}: --preflight off: inputs are not checked before the run starts")
        return None
    ctx = run_preflight(args, dry_run=bool(getattr(args, "dry_run", False)))
    if ctx.errors:
        print(f"{prog}: preflight found {len(ctx.errors)} problem(s); nothing was started:", file=sys.stderr)
        for e in ctx.errors:
            print("  " + e.replace("\n", "\n    "), file=sys.stderr)
        print("  (docs/pipeline.md, 'Bad inputs'; --preflight off skips these checks)", file=sys.stderr)
        raise SystemExit(2)
    return ctx


def summary_lines(ctx: Optional[Preflight]) -> List[str]:
    """The lines the plan prints for a preflight (or for ``--preflight off``)."""
    if ctx is None:
        return ["preflight: off (--preflight off)"]
    each = ", ".join(f"{name} {t:.2f}" for name, t in ctx.seconds.items())
    return ([f"preflight: {len(ctx.seconds)} checks passed in {sum(ctx.seconds.values()):.2f} s ({each})"]
            + ["  " + line for line in ctx.lines])


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("lpo-train preflight")
    g.add_argument("--preflight", type=str, default="on", choices=MODES,
                   help="check every input (datasets, labels, model and tokenizer, reward file, checkpoint "
                        "path and resume) before Ray or any model starts, and exit 2 naming the file, line or "
                        "field (default on; off: expert use, e.g. paths that exist only on the worker nodes)")


_flags.register_flag_group(_flags.FlagGroup(name="preflight", add_arguments=_add_arguments))
