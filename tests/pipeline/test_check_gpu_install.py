"""``scripts/check_gpu_install.py``: does ``pip install -e .[gpu,eval]`` resolve on a CUDA cluster?

The pin-agreement logic runs on the resolutions the script recorded from PyPI for Linux x86_64 and
Python 3.10 / 3.11 / 3.12 (``data/gpu_install/report-py*.json``: pip's ``--dry-run --report`` trimmed
to the fields the analysis reads, plus the separately installed deepspeed, flash-attn, openrlhf and
transformers-stream-generator with their requirements), then on copies with planted conflicts. The
metadata proxy and the sdist reader run against a local index served by the test.

The node check (``--node``, and ``openrlhf_lpo/cli/gpu_build.py`` that ``lpo-train`` runs on every GPU
node at start) runs its pure check on node facts shaped as a real node reports them, its gatherer in a
subprocess that sees a fake ``nvcc`` (an executable printing nvcc's ``--version``), ``ninja``, ``c++``,
and fake ``torch`` / ``deepspeed`` packages holding only the files the gatherer reads.

The live resolution (``python scripts/check_gpu_install.py``) is not run here: on this project's CI
network it took 5.9 minutes for the three versions (2026-12-01: the index proxy strips PEP 658
metadata, so each wheel's ``.metadata`` comes through the script's local proxy at ~0.2 s a request),
over the two minutes CI allows (docs/install.md). Its recorded output is what these tests read.
"""

import copy
import io
import json
import os
import runpy
import subprocess
import sys
import tarfile
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data" / "gpu_install"
sys.path.insert(0, str(REPO / "scripts"))
import check_gpu_install as cgi  # noqa: E402

PYTHONS = ("3.10", "3.11", "3.12")


def recorded(python):
    return json.loads((DATA / f"report-py{python}.json").read_text())


def rows(analysis, by_prefix, on):
    return [c for c in analysis["checks"] if c["by"].startswith(by_prefix) and c["on"] == on]


@pytest.mark.parametrize("python", PYTHONS)
def test_recorded_resolution_agrees(python):
    r = recorded(python)
    a = cgi.analyse(r)
    assert a["conflicts"] == [], a["conflicts"]
    assert a["versions"]["torch"] == "2.13.0" and a["versions"]["vllm"] == "0.29.0"
    assert a["versions"]["transformers"] == "5.15.0" and a["versions"]["ray"] == "2.55.0"
    assert a["versions"]["megatron-core"] == "0.16.1"
    assert {k: v["how"] for k, v in r["separate"].items()} == {
        "openrlhf": "--no-deps", "deepspeed": "sdist", "flash-attn": "sdist", "transformers-stream-generator": "sdist"}
    # the pins that must agree, each present and satisfied
    assert [c["spec"] for c in rows(a, "vllm ", "torch")] == ["==2.13.0"]
    assert [c["spec"] for c in rows(a, "openrlhf ", "flash-attn")] == ["==2.8.3"]
    assert [c["spec"] for c in rows(a, "openrlhf ", "transformers")] == ["==5.15.0"]
    assert [c["spec"] for c in rows(a, "openrlhf ", "ray")] == ["==2.55.0"]
    assert rows(a, "deepspeed ", "torch") and rows(a, "flash-attn ", "torch") and rows(a, "megatron-core ", "torch")
    assert all(c["ok"] for c in a["key"])
    assert a["cuda"] == "13.0"  # PyPI's torch 2.13.0 Linux wheel pins cuda-toolkit 13.0.3
    assert a["vllm_cuda"] == "13"  # and vllm 0.29.0 requires nvidia-cutlass-dsl[cu13]: one CUDA for the stack
    assert len(a["checks"]) > 500  # every requirement of ~260 packages, not a sample


def planted(python, edit):
    r = copy.deepcopy(recorded(python))
    edit(r)
    return cgi.analyse(r)["conflicts"]


def _set_version(r, name, version):
    next(d for d in r["install"] if d["name"].lower() == name)["version"] = version


