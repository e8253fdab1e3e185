"""Preflight check ``checkpoint``: where the run writes, and what ``--ckpt.load_enable`` would resume.

* ``--ckpt.path`` and ``--ckpt.output_dir`` are (or can be created as) writable folders, and their
  filesystems have the free space the run needs (:mod:`openrlhf_lpo.cli.disk`: checkpoints, Hugging Face
  exports, the final model; old training checkpoints in ``--ckpt.path/_actor``, which rotation deletes,
  count as free). Nothing is created here.
* ``--ckpt.load_enable`` with ``--ckpt.path/_actor`` present: the checkpoint ``latest`` names must be one
  this run can load:

  - written by the same backend (a Megatron checkpoint has ``meta.json``, a DeepSpeed one
    ``*_model_states.pt`` / ``*_optim_states.pt``);
  - Megatron (registered by :mod:`openrlhf_lpo.megatron.preflight`): the checkpoint format this release
    reads and the same model; any TP / PP / DP layout resumes (the checkpoint is layout-free);
  - DeepSpeed: the same ZeRO partitioning (data-parallel size and ZeRO-3 or not: DeepSpeed 0.19 refuses
    to repartition optimizer states) unless ``--ds.use_universal_ckpt`` with a converted
    ``latest_universal``; and the same model when the parameter shapes can be read without unpickling
    objects (``torch.load(weights_only=True, mmap=True)``).

  No ``_actor`` folder, or one without ``latest``: the run starts at step 0 (said in the summary).

Formats are a registry (:func:`register_resume_format`): each backend says how its checkpoint is
recognised and what it checks.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import zipfile
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

from openrlhf_lpo.cli.preflight import PreflightError, register_check
from openrlhf_lpo.core.training_backends import backend_of
from openrlhf_lpo.registry import register_unique

_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")
_ZERO3_MODEL = re.compile(r"^zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _existing_ancestor(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _writable(flag: str, path: str) -> str:
    """The folder whose filesystem ``path`` will be on (raises if it cannot be created or written)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise PreflightError(f"{flag} {path}: exists and is not a folder")
    anchor = _existing_ancestor(path)
    if not os.path.isdir(anchor):
        raise PreflightError(f"{flag} {path}: cannot be created: {anchor} is a file, not a folder")
    if not os.access(anchor, os.W_OK | os.X_OK):
        raise PreflightError(f"{flag} {path}: {anchor} is not writable by this user; choose another path")
    return anchor


def _used(path: str) -> int:
    if not os.path.isdir(path):
        return 0
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files
               if not os.path.islink(os.path.join(d, f)))


