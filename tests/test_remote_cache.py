"""The remote cache against a real OCI registry (the CNCF Distribution registry, Debian's
docker-registry), started here on 127.0.0.1 with its own storage and stopped at the end.

Each "host" is a subprocess with its own cache and staging folders; every one that could
hang runs with a timeout."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from child_env import PYTHON_PATH

pytest.importorskip("cryptography", reason="the remote cache needs `cryptography` (jitk[remote])")
REGISTRY = shutil.which("docker-registry")
pytestmark = pytest.mark.skipif(
    REGISTRY is None, reason="no docker-registry binary (apt-get install -y docker-registry)")

from cryptography.hazmat.primitives import serialization  # noqa: E402

from jitk.build import remote, signing  # noqa: E402  (after the skip: needs cryptography)
from jitk.tools import local_registry  # noqa: E402

HOST_SECONDS = 600  # one host's builds (two CUDA modules for sm_90) on a slow machine
ADD_ONE = """
import json, sys, time
from jitk.build.jit import build_count, load_jit
started = time.monotonic()
try:
    module = load_jit("addone", cpp_files=[sys.argv[1]], cpp_wrappers=[("add_one", "add_one")])
finally:
    print("load seconds", time.monotonic() - started, file=sys.stderr)
print(json.dumps({"builds": build_count(), "sum": module.add_one(41)}))
"""
# ADD_ONE, then this process's load_jit events counted by kind (jitk/build/events.py).
ADD_ONE_EVENTS = ADD_ONE + """
from jitk.build.events import jit_stats
print(json.dumps({kind: found["count"] for kind, found in jit_stats().items() if kind != "events"}))
"""
SHIPPED = """
from jitk.kernels import green, wait_value
for family in (green, wait_value):
    family.precompile_configs()[0][1]()
""" + ADD_ONE


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """oci://127.0.0.1:PORT, and the registry's log (one line a request)."""
    with local_registry.running(tmp_path_factory.mktemp("registry"), binary=REGISTRY) as served:
        yield served.url, served.log


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    signing.keygen(folder / "fleet")
    signing.keygen(folder / "stranger")
    return folder


