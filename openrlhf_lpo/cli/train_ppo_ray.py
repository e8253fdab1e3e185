"""``lpo-train`` / ``python -m openrlhf_lpo.cli.train_ppo_ray``: OpenRLHF 0.11.2's Ray PPO entry
point with LPO.

Public names (stable):
    main(argv=None)                  parse, validate, run the stock ``train(args)`` inside the
                                     flag groups' ``before_train`` contexts (LPO class swaps ...)
    get_parser(extended=True)        the stock argparse parser (with our flags when extended)
    build_parser_and_parse(argv)     the same parse + stock validation + flag-group validation,
                                     returns the hierarchised namespace, trains nothing
    STOCK_CLI, PLUGIN_MODULES

How: the stock parser lives inside ``if __name__ == "__main__":`` of
``openrlhf.cli.train_ppo_ray``. We execute that module's source (not a copy) as ``__main__``,
without the module-level imports only its ``train`` uses (Ray, DeepSpeed and vLLM behind
``openrlhf.trainer``: a flag error, a dry run or the auto-resume supervisor costs no trainer
import), with two hooks: ``argparse.ArgumentParser.parse_args`` is wrapped to add the
``lpo``/``maxrl`` estimator choices and every flag group's flags before parsing, and the
module-level name ``train`` is resolved to our wrapper, which validates the flag groups after
the stock validation and returns the namespace. A run then imports the stock module and calls
its own ``train(args)``. Every stock flag keeps its meaning; without
``--algo.advantage.estimator lpo|maxrl`` nothing is patched.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import importlib
import importlib.util
import sys
from typing import Callable, List, Optional
from unittest import mock

from openrlhf_lpo.cli import flags as _flags
from openrlhf_lpo.core.training_backends import backend_of
from openrlhf_lpo.upstream import ContractBroken, params, patch_point  # (the standard library alone)

__all__ = ["main", "build_parser_and_parse", "get_parser", "STOCK_CLI", "PLUGIN_MODULES"]

STOCK_CLI = "openrlhf.cli.train_ppo_ray"
ESTIMATOR_DEST = "algo.advantage.estimator"

# Modules that register more flag groups (imported if present; owned by other engineers).
PLUGIN_MODULES = ("openrlhf_lpo.cpu.mode", "openrlhf_lpo.megatron.flags", "openrlhf_lpo.megatron.colocation_memory",
                  "openrlhf_lpo.megatron.host_memory", "openrlhf_lpo.cli.preflight", "openrlhf_lpo.megatron.preflight", "openrlhf_lpo.cli.policy_loss_types")


def _load_plugins() -> None:
    for name in PLUGIN_MODULES:
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            spec = None
        if spec is not None:
            importlib.import_module(name)


class _Namespace(dict):
    """Module namespace for exec: writes go through to the globals, ``train`` resolves to ours."""

    def __init__(self, globals_: dict, train_override: Callable):
        super().__init__()
        self._g = globals_
        self._train = train_override

    def __getitem__(self, key):
        if key == "train":
            return self._train
        return dict.__getitem__(self, key)

    def __setitem__(self, key, value):
        self._g[key] = value
        dict.__setitem__(self, key, value)

    def __delitem__(self, key):
        self._g.pop(key, None)
        dict.__delitem__(self, key)


def _extend_parser(parser: argparse.ArgumentParser) -> None:
    actions = [a for a in parser._actions if a.dest == ESTIMATOR_DEST]
    if len(actions) != 1 or actions[0].choices is None:
        raise RuntimeError(
            f"openrlhf's parser has no --{ESTIMATOR_DEST} with choices; this openrlhf_lpo release "
            "supports openrlhf==0.11.2 only"
        )
    action = actions[0]
    extra = [e for g in _flags.flag_groups() for e in g.estimators]
    action.choices = list(action.choices) + [e for e in extra if e not in action.choices]
    for group in _flags.flag_groups():
        group.add_arguments(parser)


# The stock CLI's module-level imports that only its train() uses: a parse-only run (flag errors, --dry-run, the
# supervisor of --ckpt.auto_resume) skips them (Ray, DeepSpeed, vLLM: about 15 s of imports per process).
TRAIN_ONLY_IMPORTS = ("ray", "openrlhf.trainer", "openrlhf.utils")


def _train_only_import(node) -> bool:
    import ast

    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
    else:
        return False
    return all(any(n == m or n.startswith(m + ".") for m in TRAIN_ONLY_IMPORTS) for n in names)


def _stock_code(spec):
    """The stock CLI compiled from its source without :data:`TRAIN_ONLY_IMPORTS` (its statements otherwise
    unchanged, the file name kept for tracebacks; contract ``stock-cli-parse-only``)."""
    import ast

    tree = ast.parse(spec.loader.get_source(STOCK_CLI), spec.origin)
    tree.body = [node for node in tree.body if not _train_only_import(node)]
    return compile(tree, spec.origin, "exec", dont_inherit=True)


def _require_a_reward(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> None:
    """A run without a reward source is a flag error: the stock 0.11.2 CLI would go on to split the missing
    reward model's path (AttributeError) or train against nothing."""
    if not any(getattr(parsed, key, None) for key in ("reward.remote_url", "reward.model_name_or_path",
                                                      "train.agent_func_path")):
        parser.error("no reward: give --reward.remote_url (a reward-function .py file or an HTTP URL, e.g. "
                     "openrlhf_lpo/rewards/reward_func.py), --reward.model_name_or_path (a reward model) or "
                     "--train.agent_func_path (an agent script)")


