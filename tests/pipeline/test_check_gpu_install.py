"""``scripts/check_gpu_install.py``: does ``pip install -e .[gpu,eval]`` resolve on a CUDA cluster?

The pin-agreement logic runs on the resolutions the script recorded from PyPI for Linux x86_64 and
Python 3.10 / 3.11 / 3.12 (``data/gpu_install/report-py*.json``: pip's ``--dry-run --report`` trimmed
to the fields the analysis reads, plus the separately installed deepspeed, flash-attn, openrlhf and
transformers-stream-generator with their requirements), then on copies with planted conflicts. The
metadata proxy and the sdist reader run against a local index served by the test.

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
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(("pip ", "MAX_JOBS"))]
    order = ["torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130", "vllm==0.29.0",
             "--no-build-isolation", "deepspeed==0.19.6", "openrlhf==0.11.2 --no-deps", "-e '.[gpu,eval]'"]
    at = [next(i for i, ln in enumerate(lines) if o in ln) for o in order]
    assert at == sorted(at), lines
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