def test_planted_conflicts_are_named():
    # torch 2.12 instead of vllm's pin: vllm and torchvision say so
    got = planted("3.11", lambda r: _set_version(r, "torch", "2.12.0"))
    assert {c["by"].split()[0] for c in got if c["on"] == "torch"} == {"vllm", "torchvision"}
    # a sdist-only package that needs an older torch
    got = planted("3.11", lambda r: r["separate"]["deepspeed"]["requires_dist"].append("torch<2.10"))
    assert [(c["by"], c["spec"], c["found"]) for c in got] == [("deepspeed 0.19.6 (sdist)", "<2.10", "2.13.0")]
    # transformers off openrlhf's (and setup.py's) pin, but inside vllm's range
    got = planted("3.11", lambda r: _set_version(r, "transformers", "5.16.1"))
    assert {c["by"].split()[0] for c in got} == {"openrlhf", "setup.py"}
    # ray missing from the resolution: openrlhf (installed --no-deps) would lack it
    got = planted("3.12", lambda r: r["install"].remove(next(d for d in r["install"] if d["name"] == "ray")))
    assert ("openrlhf 0.11.2 (--no-deps)", "ray", None) in [(c["by"], c["on"], c["found"]) for c in got]
    # a package whose Requires-Python excludes the target
    got = planted("3.10", lambda r: next(d for d in r["install"] if d["name"] == "vllm").update(requires_python=">=3.11"))
    assert [(c["on"], c["found"]) for c in got] == [("python", "3.10")]


def test_cli_on_recorded_reports(tmp_path):
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "check_gpu_install.py"), "--reports", str(DATA)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PASS: 3 Python versions, 0 conflicts" in p.stdout
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(("pip ", "MAX_JOBS", "DS_BUILD"))]
    order = ["torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130", "vllm==0.29.0",
             "--no-build-isolation", "deepspeed==0.19.6", "openrlhf==0.11.2 --no-deps", "-e '.[gpu,eval]'"]
    at = [next(i for i, ln in enumerate(lines) if o in ln) for o in order]
    assert at == sorted(at), lines
    # deepspeed's Adam ops are compiled at install, not by every node at its first step (gpu_build below)
    assert ("DS_BUILD_FUSED_ADAM=1 DS_BUILD_CPU_ADAM=1 TORCH_CUDA_ARCH_LIST=9.0 pip install deepspeed==0.19.6 "
            "--no-build-isolation --no-cache-dir --force-reinstall --no-deps   # compiles DeepSpeed's Adam ops now, so "
            "no node compiles them at run time: run it on a GPU node with CUDA_HOME at a CUDA 13.0 toolkit") in p.stdout
    bad = tmp_path / "bad"
    bad.mkdir()
    r = recorded("3.12")
    _set_version(r, "torch", "2.12.0")
    (bad / "report-py3.12.json").write_text(json.dumps(r))
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "check_gpu_install.py"), "--reports", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "CONFLICT: vllm 0.29.0 requires torch ==2.13.0, resolved 2.12.0" in p.stdout


def test_setup_extras_are_what_setuptools_gets():
    captured = {}
    with mock.patch("setuptools.setup", lambda **kw: captured.update(kw)):
        runpy.run_path(str(REPO / "setup.py"), run_name="__main__")
    install, extras = cgi.setup_extras()
    assert install == captured["install_requires"] and extras == captured["extras_require"]
    assert "openrlhf==0.11.2" in extras["gpu"] and "vllm==0.29.0" in extras["gpu"]


def _sdist(files):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_sdist_requirements():
    req = "einops\ntorch>=2.0\n\n[:python_version < \"3.11\"]\ntomli\n\n[dev]\npytest\n\n[dev:sys_platform == \"linux\"]\nx\n"
    data = _sdist({"pkg-1.0/PKG-INFO": "Name: pkg\n", "pkg-1.0/pkg.egg-info/requires.txt": req})
    assert cgi.requires_from_sdist(data, "pkg-1.0.tar.gz") == ["einops", "torch>=2.0", 'tomli; python_version < "3.11"']
    only_pkg_info = _sdist({"q-2.0/PKG-INFO": "Name: q\nRequires-Dist: torch\nRequires-Dist: x; extra == \"y\"\n\nbody"})
    assert cgi.requires_from_sdist(only_pkg_info, "q-2.0.tar.gz") == ["torch"]


def _wheel(name, version, requires):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
        z.writestr(f"{name}/__init__.py", "")
    return buf.getvalue()


@pytest.fixture
def local_index():
    """A PEP 691 index without metadata attributes: a-1.0 has a .metadata file beside it, b-1.0 not."""
    files = {"/files/a-1.0-py3-none-any.whl": _wheel("a", "1.0", ["b>=1"]),
             "/files/a-1.0-py3-none-any.whl.metadata": b"Metadata-Version: 2.1\nName: a\nVersion: 1.0\nRequires-Dist: b>=1\n",
             "/files/b-1.0-py3-none-any.whl": _wheel("b", "1.0", [])}
    pages = {n: {"meta": {"api-version": "1.0"}, "name": n,
                 "files": [{"filename": f"{n}-1.0-py3-none-any.whl", "url": f"../../files/{n}-1.0-py3-none-any.whl",
                            "hashes": {}}]} for n in ("a", "b")}

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            if self.path.startswith("/simple/") and self.path.split("/")[2] in pages:
                body = json.dumps(pages[self.path.split("/")[2]]).encode()
            elif self.path in files:
                body = files[self.path]
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", files
    server.shutdown()
    server.server_close()


