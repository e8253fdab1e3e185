#!/usr/bin/env python3
"""Does ``pip install -e .[gpu,eval]`` resolve on a CUDA cluster? Checked from the registry's metadata,
without installing anything (docs/install.md).

For Linux x86_64 and each Python version (3.10, 3.11, 3.12 by default):

1. the requirements of setup.py's extras (``--extras``, default gpu,eval,megatron) are split into what
   the registry has wheels for and the packages that are installed on their own: the sdist-only ones
   (deepspeed, flash-attn, transformers-stream-generator: their requirements are read from the sdist's
   ``egg-info/requires.txt``) and openrlhf, which a cluster installs with ``--no-deps`` (it pins
   flash-attn, which has no wheel);
2. ``pip install --dry-run --report`` (pip >= 24, run from its wheel if the local pip is older)
   resolves the wheel part for the target platform (``--platform`` manylinux tags,
   ``--python-version``, ``--only-binary=:all:``), isolated from this machine's pip configuration
   (``PIP_CONFIG_FILE`` = os.devnull, no ``PIP_*`` variables but the CA bundle, ``--index-url``); the
   versions resolve in parallel. pip evaluates environment markers for the interpreter running it, so
   ``python3.X`` from PATH runs it when there is one; otherwise the requirements whose markers hold
   only on the target are added and the version resolved again (:func:`missed_by_markers`);
3. :func:`analyse` checks every requirement of every resolved package, of the separately installed
   ones and of setup.py against the resolved versions, markers evaluated for the target (torch as
   vllm pins it vs what deepspeed, openrlhf, flash-attn and megatron-core need; transformers; ray...);
4. the install a CUDA cluster needs is printed, in order (:func:`install_commands`).

An index that does not advertise PEP 658 metadata files (some proxies strip the attribute) would
make pip download every wheel (~4 GB per Python version, minutes); the registry's files do have
``<wheel>.metadata`` beside them, so the check then resolves through a local proxy that adds the
attribute back (:class:`MetadataProxy`) and serves each ``.metadata`` from the registry (or, where
a file has none, from the wheel itself).

``--node`` checks this machine instead, as installed: can it load the C++/CUDA op of DeepSpeed's
optimizer (``fused_adam``; ``cpu_adam`` with ``--adam-offload``; nothing with ``--backend megatron``)?
Either deepspeed holds it pre-built for this torch, or the node can JIT-compile it: ninja, a C++
compiler and the nvcc of torch's CUDA version under CUDA_HOME (``openrlhf_lpo/cli/gpu_build.py``, the
check ``lpo-train`` runs on every GPU node at start).

Usage:
    python scripts/check_gpu_install.py                       # resolve 3.10-3.12 and check
    python scripts/check_gpu_install.py --python 3.11 --out DIR   # also write one report per version
    python scripts/check_gpu_install.py --reports DIR         # check reports written before (offline)
    python scripts/check_gpu_install.py --node [--adam-offload] [--backend megatron]   # this node
Exit status: 0 the pins agree (--node: the op loads); 1 a conflict or a failed resolution (named)
(--node: what is missing, named); 2 bad usage; 3 the registry could not be reached (nothing was checked).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import http.client
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
DEFAULT_INDEX = "https://pypi.org/simple"
PYTHONS = ("3.10", "3.11", "3.12")
# installed on their own, before `pip install -e .[gpu,eval]`: not part of the wheel resolution
NO_DEPS = ("openrlhf",)
# packages whose every requirement is listed in the summary (the pins that must agree)
KEY = ("torch", "vllm", "transformers", "ray", "deepspeed", "flash-attn", "openrlhf", "megatron-core",
       "tokenizers", "huggingface-hub", "triton", "numpy")
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
TIMEOUT = 60


class RegistryUnreachable(RuntimeError):
    """The index did not answer (no network, DNS, proxy): nothing could be checked."""


class ResolutionFailed(RuntimeError):
    """pip could not resolve the requirements (a conflict pip found itself)."""


# ----------------------------------------------------------------------------- setup.py


def setup_extras(setup_py: Path = REPO / "setup.py") -> Tuple[List[str], Dict[str, List[str]]]:
    """``(install_requires, extras_require)`` of setup.py, read by evaluating its requirement-list
    assignments (module-level names bound to lists, their sums and the ``extras_require`` dict)."""
    tree = ast.parse(setup_py.read_text())
    env: Dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            if isinstance(node.value, (ast.List, ast.BinOp)):
                env[node.targets[0].id] = eval(compile(ast.Expression(node.value), "setup.py", "eval"),
                                               {"__builtins__": {}}, env)
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: k.value for k in call.keywords}
    scope = {"__builtins__": {}, **env}
    install = eval(compile(ast.Expression(kw["install_requires"]), "setup.py", "eval"), scope)
    extras = eval(compile(ast.Expression(kw["extras_require"]), "setup.py", "eval"), scope)
    return list(install), {k: list(v) for k, v in extras.items()}


def requested_requirements(extras: Iterable[str], setup_py: Path = REPO / "setup.py") -> List[str]:
    install, table = setup_extras(setup_py)
    unknown = [e for e in extras if e not in table]
    if unknown:
        raise SystemExit(f"--extras: {unknown} not in setup.py's extras_require ({sorted(table)})")
    out = list(install)
    for e in extras:
        out += [r for r in table[e] if r not in out]
    return out


# ----------------------------------------------------------------------------- registry


_POOL: Dict[Tuple[str, str], List[http.client.HTTPConnection]] = {}  # idle kept-alive connections per host
_CACHE: Dict[Tuple[str, Optional[str]], bytes] = {}  # GET responses of this run (pages and metadata)
_LOCK = threading.Lock()


def _get(url: str, accept: Optional[str] = None, timeout: float = TIMEOUT, cache: bool = True) -> bytes:
    """GET over a pool of kept-alive connections (through an intercepting proxy a TLS handshake costs
    more than the request), cached for the run; HTTP errors raise urllib.error.HTTPError, a network
    failure RegistryUnreachable."""
    key = (url, accept)
    if cache and key in _CACHE:
        return _CACHE[key]
    parts = urllib.parse.urlsplit(url)
    host = (parts.scheme, parts.netloc)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    for attempt in (0, 1):
        with _LOCK:
            idle = _POOL.setdefault(host, [])
            conn = idle.pop() if idle else None
        if conn is None:
            cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            conn = cls(parts.netloc, timeout=timeout)
        try:
            conn.request("GET", path, headers={"Accept": accept} if accept else {})
            r = conn.getresponse()
            body = r.read()
        except (http.client.HTTPException, OSError) as e:
            conn.close()
            if attempt:
                raise RegistryUnreachable(f"{url}: {e}") from None
            continue
        with _LOCK:
            _POOL[host].append(conn)
        if r.status in (301, 302, 303, 307, 308) and r.getheader("Location"):
            return _get(urllib.parse.urljoin(url, r.getheader("Location")), accept, timeout, cache)
        if r.status != 200:
            raise urllib.error.HTTPError(url, r.status, r.reason, r.headers, None)
        if cache:
            with _LOCK:
                _CACHE[key] = body
        return body
    raise AssertionError("unreachable")


class Index:
    """A PEP 691 (JSON) simple index: project pages, sdist requirements, wheel metadata."""

    JSON = "application/vnd.pypi.simple.v1+json"

    def __init__(self, url: str = DEFAULT_INDEX):
        self.url = url.rstrip("/")
        self._pages: Dict[str, dict] = {}

    def project(self, name: str) -> dict:
        key = canonicalize_name(name)
        if key not in self._pages:
            self._pages[key] = json.loads(_get(f"{self.url}/{key}/", self.JSON))
        return self._pages[key]

    def files(self, name: str, version: str) -> List[dict]:
        """The project's files of exactly ``version`` (wheel or sdist filenames)."""
        v = Version(version)
        out = []
        for f in self.project(name)["files"]:
            fv = _file_version(f["filename"])
            if fv is not None and fv == v and not f.get("yanked"):
                out.append(f)
        return out

    def versions(self, name: str, specifier: SpecifierSet, wheel: bool) -> List[Version]:
        """Versions satisfying ``specifier`` that have a wheel (``wheel``) or an sdist, newest first
        (pre-releases only where the specifier names one)."""
        ends = (".whl",) if wheel else (".tar.gz", ".zip")
        pre = any(Version(s.version.rstrip(".*")).is_prerelease for s in specifier)
        out = set()
        for f in self.project(name)["files"]:
            v = _file_version(f["filename"])
            if v is not None and f["filename"].endswith(ends) and not f.get("yanked") \
                    and specifier.contains(v, prereleases=pre):
                out.add(v)
        return sorted(out, reverse=True)

    def advertises_metadata(self, name: str = "vllm") -> bool:
        """Does the index mark its wheels' PEP 658 metadata files (pip then needs no wheel download)?"""
        wheels = [f for f in self.project(name)["files"] if f["filename"].endswith(".whl")]
        return bool(wheels) and bool(wheels[-1].get("core-metadata") or wheels[-1].get("data-dist-info-metadata"))

    def sdist_requires(self, name: str, version: str) -> Dict[str, object]:
        """The sdist's unconditional requirements (``egg-info/requires.txt``'s top and ``[:marker]``
        sections, else PKG-INFO's Requires-Dist), with the file it came from."""
        sdists = [f for f in self.files(name, version) if f["filename"].endswith((".tar.gz", ".zip"))]
        if not sdists:
            raise ResolutionFailed(f"{name}=={version}: neither a wheel nor an sdist on {self.url}")
        f = sdists[0]
        data = _get(f["url"], cache=False)
        digest = f.get("hashes", {}).get("sha256")
        if digest and hashlib.sha256(data).hexdigest() != digest:
            raise ResolutionFailed(f"{f['filename']}: sha256 differs from the index's")
        return {"version": version, "requires_dist": requires_from_sdist(data, f["filename"]),
                "source": f"{f['filename']} (egg-info/requires.txt)"}

    def wheel_requires(self, name: str, version: str, python: str) -> Dict[str, object]:
        """Requires-Dist of the package's wheel for ``python`` (its PEP 658 ``.metadata`` file)."""
        tag = "cp" + python.replace(".", "")
        wheels = [f for f in self.files(name, version) if f["filename"].endswith(".whl")]
        pick = [f for f in wheels if f"-{tag}-" in f["filename"] and "x86_64" in f["filename"]] or \
            [f for f in wheels if "-none-any" in f["filename"] or "abi3" in f["filename"]] or wheels
        if not pick:
            raise ResolutionFailed(f"{name}=={version}: no wheel on {self.url}")
        meta = wheel_metadata(pick[0]["url"])
        return {"version": version, "requires_dist": metadata_field(meta, "Requires-Dist"),
                "requires_python": (metadata_field(meta, "Requires-Python") or [None])[0],
                "source": f"{pick[0]['filename']} (METADATA)"}