def _host(folder: Path, code: str, *arguments: str, timeout: float = HOST_SECONDS,
          **settings: str) -> subprocess.CompletedProcess:
    """Runs `code` (or `-m jitk ...` when code is "") as a host whose caches are in
    `folder`, with no GPU and sm_90 as its target (unless `settings` say otherwise)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JITK_")}
    env.update({"PYTHONPATH": PYTHON_PATH, "CUDA_VISIBLE_DEVICES": "",
                "JITK_CUDA_ARCH": "9.0", "JITK_CACHE_DIR": str(folder / "cache"),
                "JITK_STAGING_DIR": str(folder / "staging"), **settings})
    command = [sys.executable, *(["-c", code] if code else ["-m", "jitk"]), *arguments]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def _entries(folder: Path) -> list[str]:
    cache = folder / "cache"
    return sorted(p.name for p in cache.iterdir() if p.is_dir() and not p.name.startswith(
        ".")) if cache.is_dir() else []


def _leftovers(folder: Path) -> list[str]:
    """Staging folders and private copies left behind."""
    found = [*(folder / "staging").glob("jitk-*"), *(folder / "cache" / ".staging").glob("*")]
    return sorted(p.name for p in found)


@pytest.fixture(scope="module")
def fleet(registry, keys, tmp_path_factory):
    """A first host built two shipped modules for sm_90 and a host-only one, and pushed them
    to <registry>/fleet; its settings for pulling, the header and the entries."""
    header = tmp_path_factory.mktemp("src") / "add_one.h"
    header.write_text("inline long add_one(long x) { return x + 1; }\n")
    builder = tmp_path_factory.mktemp("host_a")
    settings = {"JITK_REMOTE_CACHE": f"{registry[0]}/fleet",
                "JITK_REMOTE_CACHE_KEY": str(keys / "fleet" / "jitk-remote.key"),
                "JITK_REMOTE_CACHE_TRUST": str(keys / "fleet" / "jitk-remote.pub")}
    built = _host(builder, SHIPPED, str(header), **settings)
    assert built.returncode == 0, built.stderr
    assert json.loads(built.stdout.splitlines()[-1]) == {"builds": 3, "sum": 42}
    pushed = _host(builder, "", "cache", "push", **settings)
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    assert "pushed 3 of 3 entries" in pushed.stdout
    return {"settings": settings, "header": str(header), "entries": _entries(builder),
            "builder": builder}


def test_second_host_loads_everything_without_compiling(fleet, tmp_path):
    loaded = _host(tmp_path, SHIPPED, fleet["header"], JITK_DISABLE_JIT="1",
                   **fleet["settings"])
    assert loaded.returncode == 0, loaded.stderr
    assert json.loads(loaded.stdout.splitlines()[-1]) == {"builds": 0, "sum": 42}
    assert _entries(tmp_path) == fleet["entries"]
    for name in fleet["entries"]:  # the bytes published are the bytes built
        for file in (fleet["builder"] / "cache" / name).iterdir():
            assert (tmp_path / "cache" / name / file.name).read_bytes() == file.read_bytes()
    assert _leftovers(tmp_path) == []


def test_cache_pull_warms_a_node(fleet, tmp_path):
    pulled = _host(tmp_path, "", "cache", "pull", timeout=120, **fleet["settings"])
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    assert "3 fetched, 0 already cached, 0 failed" in pulled.stdout
    assert _entries(tmp_path) == fleet["entries"]
    again = _host(tmp_path, "", "cache", "pull", timeout=120, **fleet["settings"])
    assert "0 fetched, 3 already cached" in again.stdout
    other = _host(tmp_path / "sm100", "", "cache", "pull", timeout=120, JITK_CUDA_ARCH="10.0",
                  **fleet["settings"])  # a node of another GPU takes the host code only
    assert "1 entries" in other.stdout and "1 fetched" in other.stdout, other.stdout
    assert [n.split("_")[0] for n in _entries(tmp_path / "sm100")] == ["addone"]


def test_an_unknown_signer_is_refused_and_nothing_is_loaded(fleet, keys, tmp_path):
    settings = {**fleet["settings"],
                "JITK_REMOTE_CACHE_TRUST": str(keys / "stranger" / "jitk-remote.pub")}
    loaded = _host(tmp_path, ADD_ONE, fleet["header"], JITK_DISABLE_JIT="1", timeout=120,
                   **settings)
    assert loaded.returncode != 0
    assert "JitCacheMissError" in loaded.stderr
    assert "addone_" in loaded.stderr and "which no file of JITK_REMOTE_CACHE_TRUST holds" \
        in loaded.stderr
    assert _entries(tmp_path) == [] and _leftovers(tmp_path) == []


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _call(url: str, method: str = "GET", data: bytes | None = None, **headers: str):
    request = urllib.request.Request(url, method=method, data=data, headers=headers)
    with urllib.request.urlopen(request, timeout=10) as reply:
        return reply.headers, reply.read()


def _upload(where: remote.Remote, data: bytes) -> None:
    """A blob pushed by hand, as a forger with write access to the registry would."""
    headers, _ = _call(where.url("blobs/uploads/"), "POST", b"")
    url = urllib.parse.urljoin(where.base + "/", headers["Location"])
    _call(f"{url}{'&' if '?' in url else '?'}digest={_sha(data)}", "PUT", data,
          **{"Content-Type": "application/octet-stream"})


@pytest.mark.parametrize("forgery", ["tampered", "unsigned", "other key", "other archs"])
def test_forged_artifacts_are_refused(fleet, tmp_path, monkeypatch, forgery):
    """Each forgery of the host-only entry is refused with the entry's name and the reason,
    and leaves nothing in the cache or its staging folders."""
    for name, value in fleet["settings"].items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("JITK_STAGING_DIR", str(tmp_path / "staging"))
    where = remote.configured()
    name = next(n for n in fleet["entries"] if n.startswith("addone_"))
    key = json.loads((fleet["builder"] / "cache" / name / "jitk-meta.json").read_text())["key"]
    found = remote.manifest(where, remote.tag_of(key), name)
    archs: tuple[str, ...] = ()
    if forgery == "tampered":  # other files under the signed statement
        _, layer = _call(where.url(f"blobs/{found['layers'][0]['digest']}"))
        layer = layer.replace(b"add_one", b"add_two", 1)
        _upload(where, layer)
        found["layers"][0].update(digest=_sha(layer), size=len(layer))
        reason = "its files are not the signed ones"
    elif forgery == "unsigned":
        del found["annotations"]["dev.jitk.signature"]
        reason = "unsigned"
    elif forgery == "other key":  # a genuine artifact under another entry's tag
        key = "0" * 64
        _call(where.url(f"manifests/{remote.tag_of(key)}"), "PUT", json.dumps(found).encode(),
              **{"Content-Type": remote.MANIFEST_TYPE})
        found = None  # fetched by its tag
        reason = "signed for key"
    else:
        archs = ("9.0",)
        reason = "built for architectures"
    entry = tmp_path / "cache" / name
    with pytest.raises(signing.RemoteCacheError, match=reason) as refused:
        remote.fetch_entry(where, entry, key, archs, found)
    assert name in str(refused.value)
    assert not entry.exists() and _leftovers(tmp_path) == []


class _CutShort(http.server.BaseHTTPRequestHandler):
    """Forwards to the registry, but sends half of every large blob and hangs up: the
    registry stopping in the middle of a download."""

    upstream = ""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        request = urllib.request.Request(self.upstream + self.path, headers=dict(self.headers))
        try:
            reply = urllib.request.urlopen(request, timeout=10)
        except urllib.error.HTTPError as error:
            reply = error
        body = reply.read()
        self.send_response(reply.status)
        for name, value in reply.headers.items():
            if name.lower() not in ("connection", "transfer-encoding"):
                self.send_header(name, value)
        self.end_headers()
        cut = "/blobs/" in self.path and len(body) > 4096
        self.wfile.write(body[:len(body) // 2] if cut else body)
        self.close_connection = True

    def log_message(self, *_: object) -> None:
        pass


def test_a_registry_stopping_mid_pull_leaves_no_entry_within_the_bound(fleet, tmp_path):
    _CutShort.upstream = remote.parse(fleet["settings"]["JITK_REMOTE_CACHE"]).base
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CutShort)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        settings = {**fleet["settings"], "JITK_REMOTE_CACHE_TIMEOUT": "2",
                    "JITK_REMOTE_CACHE_RETRIES": "1",
                    "JITK_REMOTE_CACHE": f"oci://127.0.0.1:{server.server_port}/fleet"}
        started = time.monotonic()
        pulled = _host(tmp_path, "", "cache", "pull", timeout=120, **settings)
        seconds = time.monotonic() - started
    finally:
        server.shutdown()
    assert pulled.returncode == 1, pulled.stdout + pulled.stderr
    listed, failed = re.search(r"(\d+) entries .*: 0 fetched, 0 already cached, (\d+) failed",
                               pulled.stdout).groups()
    assert int(listed) >= 3 and failed == listed  # with forgeries other tests pushed
    assert "files failed 2 time(s)" in pulled.stdout
    assert _entries(tmp_path) == [] and _leftovers(tmp_path) == []
    assert seconds < 60  # cut replies end at once; the bound is entries x 2 tries x 2 s


def test_eight_processes_missing_one_entry_download_it_once(fleet, registry, tmp_path):
    code = "import sys, time; time.sleep(max(0, float(sys.argv[2]) - time.time()))" + ADD_ONE
    env = {k: v for k, v in os.environ.items() if not k.startswith("JITK_")}
    env.update(PYTHONPATH=PYTHON_PATH, JITK_CACHE_DIR=str(tmp_path / "cache"),
               JITK_STAGING_DIR=str(tmp_path / "staging"), JITK_DISABLE_JIT="1",
               JITK_VERBOSE="1", **fleet["settings"])
    name = next(n for n in fleet["entries"] if n.startswith("addone_"))
    key = json.loads((fleet["builder"] / "cache" / name / "jitk-meta.json").read_text())["key"]
    found = remote.manifest(remote.parse(fleet["settings"]["JITK_REMOTE_CACHE"]),
                            remote.tag_of(key), name)
    line = f'"GET /v2/fleet/blobs/{found["layers"][0]["digest"]} HTTP/1.1" 200'
    before = registry[1].read_text().count(line)
    start_at = str(time.time() + 8)  # all eight imported jitk by then, on a slow machine
    processes = [subprocess.Popen([sys.executable, "-c", code, fleet["header"], start_at],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(8)]
    results = []
    for process in processes:
        try:
            out, err = process.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise
        assert process.returncode == 0, err
        results.append((json.loads(out.splitlines()[-1]), err))
    assert all(result == {"builds": 0, "sum": 42} for result, _ in results)
    assert sum("jitk: fetched addone_" in err for _, err in results) == 1
    assert registry[1].read_text().count(line) - before == 1  # the registry's own count


SILENT = """
import os, sys, time
from jitk.build.jit import JitCacheMissError, load_jit
def miss():
    started = time.monotonic()
    try:
        load_jit("addone", cpp_files=[sys.argv[1]], cpp_wrappers=[("add_one", "add_one")])
    except JitCacheMissError as error:
        return time.monotonic() - started, str(error)
