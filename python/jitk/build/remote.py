"""The remote tier under the module cache: an OCI registry that entries are fetched from
before compiling and pushed to after building, each signed (ed25519) by its pusher and
verified before a byte of it reaches the cache.

    JITK_REMOTE_CACHE=oci://host:port/repo     the registry and repository (off when unset)
    tag e-<entry key>                          one entry: the key names the build and its
                                               architectures (entries.entry_key)
    config blob                                the signed statement: entry folder, key,
                                               architectures, jitk version, layer digest
    one layer                                  the entry's files as a flat tar
    annotations                                the statement's fields and the signature

A fetch reads the manifest, checks the signature against the trusted public keys, the
statement against the entry it asked for, then downloads the layer and checks it against
the signed digest; only then are the files unpacked into a staging folder of this host,
copied in, checked as a reader checks an entry (cache.look_up) and published by the
cache's one rename. The caller holds the entry's build lock, so a node's processes fetch an
entry once. Every request has a timeout and a retry count (settings); any failure is a
RemoteCacheError whose text names the entry and the reason, which the caller treats as a
miss.

The HTTP calls are urllib's: oras-py's requests calls take no timeout and its retry
decorator sleeps between attempts unbounded by any setting (docs: deploying.md)."""

from __future__ import annotations

import base64
import hashlib
import http.client
import io
import ipaddress
import json
import logging
import os
import re
import shutil
import tarfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from jitk.base import __version__, settings
from jitk.base.errors import PREFIX, SettingError
from jitk.build import cache
from jitk.build.signing import TRUST_ENV, RemoteCacheError, fingerprint, signing_key, trusted_keys
from jitk.build.staging import new_staging

logger = logging.getLogger("jitk")

REMOTE_ENV = "JITK_REMOTE_CACHE"
TIMEOUT_ENV = "JITK_REMOTE_CACHE_TIMEOUT"
RETRIES_ENV = "JITK_REMOTE_CACHE_RETRIES"
HTTP_HOSTS_ENV = "JITK_REMOTE_CACHE_HTTP_HOSTS"
PUSH_ENV = "JITK_REMOTE_CACHE_PUSH"

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
ARTIFACT_TYPE = "application/vnd.jitk.cache-entry.v1"
CONFIG_TYPE = "application/vnd.jitk.cache-entry.statement.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"
DESCRIBE_KEYS = ("remote", "url", "reachable", "signing_key", "trusted", "error")
NOTE = "dev.jitk."  # annotation prefix
TAG_PREFIX = "e-"
MAX_SMALL = 1 << 20  # a manifest, a statement, a tag list
MAX_LAYER = 1 << 30  # an entry's files
_ENTRY_FILE = re.compile(r"^(?!\.\.?$)[A-Za-z0-9_.][A-Za-z0-9_.+-]*$")  # no "/", ".", ".."


@dataclass(frozen=True)
class Remote:
    base: str  # http(s)://host:port
    repo: str
    text: str  # as configured

    def url(self, path: str) -> str:
        return f"{self.base}/v2/{self.repo}/{path}"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse(text: str) -> Remote:
    """oci://host[:port]/repo: plain HTTP to a loopback host or one of
    JITK_REMOTE_CACHE_HTTP_HOSTS, TLS to any other."""
    parts = urllib.parse.urlsplit(text)
    repo = parts.path.strip("/")
    if parts.scheme != "oci" or not parts.hostname or not re.fullmatch(
            r"[a-z0-9]+([._-][a-z0-9]+)*(/[a-z0-9]+([._-][a-z0-9]+)*)*", repo):
        raise SettingError(
            f"{REMOTE_ENV}={text!r}: expected oci://host[:port]/repository (a lowercase "
            "repository path, e.g. oci://127.0.0.1:5000/jitk)")
    plain = _loopback(parts.hostname) or parts.hostname in settings.get(HTTP_HOSTS_ENV)
    return Remote(f"{'http' if plain else 'https'}://{parts.netloc}", repo, text)


def configured() -> Remote | None:
    text = settings.get(REMOTE_ENV)
    return parse(text) if text else None


# ------------------------------------------------------------------------------ HTTP
def _bound() -> tuple[float, int]:
    return settings.get(TIMEOUT_ENV), settings.get(RETRIES_ENV)


