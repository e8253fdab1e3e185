"""Preflight check ``reward``: the reward (or agent) file loads and defines what OpenRLHF 0.11.2 calls.

OpenRLHF's rollout executor loads ``--reward.remote_url <file.py>`` (the first of a comma list) with
``importlib`` inside each engine and calls ``reward_func(queries, prompts, labels)``;
``--train.agent_func_path <file.py>`` must define a class ``AgentExecutor``. Here the file is loaded the
same way in a fresh Python process, so a file that raises, does not define the name, takes other
arguments or hangs (killed after ``LPO_PREFLIGHT_REWARD_TIMEOUT`` seconds, default 60) is an error
naming the file (and its line), not a traceback inside a Ray actor. The probe runs without
``LPO_CODE_SANDBOX``: the code reward probes its sandbox where rewards run (at engine start), not on the
driver. An HTTP reward server is not contacted.

Facts for the ``labels`` check: ``ctx.reward_is_ours`` (the file's ``reward_func`` is this package's
:mod:`openrlhf_lpo.rewards.reward_func`, whose label parsers the labels check runs).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from typing import Optional

from openrlhf_lpo.cli.preflight import PreflightError, register_check

TIMEOUT_ENV = "LPO_PREFLIGHT_REWARD_TIMEOUT"
MARK = "__lpo_preflight__ "
PROBE = r"""
import importlib.util, inspect, json, sys
path, name, module = sys.argv[1], sys.argv[2], sys.argv[3]
spec = importlib.util.spec_from_file_location(module, path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
obj = getattr(mod, name, None)
out = {"defined": obj is not None, "callable": callable(obj), "file": None, "binds": True}
if callable(obj) and name == "reward_func":
    try:
        inspect.signature(obj).bind(["q"], ["p"], ["l"])
    except TypeError:
        out["binds"] = False
    except ValueError:
        pass
    out["file"] = inspect.getsourcefile(obj)
print("\n__lpo_preflight__ " + json.dumps(out))
"""


def _timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "60")
    try:
        value = float(raw)
    except ValueError:
        raise PreflightError(f"{TIMEOUT_ENV}={raw!r}: give a number of seconds") from None
    return value if value > 0 else 60.0


def _error_line(stderr: str, path: str) -> str:
    """``path:LINE: Error: message`` from a traceback (the last frame in ``path``)."""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    last = lines[-1].strip() if lines else "(no message)"
    frames = re.findall(r'File "([^"]+)", line (\d+)', stderr)
    real = os.path.realpath(path)
    here = [n for f, n in frames if os.path.realpath(f) == real]
    line = here[-1] if here else None  # a SyntaxError's frame names the file and line too
    return f"{path}:{line}: {last}" if line else f"{path}: {last}"


def probe(path: str, name: str, flag: str) -> dict:
    """Load ``path`` in a subprocess and report on ``name`` (raises PreflightError on any failure)."""
    env = {k: v for k, v in os.environ.items() if k != "LPO_CODE_SANDBOX"}
    timeout = _timeout()
    try:
        out = subprocess.run([sys.executable, "-c", PROBE, path, name, name], capture_output=True, text=True,
                             timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise PreflightError(f"{flag} {path}: loading the file did not finish in {timeout:g} s (it runs code at "
                             f"import that does not return?); fix it, or raise {TIMEOUT_ENV}") from None
    if out.returncode != 0:
        raise PreflightError(f"{flag} {path}: the file fails when loaded: {_error_line(out.stderr, path)}")
    report = next((json.loads(ln[len(MARK):]) for ln in reversed(out.stdout.splitlines()) if ln.startswith(MARK)),
                  None)
    if report is None:
        raise PreflightError(f"{flag} {path}: the file exited while loading (no report from the probe)")
    return report


def _ours(source_file: Optional[str]) -> bool:
    spec = importlib.util.find_spec("openrlhf_lpo.rewards.reward_func")
    return bool(source_file and spec and spec.origin
                and os.path.realpath(source_file) == os.path.realpath(spec.origin))


def _check_file(path: str, flag: str, name: str, what: str) -> dict:
    if not os.path.isfile(path):
        raise PreflightError(f"{flag} {path}: no such file ({what}; relative paths are relative to the working "
                             "directory)" + (" — this repository's reward is openrlhf_lpo/rewards/reward_func.py"
                                             if name == "reward_func" else ""))
    report = probe(path, name, flag)
    if not report["defined"]:
        raise PreflightError(f"{flag} {path}: the file defines no {name!r} ({what})")
    if not report["callable"]:
        raise PreflightError(f"{flag} {path}: {name!r} is not callable")
    if not report["binds"]:
        raise PreflightError(f"{flag} {path}: reward_func must accept (queries, prompts, labels): OpenRLHF calls "
                             "reward_func(queries, prompts, labels)")
    return report


@register_check("reward")
def check_reward(ctx) -> None:
    args = ctx.args
    ctx.reward_is_ours = False
    agent = getattr(args.train, "agent_func_path", None)
    if agent:
        if not agent.endswith(".py"):
            raise PreflightError(f"--train.agent_func_path {agent}: must be a Python file (*.py)")
        _check_file(agent, "--train.agent_func_path", "AgentExecutor",
                    "OpenRLHF builds its agent from the class AgentExecutor(AgentExecutorBase)")
        ctx.say(f"agent: {agent} defines AgentExecutor")
        return
    urls = args.reward.remote_url
    if not urls:
        ctx.say("reward: a reward model (--reward.model_name_or_path), not a function")
        return
    urls = urls if isinstance(urls, list) else str(urls).split(",")
    first = urls[0].strip()
    if not first.endswith(".py"):
        ctx.say(f"reward: HTTP server {first} (not contacted by preflight)")
        return
    report = _check_file(first, "--reward.remote_url", "reward_func",
                         "OpenRLHF calls reward_func(queries, prompts, labels) from it")
    ctx.reward_is_ours = _ours(report.get("file"))
    ctx.say(f"reward: {first} defines reward_func" + (" (openrlhf_lpo's: labels are checked with its parsers)"
                                                      if ctx.reward_is_ours else " (labels are not checked: it is "
                                                      "not openrlhf_lpo/rewards/reward_func.py)"))