_VERSION_RE = re.compile(r"^(?P<name>[A-Za-z0-9_.\-]+?)-(?P<version>\d[^-]*?)(?:-|\.tar\.gz$|\.zip$)")


def _file_version(filename: str) -> Optional[Version]:
    m = _VERSION_RE.match(filename)
    if not m:
        return None
    try:
        return Version(m.group("version"))
    except Exception:  # noqa: BLE001 - a file name that is no PEP 440 version
        return None


def requires_from_sdist(data: bytes, filename: str) -> List[str]:
    """Unconditional requirements of an sdist archive (see :meth:`Index.sdist_requires`)."""
    if filename.endswith(".zip"):
        z = zipfile.ZipFile(io.BytesIO(data))
        members = {n: (lambda n=n: z.read(n)) for n in z.namelist()}
    else:
        t = tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")
        members = {m.name: (lambda m=m: t.extractfile(m).read()) for m in t.getmembers() if m.isfile()}
    req_txt = sorted(n for n in members if n.endswith(".egg-info/requires.txt") and n.count("/") == 2)
    if req_txt:
        out, marker = [], ""
        for line in members[req_txt[0]]().decode().splitlines():
            line = line.strip()
            if not line:
                continue
            if line.startswith("["):
                section = line[1:-1]
                marker = section[1:] if section.startswith(":") else None  # None: an extra, skipped
                continue
            if marker is None:
                continue
            out.append(f"{line}; {marker}" if marker else line)
        return out
    pkg_info = sorted(n for n in members if n.endswith("PKG-INFO") and n.count("/") == 1)
    if pkg_info:
        return [r for r in metadata_field(members[pkg_info[0]]().decode(), "Requires-Dist") if "extra ==" not in r]
    raise ResolutionFailed(f"{filename}: no egg-info/requires.txt or PKG-INFO in the sdist")


