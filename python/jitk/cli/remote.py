"""`python -m jitk cache keygen|push|pull`: the remote cache's commands (jitk/build/remote.py).

  cache keygen DIR                     a new ed25519 key pair for signing pushed entries
  cache push [--module M] [--arch A]   sign and push the local cache's entries
  cache pull [--module M] [--arch A]   fetch, verify and publish the registry's entries

Each prints a line an entry and a summary; a failed entry is reported and the others go
on (exit 1 at the end)."""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

from jitk.base import __version__
from jitk.build import cache, remote, signing, toolchain
from jitk.build.lock import JitLockError, build_lock
from jitk.cli.common import EXIT_FAILURE, EXIT_OK

_FOLDER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")  # an entry folder a registry may name


def _needed(setting_value: object, what: str) -> None:
    if not setting_value:
        raise signing.RemoteCacheError(f"cache {what}: {remote.REMOTE_ENV} is unset; set it to "
                                       "oci://host:port/repository")


def _archs(values: list[str] | None) -> set[tuple[str, ...]] | None:
    """--arch values as sets of architectures ("" for host code), or None for all."""
    if not values:
        return None
    return {toolchain.canonical_archs(toolchain.parse_archs(v)) if v else () for v in values}


def _wanted(args: argparse.Namespace, module: str, archs: tuple[str, ...],
            node: tuple[str, ...] | None = None) -> bool:
    """Whether --module and --arch select an entry; without --arch, given the node's
    architectures, host code and entries that serve all of them (a fat one included)."""
    chosen = _archs(args.arch)
    if chosen is not None and tuple(archs) not in chosen:
        return False
    if chosen is None and node and archs and not all(
            toolchain.serves(archs, wanted) for wanted in node):
        return False
    return not args.module or any(module.startswith(name) for name in args.module)


def _node_archs() -> tuple[str, ...] | None:
    """$JITK_CUDA_ARCH, else the GPU's; None (every architecture) when neither is known."""
    try:
        return toolchain.target_archs()
    except toolchain.ToolchainError:
        return None


def run_keygen(args: argparse.Namespace) -> int:
    private, public, print_ = signing.keygen(args.folder)
    print(f"wrote {private} (private: set {signing.KEY_ENV} to it on the machines that push)")
    print(f"wrote {public} (public: list it in {signing.TRUST_ENV} on the machines that pull)")
    print(f"fingerprint {print_}")
    return EXIT_OK


def _report(done: int, total: int, name: str, result: str) -> None:
    print(f"[{done}/{total}] {name}: {result}", flush=True)


def run_push(args: argparse.Namespace) -> int:
    where = remote.configured()
    _needed(where, "push")
    key = signing.signing_key()
    if key is None:
        raise signing.RemoteCacheError(f"cache push: {signing.KEY_ENV} is unset; entries are "
                                       "pushed signed (python -m jitk cache keygen DIR)")
    entries = [e for e in cache.list_entries() if _wanted(args, e.module, e.archs)]
    started, failed, size = time.perf_counter(), 0, 0
    for done, entry in enumerate(entries, 1):
        try:
            remote.push(where, entry.path, key)
            size += entry.size_bytes
            _report(done, len(entries), entry.path.name, "pushed")
        except signing.RemoteCacheError as error:
            failed += 1
            _report(done, len(entries), entry.path.name, f"FAILED: {error}")
    print(f"pushed {len(entries) - failed} of {len(entries)} entries "
          f"({size / (1 << 20):.1f} MiB) to {where.text} in "
          f"{time.perf_counter() - started:.1f} s, signed by "
          f"{signing.fingerprint(key.public_key())}")
    return EXIT_FAILURE if failed else EXIT_OK


def _pull_one(where: remote.Remote, found: dict) -> str:
    notes = found.get("annotations") or {}
    name, key = notes.get(remote.NOTE + "entry", ""), notes.get(remote.NOTE + "key", "")
    if not _FOLDER.match(name) or len(name) > 255:
        raise signing.RemoteCacheError(f"refused: the artifact names the entry {name!r:.80}")
    entry = cache.cache_root().expanduser().resolve() / name
    if cache.is_complete(entry, key):
        return "already cached"
    archs = tuple(json.loads(notes.get(remote.NOTE + "archs", "[]")))
    with build_lock(cache.build_lock_path(entry), entry):
        if cache.is_complete(entry, key):
            return "already cached"
        remote.fetch_entry(where, entry, key, archs, found)
    return "fetched"


def run_pull(args: argparse.Namespace) -> int:
    where = remote.configured()
    _needed(where, "pull")
    if not signing.trusted_keys():
        raise signing.RemoteCacheError(f"cache pull: {signing.TRUST_ENV} names no public key, "
                                       "and jitk pulls nothing it cannot verify")
    started, node = time.perf_counter(), _node_archs()

    def wanted(notes: dict) -> bool:
        try:
            archs = tuple(json.loads(notes.get(remote.NOTE + "archs", "[]")))
            return _wanted(args, str(notes.get(remote.NOTE + "module", "")), archs, node)
        except (ValueError, TypeError, toolchain.ToolchainError):
            return True  # refused, with its reason, when pulled

    listed = remote.listed(where, wanted)
    counts = {"fetched": 0, "already cached": 0, "failed": 0}
    for done, (tag, found) in enumerate(listed, 1):
        name = (found.get("annotations") or {}).get(remote.NOTE + "entry", tag)
        try:
            result = _pull_one(where, found)
        except (signing.RemoteCacheError, JitLockError, OSError) as error:
            result = "failed"
            _report(done, len(listed), str(name), f"FAILED: {error}")
        else:
            _report(done, len(listed), str(name), result)
        counts[result] += 1
    print(f"{len(listed)} entries for jitk {__version__} in {where.text}: "
          f"{counts['fetched']} fetched, {counts['already cached']} already cached, "
          f"{counts['failed']} failed, in {time.perf_counter() - started:.1f} s; cache: "
          f"{cache.cache_root()}")
    return EXIT_FAILURE if counts["failed"] else EXIT_OK


def add_commands(actions: argparse._SubParsersAction) -> None:
    """Adds keygen, push and pull to the `cache` command's actions."""
    keygen = actions.add_parser(
        "keygen", help="write a key pair for signing the remote cache's entries",
        description="Write DIR/jitk-remote.key (ed25519 private key, mode 0600) and "
                    "DIR/jitk-remote.pub. Existing files are never replaced.")
    keygen.add_argument("folder", type=Path, metavar="DIR")
    keygen.set_defaults(handler=run_keygen)
    for name, handler, text in (
            ("push", run_push, "sign and push the local cache's entries to "
                               f"${remote.REMOTE_ENV} (with ${signing.KEY_ENV})"),
            ("pull", run_pull, f"fetch the entries of ${remote.REMOTE_ENV} for this jitk "
                               f"version, verified with ${signing.TRUST_ENV}")):
        action = actions.add_parser(name, help=text, description=text[0].upper() + text[1:]
                                    + ".")
        action.add_argument("--module", action="append", metavar="NAME",
                            help="only entries whose module name starts with NAME; repeat "
                                 "for more (default: all)")
        action.add_argument("--arch", action="append", metavar="ARCH",
                            help="only entries built for exactly these architectures, e.g. "
                                 "9.0 or '8.0;9.0' ('' for host code); repeat for more")
        action.set_defaults(handler=handler)