remote = os.environ.pop("JITK_REMOTE_CACHE")
miss()  # the first call's one-time work (compiler versions)
alone, _ = miss()  # a miss without the remote: the local work, measured on this machine
os.environ["JITK_REMOTE_CACHE"] = remote
print(alone, *miss(), sep="\\n")
"""


def test_a_registry_that_never_answers_costs_at_most_the_timeout(fleet, tmp_path):
    with socket.socket() as silent:  # accepts connections (the backlog) and never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        settings = {**fleet["settings"], "JITK_REMOTE_CACHE_TIMEOUT": "1",
                    "JITK_REMOTE_CACHE_RETRIES": "1",
                    "JITK_REMOTE_CACHE": f"oci://127.0.0.1:{silent.getsockname()[1]}/fleet"}
        loaded = _host(tmp_path, SILENT, fleet["header"], JITK_DISABLE_JIT="1", timeout=60,
                       **settings)
    assert loaded.returncode == 0, loaded.stderr
    alone, seconds, message = loaded.stdout.split("\n", 2)
    assert "failed 2 time(s) within 1 s" in message and "addone" in message
    waited = float(seconds) - float(alone)
    assert 2 * 1 - 0.2 < waited < 2 * 1 + 2  # two tries of one second (a loaded machine)
    assert _entries(tmp_path) == []


def test_entries_are_standard_oci_artifacts(fleet, tmp_path):
    """oras, an independent OCI client, reads an entry jitk pushed: a valid image manifest,
    whose one layer is a tar of the entry's files."""
    oras_client = pytest.importorskip("oras.client", reason="oras (the test extra) is missing")
    where = remote.parse(fleet["settings"]["JITK_REMOTE_CACHE"])
    client = oras_client.OrasClient(hostname=where.base.removeprefix("http://"), insecure=True)
    name = next(n for n in fleet["entries"] if n.startswith("addone_"))
    key = json.loads((fleet["builder"] / "cache" / name / "jitk-meta.json").read_text())["key"]
    container = f"{where.base.removeprefix('http://')}/{where.repo}:{remote.tag_of(key)}"
    found = client.get_manifest(container)
    assert found["artifactType"] == remote.ARTIFACT_TYPE
    assert found["annotations"]["dev.jitk.entry"] == name
    layer = tmp_path / "layer.tar"
    client.download_blob(container, found["layers"][0]["digest"], str(layer))
    with tarfile.open(layer) as tar:
        names = sorted(tar.getnames())
    assert names == sorted(p.name for p in (fleet["builder"] / "cache" / name).iterdir())