def _check_disk(ctx, anchors: dict) -> None:
    from openrlhf_lpo.cli.disk import human_size, run_disk_need

    args = ctx.args
    params = getattr(ctx.model, "params", None)
    if not params:
        ctx.say("disk: not estimated (the model's size is unknown here)")
        return
    rows = ctx.train_rows
    batches = None
    if rows is not None:
        batches = -(-rows // args.rollout.batch_size) * args.train.num_episodes
    need = run_disk_need(args, params, batches)
    by_device: dict = {}
    for flag, path in (("--ckpt.path", args.ckpt.path), ("--ckpt.output_dir", args.ckpt.output_dir)):
        dev = os.stat(anchors[flag]).st_dev
        entry = by_device.setdefault(dev, {"anchor": anchors[flag], "need": 0, "flags": [], "reuse": 0})
        if path in entry["flags"]:
            continue
        entry["flags"].append(path)
        entry["need"] += need.bytes_under(path)
        if flag == "--ckpt.path":  # old training checkpoints are rotated away (old exports too; not counted: conservative)
            entry["reuse"] += _used(os.path.join(path, "_actor"))
    ctx.say("disk: " + "; ".join(f"{what} in {where}" for what, _, where in need.parts))
    for entry in by_device.values():
        free = shutil.disk_usage(entry["anchor"]).free
        if entry["need"] > free + entry["reuse"]:
            raise PreflightError(
                f"--ckpt.path / --ckpt.output_dir: {' and '.join(entry['flags'])} need about {human_size(entry['need'])} "
                f"({'; '.join(w for w, _, d in need.parts if d in entry['flags'])}) but {entry['anchor']} has "
                f"{human_size(free)} free (+{human_size(entry['reuse'])} of old checkpoints under --ckpt.path/_actor). "
                "Free space, "
                "choose another path, or lower --ckpt.max_num / raise --ckpt.save_steps / drop --ckpt.save_hf")
        ctx.say(f"  {entry['anchor']}: {human_size(free)} free, the run needs about {human_size(entry['need'])}")


# ----------------------------------------------------------------------------- resume


def _latest(root: str, name: str) -> Optional[str]:
    path = os.path.join(root, name)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read().strip() or None


@dataclass(frozen=True)
class ResumeFormat:
    """How a backend's checkpoint is recognised and checked before a resume."""

    backend: str                                      # the --backend that writes and reads it
    detect: Callable[[str], bool]                     # tag folder -> written in this format?
    check: Callable[[Any, str, str], None]            # (ctx, root, tag folder): PreflightError or ctx.say
    incomplete: Optional[Callable[[str, Any], Optional[str]]] = None  # (tag folder, args) -> why it cannot load


RESUME_FORMATS: Dict[str, ResumeFormat] = {}


def register_resume_format(fmt: ResumeFormat) -> ResumeFormat:
    """Register a backend's checkpoint format (the Megatron backend registers its own)."""
    return register_unique(RESUME_FORMATS, "resume format of backend", fmt.backend, fmt)


def _model_shapes(tag_dir: str):
    """name -> shape of the checkpoint's parameters, read without unpickling objects, or None."""
    files = sorted(glob.glob(os.path.join(tag_dir, "mp_rank_*_model_states.pt")) or
                   glob.glob(os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_*_model_states.pt")))
    if not files:
        return None
    import torch

    try:
        state = torch.load(files[0], map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - objects the restricted unpickler refuses: the shapes stay unknown
        return None
    shapes = {}
    for group in state.get("param_shapes") or []:
        shapes.update({k: tuple(v) for k, v in dict(group).items()})
    return shapes or None


def _check_same_model(ctx, tag_dir: str) -> None:
    config = getattr(ctx.model, "config", None)
    if config is None:
        return
    shapes = _model_shapes(tag_dir)
    if shapes is None:
        ctx.say("  (the checkpoint's parameter shapes could not be read without unpickling: model not compared)")
        return
    text = ctx.model.text_config
    embed = next((s for n, s in shapes.items() if n.endswith("embed_tokens.weight")), None)
    layers = {int(m.group(1)) for n in shapes for m in [_LAYER.search(n)] if m and "visual" not in n}
    found = {}
    if embed is not None and len(embed) == 2:
        found.update(vocab_size=embed[0], hidden_size=embed[1])
    if layers:
        found["num_hidden_layers"] = max(layers) + 1
    for key, value in found.items():
        mine = text.get(key)
        if mine is not None and int(mine) != int(value):
            raise PreflightError(f"--ckpt.load_enable: {tag_dir} was written for {key}={value}, but "
                                 f"--actor.model_name_or_path {ctx.model.name} has {key}={mine}: the checkpoint is "
                                 "from another model; use that model, or a new --ckpt.path")


def _check_deepspeed(ctx, root: str, tag_dir: str) -> None:
    args = ctx.args
    from openrlhf_lpo.core.config import dp_size

    names = os.listdir(tag_dir)
    ranks = {int(m.group(1)) for n in names for m in [_OPTIM.match(n)] if m}
    zero3 = any(_ZERO3_MODEL.match(n) for n in names)
    if args.ds.use_universal_ckpt:
        tag = _latest(root, "latest_universal")
        if tag is None or not os.path.isdir(os.path.join(root, tag)):
            raise PreflightError(
                f"--ds.use_universal_ckpt: {root}/latest_universal is missing (or names no folder): convert the "
                f"checkpoint first (python -m deepspeed.checkpoint.ds_to_universal --input_folder {tag_dir} "
                f"--output_folder {tag_dir}_universal) and write its folder name to {root}/latest_universal")
        ctx.say(f"resume: {os.path.join(root, tag)} (DeepSpeed universal checkpoint: any layout)")
        return
    dp = dp_size(args)
    if ranks and len(ranks) != dp:
        raise PreflightError(
            f"--ckpt.load_enable: {tag_dir} was written by {len(ranks)} data-parallel ranks, this run has {dp} "
            "(--actor.num_nodes x --actor.num_gpus_per_node / ring / TP); DeepSpeed cannot repartition ZeRO optimizer "
            f"states: resume with {len(ranks)} ranks, or convert it (python -m deepspeed.checkpoint.ds_to_universal) "
            "and add --ds.use_universal_ckpt")
    if zero3 != (args.ds.zero_stage == 3):
        was = "ZeRO-3" if zero3 else "ZeRO-1/2"
        raise PreflightError(
            f"--ckpt.load_enable: {tag_dir} was written with {was}, this run uses --ds.zero_stage {args.ds.zero_stage}; "
            "ZeRO checkpoints do not load across stage 3 and 1/2: use the stage it was written with, or convert it "
            "(ds_to_universal) and add --ds.use_universal_ckpt")
    _check_same_model(ctx, tag_dir)
    ctx.say(f"resume: {tag_dir} (DeepSpeed, {len(ranks) or '?'} data-parallel ranks, "
            f"{'ZeRO-3' if zero3 else 'ZeRO-1/2'})")


def _check_resume(ctx) -> None:
    args = ctx.args
    root = os.path.join(args.ckpt.path, "_actor")
    if not os.path.isdir(root):
        ctx.say(f"resume: no checkpoint under {root} yet: the run starts at step 0")
        return
    tag = _latest(root, "latest")
    if tag is None:
        ctx.say(f"resume: {root} has no 'latest' file: the run starts at step 0")
        return
    tag_dir = os.path.join(root, tag)
    if not os.path.isdir(tag_dir):
        raise PreflightError(f"--ckpt.load_enable: {root}/latest names {tag!r} but {tag_dir} does not exist (deleted?); "
                             "write an existing global_step folder's name into latest, or start fresh")
    written = next((f.backend for f in RESUME_FORMATS.values() if f.detect(tag_dir)), None)
    backend = backend_of(args).name
    if written is None:
        raise PreflightError(f"--ckpt.load_enable: {tag_dir} holds neither a Megatron (meta.json) nor a DeepSpeed "
                             "(*_model_states.pt) checkpoint; it is incomplete: point latest at an earlier one")
    if written != backend:
        raise PreflightError(
            f"--ckpt.load_enable: {tag_dir} is a {written} checkpoint but this run uses --backend {backend}; "
            f"checkpoints do not convert between backends: resume with --backend {written}, or start fresh with a new "
            "--ckpt.path (or without --ckpt.load_enable; the Hugging Face export global_stepN_hf can be the new "
            "--actor.model_name_or_path)")
    RESUME_FORMATS[written].check(ctx, root, tag_dir)


def _is_deepspeed(tag_dir: str) -> bool:
    return any(n.endswith("_model_states.pt") or _OPTIM.match(n) for n in os.listdir(tag_dir))


def _torch_file_intact(path: str) -> bool:
    """A ``torch.save`` file is a zip whose directory is written last: a file cut off mid-write has none."""
    try:
        with zipfile.ZipFile(path) as z:
            return bool(z.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def deepspeed_incomplete(tag_dir: str, args) -> Optional[str]:
    """Why the DeepSpeed checkpoint ``tag_dir`` cannot be loaded whole (None: every file is there and intact).

    Every data-parallel rank of this run wrote its optimizer states (ZeRO-3: and its model states), rank 0 the
    model states, and no ``.pt`` file was cut off (its zip directory is readable)."""
    from openrlhf_lpo.core.config import dp_size

    names = os.listdir(tag_dir)
    if not any(n.endswith("_model_states.pt") for n in names):
        return "no *_model_states.pt"
    dp = dp_size(args)
    ranks = sorted(int(m.group(1)) for n in names for m in [_OPTIM.match(n)] if m)
    if not getattr(args.ds, "use_universal_ckpt", False) and ranks != list(range(dp)):
        return f"optimizer states of ranks {ranks}, this run has {dp} data-parallel ranks"
    if any(_ZERO3_MODEL.match(n) for n in names):
        zero3 = sorted(int(n.split("_")[2]) for n in names if _ZERO3_MODEL.match(n))
        if zero3 != ranks:
            return f"ZeRO-3 model states of ranks {zero3}, optimizer states of ranks {ranks}"
    broken = [n for n in sorted(names) if n.endswith(".pt") and not _torch_file_intact(os.path.join(tag_dir, n))]
    if broken:
        return f"{broken[0]} is cut off (no zip directory)" + (f" and {len(broken) - 1} more" if len(broken) > 1 else "")
    return None


register_resume_format(ResumeFormat("deepspeed", _is_deepspeed, _check_deepspeed, deepspeed_incomplete))


# ----------------------------------------------------------------------------- which checkpoint a restart loads

_STEP_TAG = re.compile(r"^global_step(\d+)$")


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a resume of this run loads (``tag`` None: it starts at step 0)."""

    tag: Optional[str]
    step: int
    note: Optional[str] = None  # what was wrong with ``latest`` and what was done about it


def _write_latest(root: str, tag: Optional[str]) -> None:
    path = os.path.join(root, "latest")
    if tag is None:
        if os.path.exists(path):
            os.remove(path)
        return
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def resume_point(args, repair: bool = True) -> ResumePoint:
    """The last complete checkpoint of ``--ckpt.path``: the one ``latest`` names if it is whole, else the newest
    whole ``global_step*`` folder. A checkpoint cut off by a kill is never loaded: with ``repair``, ``latest`` is
    rewritten (atomically) to name the checkpoint chosen, or removed when none is whole (the run starts at step 0).
    """
    root = os.path.join(args.ckpt.path, "_actor")
    if not os.path.isdir(root):
        return ResumePoint(None, 0)
    fmt = RESUME_FORMATS.get(backend_of(args).name)

    def why_not(tag: str) -> Optional[str]:
        folder = os.path.join(root, tag)
        if not os.path.isdir(folder):
            return "no such folder"
        if fmt is None or not fmt.detect(folder):
            return "not a checkpoint of this backend"
        return fmt.incomplete(folder, args) if fmt.incomplete is not None else None

    def step_of(tag: str) -> int:
        m = _STEP_TAG.match(tag)
        return int(m.group(1)) if m else 0

    named = _latest(root, "latest")
    problem = why_not(named) if named else "latest is missing or empty"
    if problem is None:
        return ResumePoint(named, step_of(named))
    steps = sorted(((int(m.group(1)), n) for n in os.listdir(root) for m in [_STEP_TAG.match(n)] if m), reverse=True)
    choice = next((tag for _, tag in steps if tag != named and why_not(tag) is None), None)
    said = f"{root}/latest names {named!r}: {problem}" if named else f"{root}: {problem}"
    if choice is None and named is None and not steps:
        return ResumePoint(None, 0)
    if repair:
        _write_latest(root, choice)
    if choice is None:
        return ResumePoint(None, 0, f"{said}; no whole checkpoint is left: the run starts at step 0")
    return ResumePoint(choice, step_of(choice), f"{said}; the newest whole checkpoint {choice} is loaded")


@register_check("checkpoint")
def check_checkpoint(ctx) -> None:
    args = ctx.args
    anchors = {"--ckpt.path": _writable("--ckpt.path", args.ckpt.path),
               "--ckpt.output_dir": _writable("--ckpt.output_dir", args.ckpt.output_dir)}
    problems = []
    for step in (_check_disk, _check_resume):
        if step is _check_resume and not args.ckpt.load_enable:
            continue
        try:
            step(ctx, anchors) if step is _check_disk else step(ctx)
        except PreflightError as e:
            problems.append(str(e))
    if problems:
        raise PreflightError("\n".join(problems))