def _run_stock(argv: Optional[List[str]], on_args: Callable[[argparse.Namespace], object]):
    """Execute the stock CLI's ``__main__`` block with our hooks (parse and validate only); return ``on_args``'
    result on the validated namespace."""
    _load_plugins()
    spec = importlib.util.find_spec(STOCK_CLI)
    code = _stock_code(spec)
    state = {"parser": None}
    original_parse_args = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        if state["parser"] is None and any(a.dest == ESTIMATOR_DEST for a in self._actions):
            state["parser"] = self
            _extend_parser(self)
            args = list(argv) if argv is not None else args
            parsed = original_parse_args(self, args, namespace)
            _require_a_reward(self, parsed)
            return parsed
        return original_parse_args(self, args, namespace)

    result = {}

    def train_override(args):
        state["validated"] = True  # past the stock checks: an AssertionError from here on is a runtime fault
        parser = state["parser"]
        for group in _flags.flag_groups(args):  # those of every run and of its --backend
            if group.validate is not None:
                try:
                    group.validate(args)
                except _flags.FlagError as e:
                    parser.error(str(e))
        result["value"] = on_args(args)

    g = {
        "__name__": "__main__",
        "__file__": spec.origin,
        "__package__": STOCK_CLI.rpartition(".")[0],
        "__builtins__": builtins,
        "__spec__": None,
    }
    ns = _Namespace(g, train_override)
    saved_argv = sys.argv
    sys.argv = [spec.origin] + (list(argv) if argv is not None else sys.argv[1:])
    try:
        with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args):
            exec(code, g, ns)
    except AssertionError as e:  # the stock CLI validates its flags with asserts: a flag error, not a crash
        if state["parser"] is None or state.get("validated"):
            raise
        state["parser"].error(stock_assertion_message(str(e)))
    finally:
        sys.argv = saved_argv
    if "value" not in result:
        raise RuntimeError(f"{STOCK_CLI} did not reach train(args); was its __main__ block changed?")
    return result["value"]


# flags the stock 0.11.2 messages still call by their pre-0.11 flat names
_FLAT_NAMES = {"--packing_samples": "--ds.packing_samples", "--advantage_estimator": "--algo.advantage.estimator"}


def stock_assertion_message(message: str) -> str:
    """A stock validation assert as a flag error, with today's spelling of the flags it names."""
    for flat, dotted in _FLAT_NAMES.items():
        message = message.replace(f"{flat} ", f"{dotted} ").replace(f"{flat}.", f"{dotted}.")
    return f"openrlhf 0.11.2 refuses this combination of flags: {message or '(its assertion gives no message)'}"


class _ParserCaptured(Exception):
    def __init__(self, parser):
        super().__init__("parser captured")
        self.parser = parser