def test_metadata_proxy_adds_pep658_and_serves_metadata(local_index):
    upstream, files = local_index
    cgi._CACHE.clear()
    with cgi.MetadataProxy(upstream + "/simple") as proxy:
        page = json.loads(cgi._get(proxy.url + "/simple/a/", cgi.Index.JSON, cache=False))
        (f,) = page["files"]
        assert f["core-metadata"] is True and f["url"].startswith(proxy.url + "/f/http/")
        assert proxy.real_url(f["url"]) == upstream + "/files/a-1.0-py3-none-any.whl"
        # a's metadata file comes from the index; b has none, so it is read from b's wheel
        assert cgi._get(f["url"] + ".metadata", cache=False) == files["/files/a-1.0-py3-none-any.whl.metadata"]
        b = json.loads(cgi._get(proxy.url + "/simple/b/", cgi.Index.JSON, cache=False))["files"][0]
        assert b"Name: b" in cgi._get(b["url"] + ".metadata", cache=False)
        # the wheel itself: a redirect to the index's file (followed), counted
        assert cgi._get(f["url"], cache=False) == files["/files/a-1.0-py3-none-any.whl"]
        assert proxy.counts["metadata"] == 2 and proxy.counts["redirects"] == 1 and proxy.counts["pages"] == 2