def metadata_field(text: str, field: str) -> List[str]:
    out = []
    for line in text.split("\n\n", 1)[0].splitlines():
        if line.lower().startswith(field.lower() + ":"):
            out.append(line.split(":", 1)[1].strip())
    return out


def wheel_metadata(url: str) -> str:
    """A wheel's METADATA: the registry's ``<url>.metadata`` (PEP 658), else read from the wheel."""
    try:
        return _get(url + ".metadata").decode()
    except urllib.error.HTTPError as e:
        if e.code != 404:
            raise
    z = zipfile.ZipFile(io.BytesIO(_get(url, cache=False)))
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
    return z.read(name).decode()


# ----------------------------------------------------------------------------- metadata proxy


class MetadataProxy:
    """A local simple index in front of ``upstream`` whose wheel entries carry PEP 658's
    ``core-metadata`` (pip then fetches ``<wheel>.metadata`` instead of the wheel): project pages are
    upstream's JSON with that key added and file URLs routed through this proxy; ``.metadata`` URLs are
    served from the registry (:func:`wheel_metadata`); any other file URL redirects to the registry."""

    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.counts = {"pages": 0, "metadata": 0, "redirects": 0, "page_s": 0.0, "metadata_s": 0.0}
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_GET(self):
                try:
                    proxy._serve(self)
                except urllib.error.HTTPError as e:
                    self.send_error(e.code)
                except RegistryUnreachable:
                    self.send_error(502)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def real_url(self, url: str) -> str:
        """The registry URL behind one of this proxy's file URLs (``/f/<scheme>/<host><path>``)."""
        prefix = self.url + "/f/"
        if not url.startswith(prefix):
            return url
        scheme, _, rest = url[len(prefix):].partition("/")
        return f"{scheme}://{rest}"

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        path = h.path.split("?", 1)[0]
        t = time.time()
        if path.startswith("/simple/"):
            self.counts["pages"] += 1
            page = json.loads(_get(f"{self.upstream}/{path[len('/simple/'):]}", Index.JSON))
            for f in page.get("files", []):
                real = urllib.parse.urljoin(f"{self.upstream}/{path[len('/simple/'):]}", f["url"])
                parts = urllib.parse.urlsplit(real)
                f["url"] = f"{self.url}/f/{parts.scheme}/{parts.netloc}{parts.path}"
                if f["filename"].endswith(".whl"):
                    f["core-metadata"] = True
                    f["data-dist-info-metadata"] = True
            body, ctype = json.dumps(page).encode(), Index.JSON
            self.counts["page_s"] += time.time() - t
        elif path.startswith("/f/") and path.endswith(".whl.metadata"):
            self.counts["metadata"] += 1
            body, ctype = wheel_metadata(self.real_url(self.url + path[:-len(".metadata")])).encode(), "text/plain"
            self.counts["metadata_s"] += time.time() - t
        elif path.startswith("/f/"):
            self.counts["redirects"] += 1
            h.send_response(302)
            h.send_header("Location", self.real_url(self.url + path))
            h.end_headers()
            return
        else:
            h.send_error(404)
            return
        h.send_response(200)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)