def get_parser(extended: bool = True) -> argparse.ArgumentParser:
    """The parser the stock CLI builds (plus every flag group's flags when ``extended``)."""
    _load_plugins()
    spec = importlib.util.find_spec(STOCK_CLI)
    code = _stock_code(spec)
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        if any(a.dest == ESTIMATOR_DEST for a in self._actions):
            if extended:
                _extend_parser(self)
            raise _ParserCaptured(self)
        return original(self, args, namespace)

    g = {"__name__": "__main__", "__file__": spec.origin, "__package__": "openrlhf.cli", "__builtins__": builtins}
    try:
        with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
            exec(code, g, _Namespace(g, lambda args: None))
    except _ParserCaptured as captured:
        return captured.parser
    raise RuntimeError(f"{STOCK_CLI} built no parser with --{ESTIMATOR_DEST}")


# ----------------------------------------------------------------------------- the runner's patch points
# (registered in openrlhf_lpo.upstream's registry; lpo-train checks them with every other point before a run)


def _stock_main_block():
    """The stock CLI's parsed source (the file ``_run_stock`` compiles, read through the same loader; not
    imported) and its ``if __name__ == "__main__":`` block."""
    import ast

    spec = importlib.util.find_spec(STOCK_CLI)
    source = spec.loader.get_source(STOCK_CLI) if spec is not None else None
    if not source:
        raise ContractBroken(f"{STOCK_CLI} has no Python source to execute")
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and \
                isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__":
            return tree, node
    raise ContractBroken(f'{STOCK_CLI} has no `if __name__ == "__main__":` block')


def _calls_in(block, match) -> list:
    import ast

    return [n for n in ast.walk(block) if isinstance(n, ast.Call) and match(n)]


@patch_point("stock-cli-parse-args", "argparse", "ArgumentParser.parse_args", "scoped-swap",
             "_run_stock / get_parser execute openrlhf.cli.train_ppo_ray's source as __main__ with parse_args "
             "wrapped: the first parser with --algo.advantage.estimator gets the lpo/maxrl choices and every flag "
             "group's flags (parser._actions), then parses lpo-train's argv (get_parser captures the parser)")
def _stock_parse_args_contract() -> None:
    import ast

    if params(argparse.ArgumentParser.parse_args) != ["self", "args", "namespace"]:
        raise ContractBroken(f"ArgumentParser.parse_args{params(argparse.ArgumentParser.parse_args)} changed")
    probe = argparse.ArgumentParser(add_help=False)
    action = probe.add_argument("--probe.option", choices=["a"])
    if getattr(probe, "_actions", None) != [action] or action.dest != "probe.option" or action.choices != ["a"]:
        raise ContractBroken("argparse's parser._actions / action.dest / action.choices changed")
    _, block = _stock_main_block()
    if not _calls_in(block, lambda c: isinstance(c.func, ast.Attribute) and c.func.attr == "ArgumentParser"):
        raise ContractBroken("the __main__ block no longer builds argparse.ArgumentParser()")
    parses = _calls_in(block, lambda c: isinstance(c.func, ast.Attribute) and c.func.attr == "parse_args")
    if len(parses) != 1 or parses[0].args or parses[0].keywords:
        raise ContractBroken("the __main__ block no longer calls parser.parse_args() once, without arguments")
    options = _calls_in(block, lambda c: isinstance(c.func, ast.Attribute) and c.func.attr == "add_argument" and
                        c.args and isinstance(c.args[0], ast.Constant) and c.args[0].value == f"--{ESTIMATOR_DEST}")
    if len(options) != 1 or not any(k.arg == "choices" and isinstance(k.value, ast.List) for k in options[0].keywords):
        raise ContractBroken(f"the __main__ block no longer adds --{ESTIMATOR_DEST} with a list of choices")


@patch_point("stock-cli-train", STOCK_CLI, "train", "scoped-swap",
             "the __main__ block's train(args), after the stock validation, resolves through the exec namespace "
             "(_Namespace) to ours: the flag groups' validation and the namespace's return; a run then imports the "
             "module and calls its train(args) (read from the file: the contract imports nothing)",
             imports=False)
def _stock_train_contract() -> None:
    import ast

    tree, block = _stock_main_block()
    train = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train"), None)
    if train is None or [a.arg for a in train.args.args] != ["args"] or train.args.vararg or train.args.kwonlyargs:
        raise ContractBroken(f"{STOCK_CLI}.train(args) changed")
    calls = _calls_in(block, lambda c: isinstance(c.func, ast.Name) and c.func.id == "train")
    if len(calls) != 1 or [ast.unparse(a) for a in calls[0].args] != ["args"] or calls[0].keywords:
        raise ContractBroken("the __main__ block no longer calls train(args)")
    parse = _calls_in(block, lambda c: isinstance(c.func, ast.Attribute) and c.func.attr == "parse_args")
    if not parse or parse[0].lineno > calls[0].lineno:
        raise ContractBroken("the __main__ block no longer parses its flags before train(args)")


