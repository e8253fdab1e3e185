"""The Megatron backend's part of ``lpo-train``'s preflight: which checkpoints ``--ckpt.load_enable`` resumes.

Registers the Megatron checkpoint format with :mod:`openrlhf_lpo.cli.preflight.checkpoint`: a tag folder
holding ``meta.json`` (:mod:`openrlhf_lpo.megatron.checkpoint`). Before a resume it checks the format
string this release reads and the model: ``meta.json``'s model dims against ``config.json``, with the
loader's own comparison (``checkpoint._check_model``), so the actor never loads weights of another model.
The TP / PP / DP layout it was written in does not matter: the checkpoint is layout-free.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from openrlhf_lpo.cli.preflight import PreflightError
from openrlhf_lpo.cli.preflight.checkpoint import ResumeFormat, register_resume_format
from openrlhf_lpo.megatron import checkpoint as mckpt


def _is_megatron(tag_dir: str) -> bool:
    return os.path.isfile(os.path.join(tag_dir, "meta.json"))


def check_resume(ctx, root: str, tag_dir: str) -> None:
    meta_path = os.path.join(tag_dir, "meta.json")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except ValueError as e:
        raise PreflightError(f"--ckpt.load_enable: {meta_path} is not valid JSON ({e}); the checkpoint is damaged: "
                             "point latest at an earlier global_step, or start fresh") from None
    if meta.get("format") != mckpt.FORMAT:
        raise PreflightError(f"--ckpt.load_enable: {tag_dir} has checkpoint format {meta.get('format')!r}; this "
                             f"release reads {mckpt.FORMAT!r}")
    if getattr(ctx.model, "config", None) is not None:
        text = ctx.model.text_config  # the dims config.json states (the loader also sees class defaults)
        stated = dict(meta, model={k: v for k, v in meta.get("model", {}).items() if k in text})
        try:
            mckpt._check_model(stated, text, tag_dir)  # the loader's own comparison
        except ValueError as e:
            raise PreflightError(f"--ckpt.load_enable: {e}: the checkpoint is from another model than "
                                 f"--actor.model_name_or_path {ctx.model.name}; use that model, or a new "
                                 "--ckpt.path") from None
    layout = meta.get("layout", {})
    vpp = f" VPP{layout['vpp']}" if layout.get("vpp", 1) > 1 else ""
    ctx.say(f"resume: {tag_dir} (Megatron, step {meta.get('step')}, written at TP{layout.get('tp')} "
            f"PP{layout.get('pp')}{vpp} DP{layout.get('dp')}; layout-free: resumes in this layout)")


def _megatron_incomplete(tag_dir: str, args) -> Optional[str]:
    """A Megatron save is renamed into place whole (``<tag>.partial`` until then): only ``meta.json`` is read."""
    try:
        with open(os.path.join(tag_dir, "meta.json"), encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError) as e:
        return f"meta.json cannot be read ({e})"
    return None


register_resume_format(ResumeFormat("megatron", _is_megatron, check_resume, _megatron_incomplete))