# ----------------------------------------------------------------------------- resolution


def pip_env() -> Dict[str, str]:
    """This process's environment without pip's configuration (files and ``PIP_*`` variables); the
    certificate bundle and timeout are kept, as are proxies (``*_PROXY``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_INPUT"] = "1"
    for key in ("PIP_CERT", "PIP_DEFAULT_TIMEOUT"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


MODERN_PIP = Version("24.0")  # its --dry-run stops after resolving: no wheel is downloaded (PEP 658 metadata)


def pip_wheel(index: "Index", workdir: Path, log=print) -> Path:
    """The newest pip wheel of the index, saved in ``workdir``: run as ``python pip-X.whl/pip`` by
    every interpreter the check uses (pips older than MODERN_PIP download every resolved wheel after
    a dry-run resolution, ~4 GB per Python version here)."""
    wheels = [f for f in index.project("pip")["files"] if f["filename"].endswith("-py3-none-any.whl")
              and not f.get("yanked") and (_file_version(f["filename"]) or Version("0")) >= MODERN_PIP
              and not (_file_version(f["filename"]) or Version("0")).is_prerelease]
    if not wheels:
        raise ResolutionFailed(f"{index.url} has no pip wheel >= {MODERN_PIP}")
    f = max(wheels, key=lambda f: _file_version(f["filename"]))
    path = workdir / f["filename"]
    data = _get(f["url"], cache=False)
    if f.get("hashes", {}).get("sha256") and hashlib.sha256(data).hexdigest() != f["hashes"]["sha256"]:
        raise ResolutionFailed(f"{f['filename']}: sha256 differs from the index's")
    path.write_bytes(data)
    log(f"[check_gpu_install] resolving with {f['filename']} (run from the wheel)")
    return path


def interpreter_for(python: str) -> Optional[str]:
    """A ``python3.X`` on PATH that is CPython ``python`` (pip evaluates environment markers against the
    interpreter that runs it, whatever ``--python-version`` says), else None."""
    import shutil

    exe = shutil.which(f"python{python}")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "-c", "import sys, platform; print('%d.%d' % sys.version_info[:2], "
                              "platform.python_implementation())"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return exe if out.returncode == 0 and out.stdout.split() == [python, "CPython"] else None


def missed_by_markers(install: List[dict], separate: Dict[str, dict], python: str) -> List[str]:
    """Requirements with an environment marker that holds on the target and that a resolution run by
    another interpreter did not honour (a package left out, e.g. ``tomli; python_version < "3.11"``
    for 3.10 resolved by 3.11, or a version outside the range, e.g. vllm's ``setuptools<81;
    python_version > "3.11"`` for 3.12), as marker-free strings to add to the resolution."""
    versions = {canonicalize_name(d["name"]): d["version"] for d in install}
    versions.update({canonicalize_name(n): s["version"] for n, s in separate.items()})
    out = []
    for d in install:
        for raw in d["requires_dist"]:
            req = Requirement(raw)
            if req.marker is None or not _applies(req, python, d.get("requested_extras", [])):
                continue
            found = versions.get(canonicalize_name(req.name))
            if found is None or not req.specifier.contains(found, prereleases=True):
                out.append(f"{req.name}{'[' + ','.join(sorted(req.extras)) + ']' if req.extras else ''}{req.specifier}")
    return sorted(set(out))


def pip_command(python: str, requirements: List[str], index_url: str, report: Path, target: Path,
                launcher: Optional[List[str]] = None) -> List[str]:
    tag = "cp" + python.replace(".", "")
    cmd = list(launcher or [sys.executable, "-m", "pip"]) + ["install", "--dry-run", "--quiet", "--ignore-installed",
           "--report", str(report), "--target", str(target), "--only-binary=:all:", "--index-url", index_url,
           "--python-version", python, "--implementation", "cp", "--abi", tag, "--abi", "abi3", "--abi", "none"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    return cmd + requirements


def trim_report(report: dict, real_url=lambda u: u) -> List[dict]:
    """The fields of pip's installation report the analysis reads (pip's report holds every
    package's full metadata, ~2 MB)."""
    out = []
    for item in report["install"]:
        m = item["metadata"]
        out.append({"name": m["name"], "version": m["version"], "requires_dist": m.get("requires_dist", []),
                    "requires_python": m.get("requires_python"), "requested": bool(item.get("requested")),
                    "requested_extras": item.get("requested_extras") or [],
                    "url": real_url(item["download_info"]["url"])})
    return sorted(out, key=lambda d: canonicalize_name(d["name"]))