@patch_point("stock-cli-parse-only", STOCK_CLI, "module-level imports", "scoped-swap",
             "parsing (build_parser_and_parse, get_parser, lpo-train before anything runs) executes the stock CLI's "
             "source without its module-level imports of ray and openrlhf.trainer/utils: the __main__ block needs "
             "none of them (they are train()'s own names)",
             imports=False)
def _stock_parse_only_contract() -> None:
    import ast

    tree, block = _stock_main_block()
    kept, dropped = set(dir(builtins)) | {"__name__", "__file__"}, set()
    for node in tree.body:
        if _train_only_import(node):
            dropped |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            kept |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            kept.add(node.name)
        elif isinstance(node, ast.Assign):
            kept |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif node.lineno != block.lineno and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            raise ContractBroken(f"{STOCK_CLI} has a module-level statement a parse-only run would execute "
                                 f"without the imports it may need (line {node.lineno})")
    if not dropped:
        raise ContractBroken(f"{STOCK_CLI} no longer imports {TRAIN_ONLY_IMPORTS} at module level")
    bound = {n.id for n in ast.walk(block) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    bound |= {(a.asname or a.name).split(".")[0] for n in ast.walk(block) if isinstance(n, (ast.Import, ast.ImportFrom))
              for a in n.names}
    free = {n.id for n in ast.walk(block) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound
    missing = sorted(free - kept)
    if missing:
        raise ContractBroken(f"the __main__ block of {STOCK_CLI} uses {missing}, which only its skipped imports bind")


def build_parser_and_parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse ``argv`` like ``lpo-train`` would and return the validated hierarchised namespace.

    Runs the stock argument parsing and validation of openrlhf 0.11.2 plus every flag group's
    validation; bad combinations exit with argparse's status 2 and a message naming the flags.
    Starts no Ray, loads no model, imports neither Ray's trainer classes nor DeepSpeed nor vLLM.
    """
    return _run_stock(argv, lambda args: args)


def main(argv: Optional[List[str]] = None) -> None:
    from openrlhf_lpo.demo import cli as demo_cli  # `lpo-train --preset cpu-demo` == `lpo-demo`

    if demo_cli.wants_preset(argv):
        return demo_cli.main(argv)
    from openrlhf_lpo.runtime.progress import install

    install()  # progress bars as plain lines when the output is a file

    # parse-only first (flag errors, --dry-run and the auto-resume supervisor import no trainer, DeepSpeed or vLLM)
    args = _run_stock(argv, lambda parsed: parsed)
    from openrlhf_lpo.cli import auto_resume, plan, preflight

    supervisor = bool(args.ckpt.auto_resume) and not args.dry_run and not auto_resume.is_supervised()
    # a run checks every contract (importing each patched module); a dry run and a supervisor check the version
    # (the supervisor's child checks the contracts when it starts: exit 2, which it does not retry)
    _check_upstream_or_exit("lpo-train --dry-run" if args.dry_run else "lpo-train",
                            full=not (args.dry_run or supervisor), backend=backend_of(args).name)
    if not args.dry_run:
        repaired = auto_resume.repair_before_preflight(args)  # a cut-off save is never what gets resumed
        if repaired:
            print(f"{auto_resume.PREFIX} {repaired}", file=sys.stderr, flush=True)
    # every input checked before Ray or any model starts (exit 2 naming the file, line or field)
    checked = preflight.preflight_or_exit(args, "lpo-train --dry-run" if args.dry_run else "lpo-train")
    if args.dry_run:
        try:
            lines = plan.plan_lines(args, checked)
        except (FileNotFoundError, ValueError) as e:
            print(f"lpo-train --dry-run: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        print("lpo-train --dry-run: flags are valid; nothing was started")
        print("\n".join(lines + [line for line in [auto_resume.plan_line(args)] if line]))
        return
    if supervisor:  # train in a child, restart it if it dies
        raise SystemExit(auto_resume.supervise(list(sys.argv[1:] if argv is None else argv), args))
    if checked is not None:
        print("\n".join(preflight.summary_lines(checked)), flush=True)
    print(plan.method_line(args), flush=True)  # the settings in effect, in the run's log
    stock_train = importlib.import_module(STOCK_CLI).train  # the stock module's own train(args)
    with contextlib.ExitStack() as stack:
        _flags.enter_before_train(stack, args)
        _check_cluster(args, plan)
        # names the stock module imported before the swaps (``PolicyModelActor``) follow them
        patches = sys.modules.get("openrlhf_lpo.openrlhf.patches")
        if patches is not None:
            stack.enter_context(patches.rebind(stock_train.__globals__))
        try:
            stock_train(args)
        except Exception as e:  # noqa: BLE001  (one known stop gets a plain message; the rest re-raise)
            stop = _reward_error_stop(e)
            if stop is None:
                raise
            print(f"lpo-train: {stop}", file=sys.stderr, flush=True)
            raise SystemExit(4) from None


def _check_upstream_or_exit(prog: str, full: bool = True, backend: str = "") -> None:
    """The installed OpenRLHF is the version our patch points are written for and (``full``: a run, not a dry
    run, which imports every patched module) every contract of the run holds (signatures, the source lines a swap
    relies on): the points of every run, then those of ``backend`` (``--backend megatron``: megatron-core's and the
    policy group's, megatron/patch_points.py); else exit 2 naming the version or the broken contract."""
    from openrlhf_lpo import upstream
    from openrlhf_lpo.openrlhf import patches  # noqa: F401  (registers the DeepSpeed backend's points)

    try:
        if full:
            # the CPU mode's process-wide patches are checked when it turns on (cpu/mode.py, _cpu_before_train)
            upstream.check_contracts(exclude_kinds=("process-swap",), backends=("",))
            upstream.check_contracts(backends=(backend,)) if backend else None
        else:
            upstream.check_version()
    except RuntimeError as e:
        print(f"{prog}: {e}; openrlhf-lpo extends openrlhf {upstream.OPENRLHF_VERSION} (and megatron-core "
              f"{upstream.MEGATRON_CORE_VERSION} for --backend megatron) only: install it with pip install "
              f"openrlhf=={upstream.OPENRLHF_VERSION} (setup.py pins them)", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _reward_error_stop(exc: BaseException):
    """The message of a ``RewardErrorsPersist`` raised in the trainer (through Ray's ``RayTaskError``), or None."""
    from openrlhf_lpo.rewards.reward_errors import RewardErrorsPersist

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        cause = getattr(exc, "cause", None)  # ray.exceptions.RayTaskError keeps the remote exception here
        if type(exc) is RewardErrorsPersist or (isinstance(cause, RewardErrorsPersist)):
            return str(cause if isinstance(cause, RewardErrorsPersist) else exc)
        exc = cause if isinstance(cause, BaseException) else exc.__cause__
    return None


def _check_cluster(args, plan) -> None:
    """Join (or start) Ray as the stock ``train()`` would, then, before any actor starts: the layout fits the
    cluster (a restart of ``--ckpt.auto_resume`` waits for the GPUs: ``cli/capacity.py``; exit 5), every node
    sees ``--ckpt.path`` (``cli/shared_storage.py``; exit 2) and every GPU node can load DeepSpeed's optimizer
    op (``cli/gpu_build.py``; exit 3)."""
    import os

    import ray

    if not ray.is_initialized():  # the stock train() would call ray.init() with these env vars
        ray.init(runtime_env={
            "env_vars": {
                "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "true"),
                "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
                "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1"),
            },
            "worker_process_setup_hook": "openrlhf_lpo.runtime.progress.worker_setup",  # plain progress lines in logs
        })
    from openrlhf_lpo.cli import capacity, gpu_build, shared_storage

    try:
        capacity.check_or_wait(args)
    except plan.ClusterTooSmall as e:
        print(f"lpo-train: {e}", file=sys.stderr, flush=True)
        raise SystemExit(capacity.EXIT_CLUSTER_TOO_SMALL) from None
    shared_storage.check_or_exit(args)  # exit 2 naming the nodes that do not see --ckpt.path
    gpu_build.check_run_or_exit(args)  # exit 3 naming what a node lacks; skipped in CPU mode


if __name__ == "__main__":
    main()
