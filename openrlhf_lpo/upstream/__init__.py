"""Patch points: every place where openrlhf_lpo touches the packages it extends, in one registry.

Public names (stable):
    OPENRLHF_VERSION         "0.11.2", the OpenRLHF version the points are written for (check_version)
    MEGATRON_CORE_VERSION    "0.16.1", the megatron-core version the Megatron backend's points are written for
    PATCH_POINTS             the registry: every PatchPoint(name, module, attribute, kind, why, contract), in the
                             order check_contracts checks them; ``attribute`` is a dotted path in ``module``, or
                             several separated by commas
    KINDS                    what a point does to ``module.attribute`` (see below)
    register_patch_point(p)  add a point (a name is registered once: a second point under a taken name is refused)
    patch_point(...)         the decorator form: the decorated function is the new point's contract
    registered(name)         the point registered under ``name``
    ContractBroken           what a contract raises: what of upstream no longer holds
    check_version()          RuntimeError when the installed openrlhf is another version
    check_point(point)       one point; RuntimeError "patch point <name>: ..." if it no longer holds
    check_contracts(kinds=None, exclude_kinds=(), backends=None)
                             every selected point, in registration order; returns notes on the points left
                             unchecked because an optional package is not installed
    params, ray_class, module_file, installed, module_source, needles, source_tree, definition, calls:
                             the helpers contracts are written with

Kinds:
    "swap"          replaced while ``openrlhf.patches.apply_patches(lpo)`` is active
    "scoped-swap"   replaced inside one call (or one run) by ours (a subclass, a wrapper, a name resolved to ours)
    "contract"      read, called, subclassed or given attributes as-is: we rely on its behaviour
    "process-swap"  replaced for the rest of the process, never restored (the CPU mode; the Megatron actor's RoPE)
    "stand-in"      ours stands where upstream's would be when its dependency is absent (checks/trainer_check.py)

``PatchPoint.backend`` names the training backend whose runs rely on the point ("" for every run):
``lpo-train`` checks the points of every run and those of the run's ``--backend`` before it starts
(cli/train_ppo_ray.py); the CPU mode checks its process-wide points when it turns on (cpu/mode.py).

Who registers: each room that patches, when imported: ``openrlhf.patches`` (the DeepSpeed backend's OpenRLHF
points), ``megatron.patch_points`` (the Megatron backend's), ``cpu.mode`` and ``cpu.megatron_redirect`` (the CPU
mode's), ``cli.train_ppo_ray`` (the stock-CLI runner's), ``checks.trainer_check`` (its stand-ins). A contract
checks without a GPU and changes nothing: it looks attributes up, reads signatures and source (a module whose
import has effects or needs an optional package is read from its file, not imported: ``imports=False``); a point
whose ``requires`` package is absent is reported "not installed" instead of failing.

This leaf imports the standard library and the registry leaf only, so every room may register here
(tests/core/test_product_rules.py). The contract test: tests/openrlhf/test_lpo_patches_contract.py (every point, and
a changed upstream per point).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Collection, Dict, Iterable, List, Optional, Sequence, Tuple

from openrlhf_lpo.registry import lookup, register_unique

__all__ = ["OPENRLHF_VERSION", "MEGATRON_CORE_VERSION", "KINDS", "PatchPoint", "PATCH_POINTS", "ContractBroken",
           "register_patch_point", "patch_point", "registered", "check_version", "check_point", "check_contracts",
           "params", "ray_class", "module_file", "installed", "module_source", "needles", "source_tree", "definition",
           "calls"]

OPENRLHF_VERSION = "0.11.2"
MEGATRON_CORE_VERSION = "0.16.1"

KINDS = ("swap", "scoped-swap", "contract", "process-swap", "stand-in")


class ContractBroken(RuntimeError):
    """Raised by a contract: what of upstream no longer holds (check_contracts names the point)."""


@dataclass(frozen=True)
class PatchPoint:
    name: str
    module: str
    attribute: str
    kind: str
    why: str
    # () -> None (holds) or a note; raises ContractBroken. None: the attributes exist, nothing more
    contract: Optional[Callable[[], Optional[str]]] = field(default=None, compare=False, repr=False)
    requires: str = ""  # an optional package (e.g. "megatron.core", "vllm"): absent, the point is "not installed"
    imports: bool = True  # look module.attribute up first (False: the contract reads the module's file instead)
    backend: str = ""  # the training backend whose runs rely on it ("": every run)

    def attributes(self) -> List[str]:
        return [a.strip() for a in self.attribute.split(",") if a.strip()]


PATCH_POINTS: List[PatchPoint] = []
_BY_NAME: Dict[str, PatchPoint] = {}


def _code_of(fn) -> Tuple[Optional[str], Optional[str]]:
    return getattr(fn, "__qualname__", None), getattr(getattr(fn, "__code__", None), "co_filename", None)


def register_patch_point(point: PatchPoint) -> PatchPoint:
    """Add ``point`` to the registry; ``ValueError`` for an unknown kind or a name already registered by another
    point. The same definition again (its module executed twice: ``python -m`` runs it as ``__main__``, and an
    import may load it under its own name) keeps the first."""
    if point.kind not in KINDS:
        raise ValueError(f"patch point {point.name!r}: kind {point.kind!r} is not one of {', '.join(KINDS)}")
    old = _BY_NAME.get(point.name)
    if old is not None and old == point and _code_of(old.contract) == _code_of(point.contract):
        return old
    register_unique(_BY_NAME, "patch point", point.name, point)
    PATCH_POINTS.append(point)
    return point


def patch_point(name: str, module: str, attribute: str, kind: str, why: str, *, requires: str = "",
                imports: bool = True, backend: str = "") -> Callable:
    """``@patch_point(name, module, attribute, kind, why)`` over a function registers the point with that function
    as its contract and returns the function unchanged."""

    def deco(contract: Callable[[], Optional[str]]):
        register_patch_point(PatchPoint(name, module, attribute, kind, why, contract=contract, requires=requires,
                                        imports=imports, backend=backend))
        return contract

    return deco


def registered(name: str) -> PatchPoint:
    """The point registered under ``name``; ``ValueError`` listing the registered names if none is."""
    return lookup(_BY_NAME, "patch point", name)


# ----------------------------------------------------------------------------- helpers for contracts


def _resolve(module: str, attribute: str):
    obj = importlib.import_module(module)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


def params(fn) -> List[str]:
    """Parameter names of ``fn`` (Ray's actor decorator adds a tracing parameter to the methods of classes it
    wraps: left out)."""
    return [p for p in inspect.signature(fn).parameters if p != "_ray_trace_ctx"]


def ray_class(cls):
    """The class behind a Ray actor class (``ray.remote(C)`` keeps ``C`` as ``__ray_actor_class__``); ``cls``
    itself if it is a plain class."""
    return getattr(cls, "__ray_actor_class__", cls)


def module_file(name: str) -> Optional[Path]:
    """The source file of module ``name`` without importing it or its parent packages (None: not installed)."""
    top, *rest = name.split(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: imports nothing
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if not rest:
        return Path(spec.origin) if spec.has_location and spec.origin else None
    for location in spec.submodule_search_locations or ():
        base = Path(location, *rest)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def installed(name: str) -> bool:
    """Whether module ``name`` is imported or importable (found without importing it)."""
    return name in sys.modules or module_file(name) is not None


def module_source(name: str) -> str:
    """The source of module ``name``: through ``inspect`` if it is imported, else read from its file (a check
    that imports nothing)."""
    module = sys.modules.get(name)
    if module is not None:
        return inspect.getsource(module)
    path = module_file(name)
    if path is None:
        raise ContractBroken(f"{name} is not installed")
    return path.read_text()


def needles(source: str, wanted: Iterable[str], what: str) -> None:
    """ContractBroken ``"<what> no longer has '<needle>'"`` for the first of ``wanted`` missing from ``source``."""
    for needle in wanted:
        if needle not in source:
            raise ContractBroken(f"{what} no longer has {needle!r}")


def source_tree(module: str) -> ast.Module:
    """The parsed source of ``module`` (:func:`module_source`: read from its file when it is not imported)."""
    return ast.parse(module_source(module))


def definition(tree: ast.AST, dotted: str):
    """The ``def`` / ``class`` node named ``dotted`` ("func", "Class", "Class.method") at the top of ``tree``;
    ContractBroken if there is none."""
    node = tree
    for part in dotted.split("."):
        node = next((n for n in getattr(node, "body", ()) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                             ast.ClassDef)) and n.name == part), None)
        if node is None:
            raise ContractBroken(f"{dotted} is no longer defined")
    return node


def calls(node: ast.AST, name: str) -> List[ast.Call]:
    """The calls of ``name`` (``name(...)`` or ``x.name(...)``) anywhere under ``node``, in source order."""
    found = [c for c in ast.walk(node) if isinstance(c, ast.Call) and (
        (isinstance(c.func, ast.Name) and c.func.id == name) or
        (isinstance(c.func, ast.Attribute) and c.func.attr == name))]
    return sorted(found, key=lambda c: (c.lineno, c.col_offset))


# ----------------------------------------------------------------------------- the checks


def check_version() -> None:
    """Raise RuntimeError when the installed openrlhf is not the version the patch points are written for."""
    version = getattr(importlib.import_module("openrlhf"), "__version__", None)
    if version is None:
        from importlib.metadata import version as _v

        version = _v("openrlhf")
    if version != OPENRLHF_VERSION:
        raise RuntimeError(f"openrlhf {version} installed; openrlhf_lpo's patch points are for {OPENRLHF_VERSION}")


def check_point(point: PatchPoint) -> Optional[str]:
    """Check one point: its ``requires`` package is installed (else a "not installed" note), its attributes exist
    (``imports``), its contract holds; RuntimeError ``patch point <name>: ...`` if not."""
    if point.requires and not installed(point.requires):
        return f"{point.requires} not installed: not checked"
    if point.imports:
        for attribute in point.attributes():
            try:
                _resolve(point.module, attribute)
            except (ImportError, AttributeError) as e:
                raise RuntimeError(f"patch point {point.name}: {point.module}.{attribute} is missing ({e})") from e
    if point.contract is None:
        return None
    try:
        return point.contract()
    except ContractBroken as e:
        raise RuntimeError(f"patch point {point.name}: {e}") from None
    except (ImportError, AttributeError, OSError, SyntaxError, TypeError, ValueError) as e:
        raise RuntimeError(f"patch point {point.name}: {type(e).__name__}: {e}") from e


def check_contracts(kinds: Optional[Sequence[str]] = None, exclude_kinds: Sequence[str] = (),
                    backends: Optional[Collection[str]] = None) -> List[str]:
    """Raise RuntimeError naming the first registered patch point (in registration order) that does not match the
    installed packages; return ``"<name>: <note>"`` for each point not checked (an optional package that is not
    installed). ``kinds`` / ``exclude_kinds`` select points by kind, ``backends`` by ``PatchPoint.backend`` ("" the
    points of every run; None: all)."""
    check_version()
    notes = []
    for point in list(PATCH_POINTS):
        if (kinds is not None and point.kind not in kinds) or point.kind in exclude_kinds or \
                (backends is not None and point.backend not in backends):
            continue
        note = check_point(point)
        if note:
            notes.append(f"{point.name}: {note}")
    return notes