def _request(remote: Remote, method: str, url: str, what: str, data: bytes | None = None,
             headers: dict | None = None, limit: int = MAX_SMALL) -> tuple[int, dict, bytes]:
    """One call, tried 1 + JITK_REMOTE_CACHE_RETRIES times, each within
    JITK_REMOTE_CACHE_TIMEOUT seconds (the body's reading included). Any status below 500
    is an answer, returned as it is; a server error is retried."""
    timeout, retries = _bound()
    failure = ""
    for _ in range(1 + retries):
        started = time.monotonic()
        request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                body = _read_within(reply, limit, started + timeout, what)
                return reply.status, dict(reply.headers), body
        except urllib.error.HTTPError as error:
            if error.code < 500:
                return error.code, dict(error.headers), error.read(MAX_SMALL)
            failure = f"HTTP {error.code}"
        except (OSError, http.client.HTTPException) as error:  # unreachable, a timeout, a
            # reset, a reply cut short or one that is not HTTP
            failure = str(getattr(error, "reason", error)) or type(error).__name__
    raise RemoteCacheError(f"{remote.text}: {what} failed {1 + retries} time(s) within "
                           f"{timeout:g} s each: {failure}")


def _read_within(reply, limit: int, deadline: float, what: str) -> bytes:
    chunks, size = [], 0
    while chunk := reply.read(1 << 16):
        size += len(chunk)
        if size > limit:
            raise OSError(f"{what}: more than {limit} bytes")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: the reply did not arrive in time")
        chunks.append(chunk)
    declared = reply.headers.get("Content-Length")
    if declared and declared.isdigit() and int(declared) != size:  # the server hung up
        raise http.client.IncompleteRead(b"", int(declared) - size)
    return b"".join(chunks)


def reachable(remote: Remote) -> str:
    """What the registry's /v2/ answers, in words."""
    try:
        status, _, _ = _request(remote, "GET", f"{remote.base}/v2/", "the API check")
    except RemoteCacheError as error:
        return f"unreachable: {error}"
    return "reachable" if status in (200, 401) else f"answers HTTP {status}"


