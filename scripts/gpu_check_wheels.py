#!/usr/bin/env python3
"""Wheels that let ``gpu_check.sh``'s DeepSpeed trainer rows run on a GPU machine without DeepSpeed,
OpenRLHF, flash-attn or Ray (docs/install.md "Carrying packages to a GPU machine").

The rows (``openrlhf_lpo/checks/trainer_check.py``) import deepspeed, openrlhf, flash-attn's
Python files and ray (imports only). This builds a folder of wheels for the machine's Python:

* deepspeed 0.19.6: built here from its sdist (``pip wheel --no-deps``; pure Python, ~2 MB);
* flash-attn 2.8.3: its Python files only (``FLASH_ATTENTION_SKIP_CUDA_BUILD``; no kernel of it
  runs in the rows) plus ``flash_attn_2_cuda.py``, the placeholder for its compiled extension;
* openrlhf 0.11.2 from the registry;
* ray 2.55.0 from the registry, without its Java jar, the raylet / GCS server binaries and the
  dashboard's web client (74 MB -> ~24 MB; no cluster can be started from it, imports work);
* the packages these import that the machine's image lacks (``DEPENDENCIES``).

``--simulate`` then checks the set on this machine: a Python whose path holds only the GPU image's
packages (``device_packages_h200.txt``, taken from this venv) and the carried wheels runs the rows'
CPU mode (ZeRO-2, fp32). Use ``--python`` of this venv for that (3.11 here: compiled wheels are
per Python version; the package set is the same).

Usage:
    python scripts/gpu_check_wheels.py --out .whl --python 3.12            # for the H200 image
    python scripts/gpu_check_wheels.py --out /tmp/w311 --python 3.11 --simulate
"""

from __future__ import annotations

import argparse
import hashlib
import base64
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parents[1]
IMAGE = Path(__file__).with_name("device_packages_h200.txt")
PINS = {"deepspeed": "0.19.6", "flash-attn": "2.8.3", "openrlhf": "0.11.2", "ray": "2.55.0"}
# imported by deepspeed / openrlhf / ray / this project on the rows' path, absent from the image
DEPENDENCIES = ["hjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "jsonschema",
                "jsonschema-specifications", "referencing", "rpds-py", "torchdata", "pylatexenc"]
RAY_DROP = ("ray/jars/", "ray/core/src/ray/raylet/raylet", "ray/core/src/ray/gcs/gcs_server",
            "ray/dashboard/client/build/")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


def pip(*args: str, env=None) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, env=env)


def download(out: Path, python: str, names: List[str]) -> None:
    tag = "cp" + python.replace(".", "")
    cmd = ["download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", python, "--implementation",
           "cp", "--abi", tag, "--abi", "abi3", "--abi", "none", "-d", str(out)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    pip(*cmd, *names)


def trim_ray(wheel: Path) -> Path:
    """The ray wheel without RAY_DROP (RECORD rewritten to match)."""
    tmp = wheel.with_suffix(".trim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        kept = [i for i in src.infolist() if not i.filename.startswith(RAY_DROP) and i.filename != record_name]
        lines = []
        for info in kept:
            data = src.read(info)
            dst.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            lines.append(f"{info.filename},sha256={digest},{len(data)}")
        dst.writestr(record_name, "\n".join(lines + [f"{record_name},,"]) + "\n")
    tmp.replace(wheel)
    return wheel


def build(out: Path, python: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("*.whl"):
        f.unlink()
    pip("wheel", "-q", "--no-deps", "-w", str(out), f"deepspeed=={PINS['deepspeed']}")
    env = dict(os.environ, FLASH_ATTENTION_SKIP_CUDA_BUILD="TRUE", FLASH_ATTENTION_FORCE_BUILD="TRUE")
    pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), f"flash-attn=={PINS['flash-attn']}",
        env=env)
    shutil.copy(REPO / "scripts" / "flash_attn_2_cuda.py", out / "flash_attn_2_cuda.py")
    download(out, python, [f"openrlhf=={PINS['openrlhf']}", f"ray=={PINS['ray']}"] + DEPENDENCIES)
    trim_ray(next(out.glob("ray-*.whl")))
    total = sum(f.stat().st_size for f in out.iterdir())
    for f in sorted(out.iterdir()):
        print(f"{f.stat().st_size / 2**20:8.2f} MiB  {f.name}")
    print(f"{total / 2**20:8.2f} MiB  in all ({out})")


def install_target(out: Path, target: Path) -> None:
    """What the device command does: the wheels into ``target`` (no dependencies), the placeholder beside."""
    pip("install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", str(target),
        *[str(f) for f in sorted(out.glob("*.whl"))])
    shutil.copy(out / "flash_attn_2_cuda.py", target / "flash_attn_2_cuda.py")


def image_farm(farm: Path) -> List[str]:
    """Links to this venv's copies of the image's packages (top-level modules and dist-info)."""
    farm.mkdir(parents=True, exist_ok=True)
    names = [n.strip() for n in IMAGE.read_text().splitlines() if n.strip() and not n.startswith("#")]
    absent = []
    for name in names:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            absent.append(name)
            continue
        base = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            src, dst = base / top, farm / top
            if src.exists() and not dst.exists() and top != "__pycache__":
                dst.symlink_to(src)
    return absent


def simulate(out: Path) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        farm, target = Path(tmp) / "image", Path(tmp) / "carried"
        absent = image_farm(farm)
        install_target(out, target)
        print(f"[gpu_check_wheels] image packages not in this venv (so absent here too): {', '.join(absent)}")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env.update(PYTHONPATH=os.pathsep.join([str(REPO), str(target), str(farm)]), OMP_NUM_THREADS="1")
        code = ("import sys; sys.modules['vllm'] = None\n"  # the image has no vLLM either
                "from openrlhf_lpo.checks import trainer_check as tc\n"
                f"sys.exit(tc.main(['--cpu', '--zero', '2', '--dtype', 'fp32', '--work_dir', {str(Path(tmp) / 'w')!r},"
                f" '--json', {str(Path(tmp) / 'r.json')!r}]))")
        p = subprocess.run([sys.executable, "-S", "-c", code], env=env)
        print(f"[gpu_check_wheels] simulated image + carried wheels: exit {p.returncode}")
        return p.returncode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the wheels (e.g. .whl, ignored by git)")
    p.add_argument("--python", default="3.12", help="the GPU machine's Python (the H200 image: 3.12)")
    p.add_argument("--simulate", action="store_true", help="then run the rows with only image + carried packages")
    p.add_argument("--no-build", action="store_true", help="with --simulate: use the wheels already in --out")
    a = p.parse_args(argv)
    out = Path(a.out)
    if not a.no_build:
        build(out, a.python)
    return simulate(out) if a.simulate else 0


if __name__ == "__main__":
    sys.exit(main())