def test_pip_runs_isolated_from_this_machines_configuration():
    with mock.patch.dict(os.environ, {"PIP_CONSTRAINT": "/etc/c.txt", "PIP_FIND_LINKS": "/opt/wheels",
                                      "PIP_EXTRA_INDEX_URL": "file:///opt/pypi", "PIP_CERT": "/ca.crt"}):
        env = cgi.pip_env()
    assert env["PIP_CONFIG_FILE"] == os.devnull and env["PIP_CERT"] == "/ca.crt"
    assert not {"PIP_CONSTRAINT", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"} & set(env)
    cmd = cgi.pip_command("3.10", ["vllm==0.29.0"], "https://pypi.org/simple", Path("r.json"), Path("t"))
    assert cmd[cmd.index("--python-version") + 1] == "3.10" and "--only-binary=:all:" in cmd and "--dry-run" in cmd
    assert "manylinux_2_17_x86_64" in cmd and "manylinux_2_28_x86_64" in cmd and cmd[-1] == "vllm==0.29.0"


# ----------------------------------------------------------------------------- node check (gpu_build)

from dataclasses import replace  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from openrlhf_lpo.cli import gpu_build as gb  # noqa: E402

NVCC_13_0 = ("nvcc: NVIDIA (R) Cuda compiler driver\nCopyright (c) 2005-2025 NVIDIA Corporation\n"
             "Built on Wed_Aug_20_01:58:59_PM_PDT_2025\nCuda compilation tools, release 13.0, V13.0.88\n"
             "Build cuda_13.0.r13.0/compiler.36424714_0\n")
NVCC_13_1 = NVCC_13_0.replace("release 13.0, V13.0.88", "release 13.1, V13.1.80").replace("13.0.r13.0", "13.1.r13.1")
NVCC_12_8 = ("nvcc: NVIDIA (R) Cuda compiler driver\nCopyright (c) 2005-2025 NVIDIA Corporation\n"
             "Built on Fri_Feb_21_20:23:50_PST_2025\nCuda compilation tools, release 12.8, V12.8.93\n"
             "Build cuda_12.8.r12.8/compiler.35583870_0\n")
HINT = ("or pre-build the ops into deepspeed once (docs/install.md, \"DeepSpeed's optimizer ops\": "
        "DS_BUILD_FUSED_ADAM=1 DS_BUILD_CPU_ADAM=1 TORCH_CUDA_ARCH_LIST=9.0 pip install deepspeed==0.19.6 "
        "--no-build-isolation --no-cache-dir "
        "--force-reinstall --no-deps, on a GPU node, 9.0 being H100/H200's capability)")
FUSED = "fused_adam (DeepSpeed's FusedAdam, the Adam of runs without --ds.adam_offload)"
CPU_ADAM = "cpu_adam (DeepSpeedCPUAdam, the Adam of --ds.adam_offload)"


def node(**kw):
    """An 8-GPU node as gather_facts reports it: torch 2.13.0+cu130, deepspeed 0.19.6 from its sdist (no op
    compiled), CUDA_HOME at a 13.0 toolkit, ninja from the venv, g++ as c++."""
    facts = dict(host="gpu-a", nvidia_gpus=8, env={"CUDA_HOME": "/usr/local/cuda-13.0"},
                 which={"nvcc": None, "ninja": "/opt/venv/bin/ninja", "c++": "/usr/bin/c++"}, usr_local_cuda=True,
                 nvcc_text=NVCC_13_0, torch_version="2.13.0+cu130", torch_cuda="13.0", torch_hip=None,
                 ds_version="0.19.6", ds_installed_ops={"async_io": False, "cpu_adam": False, "fused_adam": False},
                 ds_accelerator="cuda", ds_torch_info={"version": "2.13", "cuda_version": "13.0"}, ds_built=())
    facts.update(kw)
    return gb.NodeFacts(**facts)


def test_build_check_nvcc_of_torchs_cuda_passes():
    assert gb.nvcc_release(NVCC_13_0) == (13, 0) and gb.nvcc_release(NVCC_12_8) == (12, 8)
    assert gb.build_problems("fused_adam", node()) == []
    assert gb.build_problems("cpu_adam", node()) == []
    # CUDA_HOME unset: torch (and so DeepSpeed) takes the toolkit above the nvcc on PATH
    on_path = node(env={}, which={"nvcc": "/opt/cuda-13.0/bin/nvcc", "ninja": "/usr/bin/ninja", "c++": "/usr/bin/c++"})
    assert gb.toolkit_home(on_path.env, on_path.which["nvcc"], True) == ("/opt/cuda-13.0", "the nvcc on PATH, "
                                                                       "/opt/cuda-13.0/bin/nvcc")
    assert gb.build_problems("fused_adam", on_path) == []
    # fused_adam: another 13.x minor is fine (torch warns only on a major mismatch)
    assert gb.build_problems("fused_adam", node(nvcc_text=NVCC_13_1)) == []


def test_build_check_nvcc_12_vs_torch_13_names_both():
    got = gb.build_problems("fused_adam", node(env={"CUDA_HOME": "/usr/local/cuda-12.8"}, nvcc_text=NVCC_12_8))
    assert got == [f"/usr/local/cuda-12.8/bin/nvcc (CUDA home from $CUDA_HOME) is CUDA 12.8 but torch 2.13.0+cu130 "
                   f"is built for CUDA 13.0: JIT-compiling {FUSED} needs a CUDA 13.x toolkit; export "
                   f"CUDA_HOME=/usr/local/cuda-13.0 (or another 13.x toolkit), {HINT}"]


def test_build_check_without_a_toolkit():
    # CUDA_HOME unset, no nvcc on PATH, no /usr/local/cuda
    got = gb.build_problems("fused_adam", node(env={}, usr_local_cuda=False, nvcc_text=None))
    assert got == [f"CUDA_HOME is not set, no nvcc is on PATH and /usr/local/cuda does not exist: JIT-compiling "
                   f"{FUSED} needs nvcc from a CUDA 13.x toolkit (torch 2.13.0+cu130 is built for CUDA 13.0); install "
                   f"it and export CUDA_HOME=/usr/local/cuda-13.0 on every node, {HINT}"]
    # a runtime-only image: /usr/local/cuda exists, without bin/nvcc
    got = gb.build_problems("fused_adam", node(env={}, nvcc_text=None))
    assert got == [f"CUDA home /usr/local/cuda (from torch's default; CUDA_HOME unset) has no runnable bin/nvcc (a "
                   f"runtime-only CUDA image?): JIT-compiling {FUSED} needs nvcc from a CUDA 13.x toolkit; point "
                   f"CUDA_HOME at one, {HINT}"]
    # torch's CPU wheel on a GPU node
    assert gb.build_problems("fused_adam", node(torch_version="2.13.0+cpu", torch_cuda=None)) == [
        "torch 2.13.0+cpu is a CPU build (torch.version.cuda is None): DeepSpeed's GPU ops need torch's CUDA build "
        "(docs/install.md: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130)"]


def test_build_check_without_ninja_or_compiler():
    got = gb.build_problems("fused_adam", node(which={"nvcc": None, "ninja": None, "c++": "/usr/bin/c++"}))
    assert got == [f"ninja is not on PATH: torch needs it to JIT-compile {FUSED}; pip install ninja in this venv and "
                   f"put the venv's bin/ on the PATH the Ray workers see, {HINT}"]
    got = gb.build_problems("fused_adam", node(env={"CUDA_HOME": "/usr/local/cuda-13.0", "CXX": "g++-13 -fPIC"},
                                               which={"nvcc": None, "ninja": "/usr/bin/ninja", "g++-13": None}))
    assert got == [f"no C++ compiler: $CXX `g++-13` is not on PATH; install g++ (e.g. apt-get install g++) or set "
                   f"CXX, {HINT}"]


def test_prebuilt_op_needs_no_toolchain():
    bare = dict(env={}, which={"nvcc": None, "ninja": None, "c++": None}, usr_local_cuda=False, nvcc_text=None)
    built = node(**bare, ds_installed_ops={"fused_adam": 1, "cpu_adam": 1}, ds_built=("fused_adam", "cpu_adam"))
    assert gb.is_prebuilt("fused_adam", built) and gb.build_problems("fused_adam", built) == []
    assert gb.build_problems("cpu_adam", built) == []
    # recorded as installed but compiled for DeepSpeed's CPU accelerator (a build machine without a GPU and
    # without DS_ACCELERATOR=cuda): DeepSpeed compiles again, so the toolchain is needed
    cpu_built = replace(built, ds_accelerator="cpu")
    assert not gb.is_prebuilt("fused_adam", cpu_built)
    assert len(gb.build_problems("fused_adam", cpu_built)) == 3  # ninja, compiler, CUDA home
    # compiled under another torch / CUDA: DeepSpeed refuses to load it
    old = replace(built, ds_torch_info={"version": "2.12", "cuda_version": "12.8"})
    assert gb.build_problems("fused_adam", old) == [
        "deepspeed 0.19.6's pre-built fused_adam was compiled for torch 2.12 / CUDA 12.8, this node has torch 2.13 / "
        "CUDA 13.0: DeepSpeed refuses to load it; reinstall deepspeed with the pre-build line of docs/install.md "
        "under this torch"]
    # only one of the two compiled: the other one still needs the toolchain
    only_fused = replace(built, ds_installed_ops={"fused_adam": 1, "cpu_adam": 0}, ds_built=("fused_adam",))
    assert gb.build_problems("fused_adam", only_fused) == [] and len(gb.build_problems("cpu_adam", only_fused)) == 3


def test_adam_offload_needs_cpu_adam_and_the_exact_cuda_minor():
    """DeepSpeedCPUAdam is C++, but on a node with a GPU deepspeed 0.19.6 compiles it with its CUDA builder:
    it reads nvcc's version (MissingCUDAException without one) and refuses another CUDA 13 minor
    (CUDAMismatchException), so it needs the compiler, ninja AND nvcc 13.0."""
    assert gb.needed_op("deepspeed", adam_offload=True, critic=False) == "cpu_adam"
    assert gb.needed_op("deepspeed", adam_offload=False, critic=False) == "fused_adam"
    minor = node(nvcc_text=NVCC_13_1)
    assert gb.build_problems("fused_adam", minor) == []
    assert gb.build_problems("cpu_adam", minor) == [
        f"/usr/local/cuda-13.0/bin/nvcc (CUDA home from $CUDA_HOME) is CUDA 13.1 but torch 2.13.0+cu130 is built for "
        f"CUDA 13.0: deepspeed 0.19.6 compiles {CPU_ADAM} only with the same CUDA major.minor; export "
        f"CUDA_HOME=/usr/local/cuda-13.0, or DS_SKIP_CUDA_CHECK=1 to let it try, {HINT}"]
    assert gb.build_problems("cpu_adam", replace(minor, env={"CUDA_HOME": "/usr/local/cuda-13.0",
                                                             "DS_SKIP_CUDA_CHECK": "1"})) == []
    got = gb.build_problems("cpu_adam", node(env={}, usr_local_cuda=False, nvcc_text=None,
                                             which={"nvcc": None, "ninja": None, "c++": "/usr/bin/c++"}))
    assert got == [f"ninja is not on PATH: torch needs it to JIT-compile {CPU_ADAM}; pip install ninja in this venv "
                   f"and put the venv's bin/ on the PATH the Ray workers see, {HINT}",
                   f"CUDA_HOME is not set, no nvcc is on PATH and /usr/local/cuda does not exist: JIT-compiling "
                   f"{CPU_ADAM} needs nvcc from a CUDA 13.0 toolkit (torch 2.13.0+cu130 is built for CUDA 13.0); "
                   f"install it and export CUDA_HOME=/usr/local/cuda-13.0 on every node, {HINT}"]


def test_megatron_backend_needs_no_op():
    assert gb.needed_op("megatron", adam_offload=False, critic=False) is None
    assert gb.needed_op("megatron", adam_offload=True, critic=False) is None
    assert gb.needed_op("megatron", adam_offload=False, critic=True) == "fused_adam"  # a critic trains on DeepSpeed
    assert gb.build_problems(None, node(env={}, usr_local_cuda=False, nvcc_text=None, which={})) == []
    ns = lambda backend, offload, critic=None: SimpleNamespace(  # noqa: E731  (lpo-train's hierarchised namespace)
        backend=backend, ds=SimpleNamespace(adam_offload=offload), critic=SimpleNamespace(model_name_or_path=critic))
    assert [gb.op_for_args(ns("deepspeed", False)), gb.op_for_args(ns("deepspeed", True)),
            gb.op_for_args(ns("megatron", True)), gb.op_for_args(ns("megatron", True, "critic/path"))] == \
        ["fused_adam", "cpu_adam", None, "cpu_adam"]


# the gatherer, in a subprocess whose PATH, CUDA_HOME, torch and deepspeed are fakes shaped like the real ones

GATHER = ("import json, dataclasses\nfrom openrlhf_lpo.cli import gpu_build\n"
          "print(json.dumps(dataclasses.asdict(gpu_build.gather_facts())))")


def _exe(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(0o755)
    return str(path)


def _nvcc(path: Path, version_text: str) -> str:
    """An executable ``nvcc`` that prints ``version_text`` for ``--version`` / ``-V`` (and fails otherwise)."""
    body = version_text.replace("\n", "\\n")
    return _exe(path, f'if [ "$1" = "--version" ] || [ "$1" = "-V" ]; then printf "{body}"; exit 0; fi\nexit 1\n')


@pytest.fixture
def fake_node(tmp_path):
    """A folder per fake: cuda-12.8/bin/nvcc (prints NVCC_12_8 for --version), bin/ with ninja and c++, and
    site/ with a torch package holding only version.py (2.13.0+cu130) and a deepspeed package as its sdist
    installs it without ops (git_version_info_installed.py, no compiled module)."""
    nvcc = _nvcc(tmp_path / "cuda-12.8" / "bin" / "nvcc", NVCC_12_8)
    ninja = _exe(tmp_path / "bin" / "ninja", "echo 1.13.2\n")
    cxx = _exe(tmp_path / "bin" / "c++", "exit 0\n")
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("raise ImportError('the gatherer must not import torch')\n")
    (site / "torch" / "version.py").write_text(
        "from typing import Optional\n\n__version__ = '2.13.0+cu130'\ndebug = False\ncuda: Optional[str] = '13.0'\n"
        "hip: Optional[str] = None\n")
    ds = site / "deepspeed"
    (ds / "ops" / "adam").mkdir(parents=True)
    (ds / "__init__.py").write_text("raise ImportError('the gatherer must not import deepspeed')\n")
    (ds / "git_version_info_installed.py").write_text(
        "version='0.19.6'\ngit_hash='unknown'\ngit_branch='unknown'\ninstalled_ops={'deepspeed_not_implemented': "
        "False, 'async_io': False, 'cpu_adam': False, 'fused_adam': False, 'pin_memory': False}\n"
        "accelerator_name='cuda'\ntorch_info={'version': '2.13', 'bf16_support': True, 'cuda_version': '13.0', "
        "'nccl_version': '2.29', 'hip_version': '0.0'}\n")
    env = {k: v for k, v in os.environ.items() if k not in gb.ENV_KEYS}
    env.update(PATH=str(tmp_path / "bin"), CUDA_HOME=str(tmp_path / "cuda-12.8"),
               PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))
    return SimpleNamespace(root=tmp_path, env=env, nvcc=nvcc, ninja=ninja, cxx=cxx, ds=ds)


def _gather(env):
    p = subprocess.run([sys.executable, "-c", GATHER], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    facts = json.loads(p.stdout.strip().splitlines()[-1])
    facts["ds_built"] = tuple(facts["ds_built"])
    return gb.NodeFacts(**facts)


def test_gatherer_reads_a_fake_nvcc_and_the_installed_packages(fake_node):
    f = _gather(fake_node.env)
    assert isinstance(f.nvidia_gpus, int)  # this machine's count: not asserted
    assert replace(f, nvidia_gpus=None, host="") == gb.NodeFacts(
        host="", nvidia_gpus=None, env={"CUDA_HOME": str(fake_node.root / "cuda-12.8")},
        which={"nvcc": None, "ninja": fake_node.ninja, "c++": fake_node.cxx},
        usr_local_cuda=os.path.exists("/usr/local/cuda"), nvcc_text=NVCC_12_8, torch_version="2.13.0+cu130",
        torch_cuda="13.0", torch_hip=None, ds_version="0.19.6",
        ds_installed_ops={"deepspeed_not_implemented": False, "async_io": False, "cpu_adam": False,
                          "fused_adam": False, "pin_memory": False},
        ds_accelerator="cuda", ds_torch_info={"version": "2.13", "bf16_support": True, "cuda_version": "13.0",
                                              "nccl_version": "2.29", "hip_version": "0.0"}, ds_built=())
    assert gb.build_problems("fused_adam", f) == [
        f"{fake_node.nvcc} (CUDA home from $CUDA_HOME) is CUDA 12.8 but torch 2.13.0+cu130 is built for CUDA 13.0: "
        f"JIT-compiling {FUSED} needs a CUDA 13.x toolkit; export CUDA_HOME=/usr/local/cuda-13.0 (or another 13.x "
        f"toolkit), {HINT}"]
    # CUDA_HOME unset, nvcc on PATH: the toolkit above it, as torch finds it
    path = os.pathsep.join([str(fake_node.root / "bin"), str(fake_node.root / "cuda-12.8" / "bin")])
    env = dict(fake_node.env, PATH=path)
    del env["CUDA_HOME"]
    f = _gather(env)
    assert f.env == {} and f.which["nvcc"] == fake_node.nvcc and f.nvcc_text == NVCC_12_8
    assert gb.toolkit_home(f.env, f.which["nvcc"], f.usr_local_cuda)[0] == str(fake_node.root / "cuda-12.8")
    # an nvcc that fails: no text, reported as not runnable
    _exe(Path(fake_node.nvcc), "exit 127\n")
    f = _gather(fake_node.env)
    assert f.nvcc_text is None
    assert gb.build_problems("fused_adam", f)[0].startswith(
        f"CUDA home {fake_node.root / 'cuda-12.8'} (from $CUDA_HOME) has no runnable bin/nvcc")


def test_gatherer_sees_ops_compiled_into_deepspeed(fake_node):
    (fake_node.ds / "git_version_info_installed.py").write_text(
        "version='0.19.6'\ninstalled_ops={'cpu_adam': 1, 'fused_adam': 1}\naccelerator_name='cuda'\n"
        "torch_info={'version': '2.13', 'cuda_version': '13.0'}\n")
    (fake_node.ds / "ops" / "adam" / "fused_adam_op.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    f = _gather(fake_node.env)
    assert f.ds_built == ("fused_adam",) and f.ds_installed_ops == {"cpu_adam": 1, "fused_adam": 1}
    assert gb.build_problems("fused_adam", f) == []  # nvcc 12.8 does not matter: nothing is compiled
    assert len(gb.build_problems("cpu_adam", f)) == 1  # recorded, but its module is missing: compiled at start


def test_node_cli(fake_node):
    script = [sys.executable, str(REPO / "scripts" / "check_gpu_install.py"), "--node"]
    p = subprocess.run(script, env=fake_node.env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert lines[1] == (f"  CUDA_HOME: {fake_node.root / 'cuda-12.8'} (from $CUDA_HOME); nvcc release 12.8; ninja: "
                        f"{fake_node.ninja}; c++: {fake_node.cxx}")
    assert lines[2] == f"  --backend deepspeed: the optimizer loads {FUSED}"
    assert lines[3].startswith(f"  PROBLEM: {fake_node.nvcc} (CUDA home from $CUDA_HOME) is CUDA 12.8 but torch "
                               "2.13.0+cu130 is built for CUDA 13.0")
    assert lines[-1] == "[check_gpu_install] FAIL: fused_adam cannot load here (1 problem(s))"
    p = subprocess.run(script + ["--backend", "megatron"], env=fake_node.env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.splitlines()[-1] == (
        "[check_gpu_install] PASS: --backend megatron trains with no DeepSpeed op (megatron-core's optimizer)")
    _nvcc(Path(fake_node.nvcc), NVCC_13_0)  # the same folder now holds a 13.0 toolkit
    p = subprocess.run(script + ["--adam-offload"], env=fake_node.env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.splitlines()[-1] == ("[check_gpu_install] PASS: cpu_adam loads here (JIT-compiled at the first "
                                         "deepspeed.initialize)")


@pytest.mark.skipif(not os.path.exists("/usr/local/cuda-13.0/bin/nvcc"), reason="no CUDA 13.0 toolkit here")
def test_gatherer_with_a_real_cuda_13_toolkit(fake_node):
    f = _gather(dict(fake_node.env, CUDA_HOME="/usr/local/cuda-13.0"))
    assert gb.nvcc_release(f.nvcc_text) == (13, 0)
    assert gb.build_problems("fused_adam", f) == [] and gb.build_problems("cpu_adam", f) == []


# the run-start check (lpo-train, after Ray is joined)


def _run_check(monkeypatch, args, facts, env):
    for k in ("LPO_CPU_MODE", gb.SKIP_ENV, "RAY_ADDRESS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    calls = []

    def gather():
        calls.append(1)
        return facts, ["10.0.0.9 (gpu-z)"]

    gb.check_run_or_exit(args, "lpo-train", gather=gather)
    return calls


def test_run_start_check(monkeypatch, capsys):
    args = SimpleNamespace(backend="deepspeed", ds=SimpleNamespace(adam_offload=False),
                           critic=SimpleNamespace(model_name_or_path=None), cpu=SimpleNamespace(mode="auto", active=False))
    bad = node(env={"CUDA_HOME": "/usr/local/cuda-12.8"}, nvcc_text=NVCC_12_8)
    facts = {"10.0.0.1 (gpu-a)": bad, "10.0.0.2 (gpu-b)": replace(bad, host="gpu-b"), "10.0.0.3 (gpu-c)": node(),
             "10.0.0.4 (cpu-d)": replace(bad, nvidia_gpus=0)}  # logical GPUs only: not checked
    with pytest.raises(SystemExit) as e:
        _run_check(monkeypatch, args, facts, {"LPO_CPU_MODE": "0"})
    assert e.value.code == 3
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "lpo-train: warning: GPU node 10.0.0.9 (gpu-z) did not answer the DeepSpeed fused_adam build check; "
        "not checked",
        f"lpo-train: 2 of 3 GPU node(s) cannot load {FUSED}, which every actor loads at its first "
        "deepspeed.initialize, compiling it unless it was pre-built into deepspeed; nothing was started:",
        f"  10.0.0.1 (gpu-a), 10.0.0.2 (gpu-b): /usr/local/cuda-12.8/bin/nvcc (CUDA home from $CUDA_HOME) is CUDA "
        f"12.8 but torch 2.13.0+cu130 is built for CUDA 13.0: JIT-compiling {FUSED} needs a CUDA 13.x toolkit; export "
        f"CUDA_HOME=/usr/local/cuda-13.0 (or another 13.x toolkit), {HINT}",
        "  (python scripts/check_gpu_install.py --node checks one node; LPO_SKIP_BUILD_CHECK=1 starts anyway)"]
    # every GPU node fine: one summary line
    assert _run_check(monkeypatch, args, {"10.0.0.3 (gpu-c)": node()}, {"LPO_CPU_MODE": "0"}) == [1]
    assert capsys.readouterr().out == ("lpo-train: DeepSpeed fused_adam: JIT-compiled on 1 with nvcc 13.0 and ninja "
                                       "GPU node(s)\n")
    # not checked: CPU mode (as openrlhf_lpo.cpu.mode's start decided it), the Megatron backend, the opt-out
    from openrlhf_lpo.cpu import mode as cpu

    for mode, active in (("off", False), ("auto", True)):  # LPO_CPU_MODE=1: auto is on
        decided = SimpleNamespace(backend="deepspeed", ds=args.ds, critic=args.critic, cpu=SimpleNamespace(mode=mode))
        monkeypatch.setenv("LPO_CPU_MODE", "1")
        if active:
            monkeypatch.setattr(cpu, "enable_cpu_mode", lambda: None)  # the process-wide patches stay off here
            monkeypatch.setattr(cpu, "gpu_available", lambda: False)
            monkeypatch.setattr(cpu, "adjust_args", lambda a: [])
        cpu._cpu_before_train(decided)
        assert decided.cpu.active is active
        assert _run_check(monkeypatch, decided, {"10.0.0.3 (gpu-c)": node()}, {}) == ([] if active else [1])
    capsys.readouterr()
    assert _run_check(monkeypatch, SimpleNamespace(backend="megatron", ds=args.ds, critic=args.critic, cpu=args.cpu),
                      facts, {"LPO_CPU_MODE": "0"}) == []
    assert _run_check(monkeypatch, args, facts, {"LPO_CPU_MODE": "0", gb.SKIP_ENV: "1"}) == []
    assert capsys.readouterr().out == ("lpo-train: LPO_SKIP_BUILD_CHECK=1: not checking that the GPU nodes can build "
                                       "DeepSpeed's fused_adam\n")