# ------------------------------------------------------------------------------ artifacts
def tag_of(key: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{64}", key):
        raise ValueError(f"a cache entry's key is 64 hex digits, got {key!r:.80}")
    return TAG_PREFIX + key


def _pack(entry: Path) -> bytes:
    """The entry's files as a tar that depends on their names and contents only."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(p for p in entry.iterdir() if p.is_file()):
            info = tarfile.TarInfo(path.name)
            data = path.read_bytes()
            info.size, info.mode = len(data), 0o755 if os.access(path, os.X_OK) else 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _put_blob(remote: Remote, data: bytes, what: str) -> None:
    digest = _sha(data)
    status, _, _ = _request(remote, "HEAD", remote.url(f"blobs/{digest}"), what)
    if status == 200:
        return
    status, headers, _ = _request(remote, "POST", remote.url("blobs/uploads/"), what,
                                  data=b"")
    location = headers.get("Location")
    if status != 202 or not location:
        raise RemoteCacheError(f"{remote.text}: {what}: the registry refused the upload "
                               f"(HTTP {status})")
    url = urllib.parse.urljoin(remote.base + "/", location)
    url += ("&" if "?" in url else "?") + urllib.parse.urlencode({"digest": digest})
    status, _, _ = _request(remote, "PUT", url, what, data=data,
                            headers={"Content-Type": "application/octet-stream"})
    if status != 201:
        raise RemoteCacheError(f"{remote.text}: {what}: upload answered HTTP {status}")


def push(remote: Remote, entry: Path, key) -> str:
    """Signs and pushes a published entry; returns its tag."""
    meta = cache.read_meta(entry)
    if meta is None or not cache.is_complete(entry, meta.get("key", "")):
        raise RemoteCacheError(f"{entry}: not a complete cache entry; nothing pushed")
    layer = _pack(entry)
    statement = {"entry": entry.name, "key": meta["key"], "archs": list(meta.get("archs", [])),
                 "module": meta.get("module", entry.name), "jitk": __version__,
                 "layer": _sha(layer)}
    config = json.dumps(statement, sort_keys=True).encode()
    notes = {NOTE + name: json.dumps(value) if isinstance(value, list) else value
             for name, value in statement.items()}
    notes[NOTE + "signature"] = base64.b64encode(key.sign(config)).decode()
    notes[NOTE + "signer"] = fingerprint(key.public_key())
    _put_blob(remote, config, f"{entry.name}'s statement")
    _put_blob(remote, layer, f"{entry.name}'s files")
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "artifactType": ARTIFACT_TYPE,
                "config": {"mediaType": CONFIG_TYPE, "digest": _sha(config),
                           "size": len(config)},
                "layers": [{"mediaType": LAYER_TYPE, "digest": _sha(layer),
                            "size": len(layer)}],
                "annotations": notes}
    tag = tag_of(meta["key"])
    status, _, body = _request(remote, "PUT", remote.url(f"manifests/{tag}"),
                               f"{entry.name}'s manifest", data=json.dumps(manifest).encode(),
                               headers={"Content-Type": MANIFEST_TYPE})
    if status != 201:
        raise RemoteCacheError(f"{remote.text}: {entry.name}: the manifest was refused "
                               f"(HTTP {status}: {body[:200]!r})")
    return tag


def manifest(remote: Remote, tag: str, what: str) -> dict | None:
    """The manifest under `tag`, or None when the registry has none."""
    status, _, body = _request(remote, "GET", remote.url(f"manifests/{tag}"), what,
                               headers={"Accept": MANIFEST_TYPE})
    if status == 404:
        return None
    try:
        found = json.loads(body) if status == 200 else None
    except ValueError:
        found = None
    if not isinstance(found, dict):
        raise RemoteCacheError(f"{remote.text}: {what}: the manifest is not JSON "
                               f"(HTTP {status})")
    return found


def _blob(remote: Remote, descriptor: object, limit: int, what: str) -> tuple[str, bytes]:
    if not isinstance(descriptor, dict) or not isinstance(descriptor.get("digest"), str):
        raise RemoteCacheError(f"{what}: the manifest names no blob")
    digest = descriptor["digest"]
    status, _, data = _request(remote, "GET", remote.url(f"blobs/{digest}"), what, limit=limit)
    if status != 200:
        raise RemoteCacheError(f"{remote.text}: {what}: HTTP {status}")
    return digest, data


def _verified_statement(remote: Remote, found: dict, name: str, key: str,
                        archs: Iterable[str]) -> tuple[dict, dict]:
    """The statement of a manifest, checked against the trusted keys and the entry asked
    for; with the layer's descriptor."""
    trusted = trusted_keys()
    if not trusted:
        raise RemoteCacheError(f"{name}: refused: no trusted key ({TRUST_ENV} is unset)")
    notes = found.get("annotations") or {}
    layers = found.get("layers")
    if not isinstance(layers, list) or len(layers) != 1:
        raise RemoteCacheError(f"{name}: refused: the artifact has no single layer")
    digest, config = _blob(remote, found.get("config"), MAX_SMALL, f"{name}'s statement")
    if _sha(config) != digest:
        raise RemoteCacheError(f"{name}: refused: the statement is not the one named")
    signature, signer = notes.get(NOTE + "signature"), notes.get(NOTE + "signer")
    if not isinstance(signature, str):
        raise RemoteCacheError(f"{name}: refused: the artifact is unsigned")
    if signer not in trusted:
        raise RemoteCacheError(f"{name}: refused: signed by {signer!r:.60}, which no file of "
                               f"{TRUST_ENV} holds")
    try:
        trusted[signer].verify(base64.b64decode(signature, validate=True), config)
        statement = json.loads(config)
    except Exception:  # InvalidSignature, a garbled signature or statement
        raise RemoteCacheError(f"{name}: refused: the signature does not match the statement "
                               f"(tampered with, or not signed by {signer})") from None
    if statement.get("key") != key:
        raise RemoteCacheError(f"{name}: refused: the artifact is signed for key "
                               f"{str(statement.get('key'))[:16]}, not {key[:16]}")
    if statement.get("archs") != list(archs):
        raise RemoteCacheError(f"{name}: refused: built for architectures "
                               f"{statement.get('archs')}, not {list(archs)}")
    if statement.get("layer") != layers[0].get("digest"):
        raise RemoteCacheError(f"{name}: refused: its files are not the signed ones "
                               "(tampered with)")
    return statement, layers[0]


def _unpack(data: bytes, folder: Path, name: str) -> None:
    """The layer's files into `folder`: regular files with plain names only."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for member in tar.getmembers():
                if not member.isfile() or not _ENTRY_FILE.match(member.name):
                    raise RemoteCacheError(f"{name}: refused: the layer holds "
                                           f"{member.name!r:.80}, not a plain file")
                source = tar.extractfile(member)
                fd = os.open(folder / member.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                             0o755 if member.mode & 0o111 else 0o644)
                with os.fdopen(fd, "wb") as out:
                    shutil.copyfileobj(source, out)
    except (tarfile.TarError, OSError) as error:
        raise RemoteCacheError(f"{name}: refused: the layer is not a readable tar "
                               f"({error})") from None


def fetch_entry(remote: Remote, entry: Path, key: str, archs: tuple[str, ...],
                found: dict | None = None) -> bool:
    """Fetches, verifies and publishes `entry`; False when the registry does not have it.
    The caller holds its build lock. Raises RemoteCacheError naming the entry and why."""
    name = entry.name
    found = found or manifest(remote, tag_of(key), f"{name}'s manifest")
    if found is None:
        return False
    statement, layer = _verified_statement(remote, found, name, key, archs)
    if statement.get("entry") != name:
        raise RemoteCacheError(f"{name}: refused: the artifact is for entry "
                               f"{statement.get('entry')!r:.120}")
    digest, data = _blob(remote, layer, MAX_LAYER, f"{name}'s files")
    if _sha(data) != digest:
        raise RemoteCacheError(f"{name}: refused: the files downloaded are not the signed "
                               "ones (tampered with, or cut short)")
    staging = new_staging(entry)
    try:
        _unpack(data, staging, name)
        meta = cache.read_meta(staging) or {}
        if meta.get("key") != key:
            raise RemoteCacheError(f"{name}: refused: its {cache.META_FILE} is not for this "
                                   "key")
        private = cache.copy_in(staging, entry)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    checked = cache.look_up(private, key)
    if checked.fd is not None:
        os.close(checked.fd)
    if checked.library is None:
        shutil.rmtree(private, ignore_errors=True)
        raise RemoteCacheError(f"{name}: refused: {checked.problem or 'no library'}")
    cache.publish(private, entry, key)
    return True


def fetch(entry: Path, key: str, archs: tuple[str, ...]) -> str | None:
    """jit.py's remote look-up after a local miss, under the entry's build lock: None once
    the entry is published, else why not (the caller builds, or reports the miss)."""
    try:
        remote = configured()
        if remote is None:
            return "no remote cache is set"
        if fetch_entry(remote, entry, key, archs):
            logger.info("jitk: fetched %s from %s", entry.name, remote.text)
            return None
        return f"{remote.text} does not have it"
    except (RemoteCacheError, SettingError) as error:
        logger.warning("jitk: remote cache: %s", str(error).removeprefix(PREFIX))
        return str(error).removeprefix(PREFIX)


def push_built(entry: Path) -> None:
    """After a build, under JITK_REMOTE_CACHE_PUSH=1: the new entry goes to the registry.
    A failure is logged; the build stands."""
    try:
        remote, key = configured(), signing_key()
        if remote and key and settings.flag(PUSH_ENV):
            push(remote, entry, key)
    except (RemoteCacheError, SettingError) as error:
        logger.warning("jitk: remote cache: %s not pushed: %s", entry.name, error)


def listed(remote: Remote, wanted: Callable[[dict], bool]) -> list[tuple[str, dict]]:
    """The registry's entries for this jitk version whose annotations `wanted` accepts:
    (tag, manifest) pairs."""
    status, _, body = _request(remote, "GET", remote.url("tags/list"), "the tag list")
    try:
        tags = json.loads(body).get("tags") or [] if status == 200 else []
    except (ValueError, AttributeError):
        raise RemoteCacheError(f"{remote.text}: the tag list is not JSON") from None
    found = []
    for tag in sorted(t for t in tags if isinstance(t, str) and t.startswith(TAG_PREFIX)):
        item = manifest(remote, tag, f"{tag}'s manifest")
        notes = (item or {}).get("annotations") or {}
        if item and notes.get(NOTE + "jitk") == __version__ and wanted(notes):
            found.append((tag, item))
    return found


def describe() -> dict:
    """The remote cache as `python -m jitk env` shows it (keys: DESCRIBE_KEYS): where,
    whether it answers, the fingerprints of the signing key and of the trusted keys, and
    what could not be read."""
    found = dict.fromkeys(DESCRIBE_KEYS)
    found["trusted"], problems = [], []
    try:
        where = configured()
    except SettingError as error:
        where = None
        problems.append(str(error))
    if where:
        found.update(remote=where.text, url=where.url(""), reachable=reachable(where))
    try:
        key = signing_key()
        found["signing_key"] = fingerprint(key.public_key()) if key else None
        found["trusted"] = sorted(trusted_keys())
    except (RemoteCacheError, SettingError) as error:
        problems.append(str(error))
    found["error"] = "; ".join(problems) or None
    return found