def split_requirements(python: str, extras: List[str], index: Index) -> Tuple[List[str], Dict[str, dict]]:
    """``(wheel requirements for pip, separately installed packages)`` of one Python version: openrlhf
    (``--no-deps``) and every sdist-only requirement leave the resolution, their own requirements join it."""
    requested = requested_requirements(extras)
    separate: Dict[str, dict] = {}
    wheel_reqs: List[str] = []
    queue = list(requested)
    for name in NO_DEPS:
        pins = [r for r in requested if canonicalize_name(Requirement(r).name) == name]
        if pins:
            version = str(next(iter(Requirement(pins[0]).specifier)).version)
            separate[name] = dict(index.wheel_requires(name, version, python), how="--no-deps")
            queue += separate[name]["requires_dist"]
    seen = set()
    while queue:
        raw = queue.pop(0)
        req = Requirement(raw)
        name = canonicalize_name(req.name)
        if req.marker is not None and not req.marker.evaluate(target_env(python)):
            continue
        if name in NO_DEPS or raw in seen:
            continue
        seen.add(raw)
        if not index.versions(name, req.specifier, wheel=True):  # sdist only: its requirements instead
            sdists = index.versions(name, req.specifier, wheel=False)
            if not sdists:
                raise ResolutionFailed(f"{raw}: no wheel or sdist on {index.url}")
            if name not in separate:
                separate[name] = dict(index.sdist_requires(name, str(sdists[0])), how="sdist")
                queue += separate[name]["requires_dist"]
            continue
        # the marker was evaluated above for the target: pip would evaluate it for this interpreter
        wheel_reqs.append(f"{req.name}{'[' + ','.join(sorted(req.extras)) + ']' if req.extras else ''}{req.specifier}")
    return wheel_reqs, separate