def test_env_shows_the_remote_and_the_keys(fleet, tmp_path):
    shown = _host(tmp_path, "", "env", timeout=120, **fleet["settings"])
    assert shown.returncode == 0, shown.stderr
    line = next(line for line in shown.stdout.splitlines() if line.startswith("remote cache:"))
    public = Path(fleet["settings"]["JITK_REMOTE_CACHE_TRUST"]).read_bytes()
    fingerprint = signing.fingerprint(serialization.load_pem_public_key(public))
    assert fleet["settings"]["JITK_REMOTE_CACHE"] in line and "reachable" in line
    assert f"signs with {fingerprint}; trusts {fingerprint}" in line


def test_a_build_is_pushed_as_it_is_made_under_remote_cache_push(registry, keys, tmp_path):
    header = tmp_path / "add_one.h"
    header.write_text("inline long add_one(long x) { return x + 1; }  // pushed by the build\n")
    settings = {"JITK_REMOTE_CACHE": f"{registry[0]}/as-built",
                "JITK_REMOTE_CACHE_KEY": str(keys / "fleet" / "jitk-remote.key"),
                "JITK_REMOTE_CACHE_TRUST": str(keys / "fleet" / "jitk-remote.pub")}
    built = _host(tmp_path / "a", ADD_ONE_EVENTS, str(header), timeout=300,
                  JITK_REMOTE_CACHE_PUSH="1", **settings)
    assert built.returncode == 0, built.stderr
    assert [json.loads(line) for line in built.stdout.splitlines()[-2:]] == [
        {"builds": 1, "sum": 42}, {"disk": 0, "remote": 0, "build": 1, "miss": 0}]
    loaded = _host(tmp_path / "b", ADD_ONE_EVENTS, str(header), timeout=120,
                   JITK_DISABLE_JIT="1", JITK_LOGLEVEL="1", **settings)
    assert loaded.returncode == 0, loaded.stderr
    assert [json.loads(line) for line in loaded.stdout.splitlines()[-2:]] == [
        {"builds": 0, "sum": 42}, {"disk": 0, "remote": 1, "build": 0, "miss": 0}]
    assert re.search(r"^jitk: jit remote addone key [0-9a-f]{16} \d+\.\d{3} s$", loaded.stderr,
                     re.M)
    assert _entries(tmp_path / "b") == _entries(tmp_path / "a")


def test_a_registry_answering_garbage_falls_back_to_a_local_build(keys, tmp_path):
    with socket.socket() as garbage:
        garbage.bind(("127.0.0.1", 0))
        garbage.listen(16)

        def answer() -> None:
            while True:
                try:
                    client, _ = garbage.accept()
                except OSError:
                    return  # closed at the end of the test
                with client:
                    client.recv(65536)
                    client.sendall(b"not a registry\r\n\r\n")

        threading.Thread(target=answer, daemon=True).start()
        header = tmp_path / "add_one.h"
        header.write_text("inline long add_one(long x) { return x + 1; }  // garbage\n")
        built = _host(tmp_path, ADD_ONE, str(header), timeout=300, JITK_VERBOSE="1",
                      JITK_REMOTE_CACHE=f"oci://127.0.0.1:{garbage.getsockname()[1]}/jitk",
                      JITK_REMOTE_CACHE_TRUST=str(keys / "fleet" / "jitk-remote.pub"))
    assert built.returncode == 0, built.stderr
    assert json.loads(built.stdout.splitlines()[-1]) == {"builds": 1, "sum": 42}
    assert "manifest failed 2 time(s)" in built.stderr  # reported, then built