def resolve_all(pythons: List[str], extras: List[str], index: Index, log=print) -> List[dict]:
    """One resolution per Python version (in parallel: one pip process each, one shared metadata proxy
    and cache): separately installed packages, pip's wheel resolution (trimmed) and timings.
    Raises RegistryUnreachable or ResolutionFailed."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        proxy = None if index.advertises_metadata() else MetadataProxy(index.url)
        if proxy:
            log(f"[check_gpu_install] {index.url} does not advertise PEP 658 metadata: resolving through a "
                f"local proxy that serves each wheel's .metadata ({proxy.url})")
            proxy.__enter__()
        try:
            wheel = pip_wheel(index, Path(tmp), log)
            with ThreadPoolExecutor(len(pythons)) as pool:
                futures = [pool.submit(_resolve_one, py, extras, index, proxy, wheel, Path(tmp) / py, log)
                           for py in pythons]
                out = [f.result() for f in futures]
        finally:
            if proxy:
                proxy.__exit__(None, None, None)
    for r in out:
        r["seconds"]["all_versions"] = round(time.time() - t0, 1)
        r["proxy"] = dict(proxy.counts) if proxy else None
    return out


def _resolve_one(python, extras, index, proxy, wheel: Path, tmp: Path, log) -> dict:
    t0 = time.time()
    tmp.mkdir(parents=True)
    wheel_reqs, separate = split_requirements(python, extras, index)
    exe = interpreter_for(python)
    log(f"[check_gpu_install] Python {python}: resolving {len(wheel_reqs)} requirements "
        f"({', '.join(sorted(separate))} installed separately) with "
        f"{exe or sys.executable + ' (no python' + python + ' here: markers re-checked for ' + python + ')'}")
    url = f"{proxy.url}/simple" if proxy else index.url
    added: List[str] = []
    pip_s = 0.0
    for _ in range(4):  # another interpreter's pip: add what the target's markers need, resolve again
        report_path = tmp / "report.json"
        t1 = time.time()
        p = subprocess.run(pip_command(python, wheel_reqs + added, url, report_path, tmp / "target",
                                       [exe or sys.executable, str(wheel / "pip")]),
                           env=pip_env(), capture_output=True, text=True, timeout=3600)
        pip_s += time.time() - t1
        if p.returncode != 0:
            text = (p.stderr + p.stdout).strip()
            if re.search(r"(NewConnectionError|Name or service not known|Temporary failure in name resolution|"
                         r"Max retries exceeded|Network is unreachable|502)", text):
                raise RegistryUnreachable(text.splitlines()[-1] if text else "pip could not reach the index")
            raise ResolutionFailed(f"Python {python}: pip could not resolve:\n" + "\n".join(text.splitlines()[-25:]))
        report = json.loads(report_path.read_text())
        install = trim_report(report, proxy.real_url if proxy else (lambda u: u))
        missed = [] if exe else missed_by_markers(install, separate, python)
        if not missed:
            break
        log(f"[check_gpu_install] Python {python}: adding {', '.join(missed)} (markers true for {python})")
        added += missed
    log(f"[check_gpu_install] Python {python}: resolved {len(install)} packages in {time.time() - t0:.0f} s")
    return {"python": python, "platform": "linux_x86_64", "extras": list(extras), "index": index.url,
            "pip_version": report.get("pip_version"), "interpreter": "python" + python if exe else
            f"{sys.version_info[0]}.{sys.version_info[1]} with --python-version (markers re-checked)",
            "requirements": wheel_reqs + added, "separate": separate, "install": install,
            "seconds": {"total": round(time.time() - t0, 1), "pip": round(pip_s, 1)}}


# ----------------------------------------------------------------------------- analysis


def target_env(python: str, extra: str = "") -> Dict[str, str]:
    """PEP 508 marker environment of CPython ``python`` on Linux x86_64."""
    return {"python_version": python, "python_full_version": python + ".0", "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "platform_release": "", "platform_version": "", "implementation_name": "cpython",
            "implementation_version": python + ".0", "platform_python_implementation": "CPython", "extra": extra}


def _applies(req: Requirement, python: str, extras: Iterable[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate(target_env(python, e)) for e in ([""] + list(extras)))


def analyse(resolution: dict) -> dict:
    """Every requirement of the resolved packages, of the separately installed ones and of setup.py
    against the resolved versions. Returns ``{"versions", "checks", "conflicts", "key"}``: ``checks``
    one row per applicable requirement (``by``, ``on``, ``spec``, ``found``, ``ok``), ``conflicts`` the
    failing rows and the packages whose Requires-Python excludes the target, ``key`` the rows on KEY."""
    python = resolution["python"]
    versions = {canonicalize_name(d["name"]): d["version"] for d in resolution["install"]}
    for name, sep in resolution["separate"].items():
        versions[canonicalize_name(name)] = sep["version"]
    sources = [(f"{d['name']} {d['version']}", d["requires_dist"], d.get("requested_extras", []),
                d.get("requires_python")) for d in resolution["install"]]
    sources += [(f"{n} {s['version']} ({s['how']})", s["requires_dist"], [], s.get("requires_python"))
                for n, s in resolution["separate"].items()]
    install, table = setup_extras()
    own = list(install) + [r for e in resolution["extras"] for r in table.get(e, [])]
    sources.append((f"setup.py [{','.join(resolution['extras'])}]", own, [], None))
    checks, conflicts = [], []
    for by, reqs, extras, requires_python in sources:
        if requires_python and Version(python + ".0") not in SpecifierSet(requires_python):
            conflicts.append({"by": by, "on": "python", "spec": requires_python, "found": python, "ok": False})
        for raw in reqs:
            req = Requirement(raw)
            if not _applies(req, python, extras):
                continue
            name = canonicalize_name(req.name)
            found = versions.get(name)
            ok = found is not None and req.specifier.contains(found, prereleases=True)
            row = {"by": by, "on": name, "spec": str(req.specifier) or "(any)", "found": found, "ok": ok}
            checks.append(row)
            if not ok:
                conflicts.append(row)
    key = [c for c in checks if c["on"] in KEY]
    return {"python": python, "versions": {k: versions.get(k) for k in KEY if versions.get(k)}, "checks": checks,
            "conflicts": conflicts, "key": key, "cuda": torch_cuda(resolution),
            "vllm_cuda": package_cuda(resolution, "vllm")}


def torch_cuda(resolution: dict) -> Optional[str]:
    """The CUDA version the resolved torch wheel is built for, from its pin of the CUDA runtime
    (``cuda-toolkit==13.0.3`` for torch 2.13's Linux wheel, ``nvidia-cuda-runtime-cu12==12.x`` before)."""
    torch = next((d for d in resolution["install"] if canonicalize_name(d["name"]) == "torch"), None)
    for raw in (torch or {}).get("requires_dist", []):
        req = Requirement(raw)
        name = canonicalize_name(req.name)
        if name == "cuda-toolkit" or name.startswith("nvidia-cuda-runtime"):
            pins = [s.version for s in req.specifier if s.operator == "=="]
            if pins:
                v = Version(pins[0])
                return f"{v.major}.{v.minor}"
    return None


def package_cuda(resolution: dict, name: str) -> Optional[str]:
    """The CUDA major version a package's wheel is built for, from its ``-cuXX`` / ``[cuXX]``
    requirements (vllm 0.29.0: ``nvidia-cutlass-dsl[cu13]``, ``humming-kernels[cu13]``), else None."""
    dist = next((d for d in resolution["install"] if canonicalize_name(d["name"]) == name), None)
    majors = set()
    for raw in (dist or {}).get("requires_dist", []):
        req = Requirement(raw)
        if req.marker is not None and "extra" in str(req.marker):
            continue
        for tag in [canonicalize_name(req.name).rsplit("-", 1)[-1], *req.extras]:
            m = re.fullmatch(r"cu(\d{2})", tag)
            if m:
                majors.add(m.group(1))
    return ",".join(sorted(majors)) or None


def install_commands(analyses: List[dict]) -> List[str]:
    """The install a CUDA cluster needs, in order, with the versions the resolution agreed on."""
    a = analyses[0]
    v = a["versions"]
    cuda = a.get("cuda")
    cu = f"cu{cuda.replace('.', '')}" if cuda else "cuXYZ"
    pys = ", ".join(x["python"] for x in analyses)
    fa = v.get("flash-attn", "2.8.3")
    torch_mm = ".".join(v.get("torch", "?").split(".")[:2])
    return [
        f"# CUDA cluster, Linux x86_64, Python {pys}: a fresh venv, then in this order",
        f"pip install torch=={v.get('torch')} --index-url https://download.pytorch.org/whl/{cu}"
        f"   # the torch vllm {v.get('vllm')} pins; PyPI's Linux wheel of it is CUDA {cuda or '?'} too"
        f" (driver >= {'580' if cuda and cuda.startswith('13') else 'the one that CUDA needs'})",
        f"pip install vllm=={v.get('vllm')}   # keeps torch {v.get('torch')}"
        + (f"; its PyPI wheel is a CUDA {a['vllm_cuda']} build too" if a.get("vllm_cuda") else ""),
        "pip install packaging psutil ninja wheel setuptools   # flash-attn's build requirements",
        f"pip install <flash_attn-{fa}+cu{cuda.split('.')[0] if cuda else 'XY'}torch{torch_mm}cxx11abiTRUE-cpXY-cpXY-"
        f"linux_x86_64.whl>   # a prebuilt wheel for this torch/CUDA/Python ABI, if you have one; else:",
        f"MAX_JOBS=8 pip install flash-attn=={fa} --no-build-isolation   # source build: needs nvcc (CUDA "
        f"{cuda or '?'} toolkit) and tens of minutes",
        "DS_BUILD_FUSED_ADAM=1 DS_BUILD_CPU_ADAM=1 TORCH_CUDA_ARCH_LIST=9.0 "
        f"pip install deepspeed=={v.get('deepspeed')} --no-build-isolation --no-cache-dir --force-reinstall --no-deps"
        "   # compiles DeepSpeed's Adam ops now, so no node compiles them at run"
        f" time: run it on a GPU node with CUDA_HOME at a CUDA {cuda or '?'} toolkit (torch's); 9.0 = H100/H200",
        f"pip install openrlhf=={v.get('openrlhf')} --no-deps   # its other requirements come with the next line",
        "pip install -e '.[gpu,eval]'   # add ,megatron for --backend megatron",
    ]


def summarise(analyses: List[dict]) -> List[str]:
    lines = []
    for a in analyses:
        v = a["versions"]
        lines.append(f"Python {a['python']}: " + ", ".join(f"{k} {v[k]}" for k in KEY if k in v)
                     + (f"; torch wheel CUDA {a['cuda']}" if a.get("cuda") else ""))
        for name in ("torch", "transformers", "ray", "flash-attn"):
            rows = [c for c in a["key"] if c["on"] == name and c["spec"] != "(any)"]
            if rows:
                lines.append(f"  {name} {v.get(name)} must satisfy: "
                             + "; ".join(f"{c['by']} {c['spec']}{'' if c['ok'] else ' (NO)'}" for c in rows))
        lines.append(f"  {len(a['checks'])} requirements checked, {len(a['conflicts'])} conflicts")
        for c in a["conflicts"]:
            lines.append(f"  CONFLICT: {c['by']} requires {c['on']} {c['spec']}, resolved {c['found']}")
    return lines


def _log(message: str) -> None:
    with _LOCK:  # one line at a time from the resolving threads
        sys.stdout.write(message + "\n")
        sys.stdout.flush()


def node_check(backend: str, adam_offload: bool) -> int:
    """``--node``: print what this machine offers DeepSpeed's optimizer op and whether it can load it."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from openrlhf_lpo.cli import gpu_build

    op = gpu_build.needed_op(backend, adam_offload, critic=False)
    f = gpu_build.gather_facts()
    home, how = gpu_build.toolkit_home(f.env, f.which.get("nvcc"), f.usr_local_cuda)
    release = gpu_build.nvcc_release(f.nvcc_text)
    pre = [o for o in gpu_build.OPS if gpu_build.is_prebuilt(o, f)]
    cxx = gpu_build.compiler_name(f.env)
    print(f"host {f.host}, {f.nvidia_gpus} NVIDIA GPU(s): torch {f.torch_version} (CUDA {f.torch_cuda}), deepspeed "
          f"{f.ds_version or 'not installed'} (ops compiled in for the GPU: {', '.join(pre) or 'none'})")
    print(f"  CUDA_HOME: {home or 'none'}{f' (from {how})' if home else ''}; nvcc release "
          f"{'%d.%d' % release if release else 'none'}; ninja: {f.which.get('ninja') or 'none'}; "
          f"{cxx}: {f.which.get(cxx) or 'none'}")
    flags = f"--backend {backend}" + (" --ds.adam_offload" if adam_offload else "")
    if op is None:
        print(f"[check_gpu_install] PASS: {flags} trains with no DeepSpeed op (megatron-core's optimizer)")
        return 0
    print(f"  {flags}: the optimizer loads {op} ({gpu_build.OPS[op]})")
    problems = gpu_build.build_problems(op, f)
    for line in problems:
        print(f"  PROBLEM: {line}")
    verdict = "FAIL" if problems else "PASS"
    how_loaded = "pre-built" if op in pre else "JIT-compiled at the first deepspeed.initialize"
    print(f"[check_gpu_install] {verdict}: {op} " + (f"cannot load here ({len(problems)} problem(s))" if problems
                                                      else f"loads here ({how_loaded})"))
    return 1 if problems else 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python", default=",".join(PYTHONS), help="Python versions, comma-separated")
    p.add_argument("--extras", default="gpu,eval,megatron", help="setup.py extras, comma-separated")
    p.add_argument("--index-url", default=DEFAULT_INDEX, help="a PEP 691 simple index (default PyPI)")
    p.add_argument("--out", default=None, help="write report-py<X>.json (the trimmed resolution) per version here")
    p.add_argument("--reports", default=None, help="check the report-py*.json in this folder instead (offline)")
    p.add_argument("--node", action="store_true",
                   help="check this machine instead: can it load DeepSpeed's optimizer op (pre-built or JIT)")
    p.add_argument("--adam-offload", action="store_true", help="with --node: the run uses --ds.adam_offload")
    p.add_argument("--backend", default="deepspeed", choices=("deepspeed", "megatron"),
                   help="with --node: the run's --backend")
    a = p.parse_args(argv)
    if a.node:
        return node_check(a.backend, a.adam_offload)
    pythons = [x.strip() for x in a.python.split(",") if x.strip()]
    if not all(re.fullmatch(r"3\.\d+", x) for x in pythons):
        p.error(f"--python {a.python}: give versions like 3.10,3.11,3.12")
    extras = [x.strip() for x in a.extras.split(",") if x.strip()]
    resolutions = []
    if a.reports:
        files = sorted(Path(a.reports).glob("report-py*.json"))
        if not files:
            p.error(f"--reports {a.reports}: no report-py*.json there")
        resolutions = [json.loads(f.read_text()) for f in files]
    else:
        try:
            resolutions = resolve_all(pythons, extras, Index(a.index_url), log=_log)
        except RegistryUnreachable as e:
            print(f"[check_gpu_install] NOT RUN: the registry {a.index_url} is unreachable ({e})", file=sys.stderr)
            return 3
        except ResolutionFailed as e:
            print(f"[check_gpu_install] FAIL: {e}", file=sys.stderr)
            return 1
        if a.out:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            for r in resolutions:
                Path(a.out, f"report-py{r['python']}.json").write_text(json.dumps(r, indent=1) + "\n")
    analyses = [analyse(r) for r in resolutions]
    print("\n".join(summarise(analyses)))
    print("\n".join([""] + install_commands(analyses)))
    bad = sum(len(x["conflicts"]) for x in analyses)
    print(f"\n[check_gpu_install] {'PASS' if not bad else 'FAIL'}: {len(analyses)} Python versions, {bad} conflicts")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
