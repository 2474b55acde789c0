"""Whether jitk may load machine code from a cache: who owns it and who else can write to it.

A folder or file of a cache passes when it is owned by the user, by root, or has the group
named by $JITK_CACHE_TRUSTED_GROUP; and when nobody else can write to it: never
world-writable, group-writable only for that trusted group or for the owner's private group
(a group named after its one user, as most Linux distributions give each user). What jitk
creates in a cache it makes writable by its owner only, or by the trusted group too."""

from __future__ import annotations

import functools
import grp
import os
import pwd
import stat
from pathlib import Path

from jitk.base import settings
from jitk.base.errors import JitkError

TRUSTED_GROUP_ENV = "JITK_CACHE_TRUSTED_GROUP"


class JitCacheTrustError(JitkError, RuntimeError):
    """A cache, entry or library that others than the user (and whom they trust) could have
    written: jitk refuses to load from it or build into it."""


@functools.lru_cache(maxsize=8)
def _group_id(name: str) -> int:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        if name.isdigit():
            return int(name)
        raise ValueError(f"{TRUSTED_GROUP_ENV}={name!r} names no group on this machine "
                         "(give a group name or number)") from None


def trusted_group() -> int | None:
    """The group id named by $JITK_CACHE_TRUSTED_GROUP, or None when it is not set."""
    name = settings.get(TRUSTED_GROUP_ENV)
    return _group_id(name) if name else None


def folder_mode() -> int:
    """The mode of a folder jitk creates (the umask may take more away)."""
    return 0o755 if trusted_group() is None else 0o775


def file_mode(source_mode: int) -> int:
    """The mode of a file jitk copies into a cache: the source's, without others' write."""
    return stat.S_IMODE(source_mode) & (0o755 if trusted_group() is None else 0o775)


@functools.lru_cache(maxsize=64)
def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


@functools.lru_cache(maxsize=64)
def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


@functools.lru_cache(maxsize=64)
def _is_private_group(gid: int, uid: int) -> bool:
    try:
        user, group = pwd.getpwuid(uid), grp.getgrgid(gid)
    except KeyError:
        return False
    return (user.pw_gid == gid and group.gr_name == user.pw_name
            and set(group.gr_mem) <= {user.pw_name})


def problem(status: os.stat_result) -> str | None:
    """Why a file or folder with this status cannot be trusted, with the remedy; or None."""
    me, group = os.geteuid(), trusted_group()
    if status.st_uid not in (me, 0) and status.st_gid != group:
        you = f"you ({_user(me)})" + (" or root" if me else "")
        return (f"it is owned by {_user(status.st_uid)}, not by {you}, and its group "
                f"{_group(status.st_gid)} is not trusted. If you trust that group's members, "
                f"set {TRUSTED_GROUP_ENV}={_group(status.st_gid)}; else use a cache of your "
                "own (JITK_CACHE_DIR)")
    if status.st_mode & stat.S_IWOTH:
        return ("anyone on this machine can write to it. Remove that permission "
                "(chmod -R o-w on the cache), or use a cache of your own (JITK_CACHE_DIR)")
    if (status.st_mode & stat.S_IWGRP and status.st_gid != group
            and not _is_private_group(status.st_gid, status.st_uid)):
        return (f"members of group {_group(status.st_gid)} can write to it. If you trust "
                f"them, set {TRUSTED_GROUP_ENV}={_group(status.st_gid)}; else remove that "
                "permission (chmod -R g-w on the cache)")
    return None


def check(path: Path, what: str, status: os.stat_result | None = None) -> None:
    """Raises JitCacheTrustError when `path` (or the file whose status is given) cannot be
    trusted; `what` names it in the message ("the cache", "the library")."""
    reason = problem(status or os.stat(path))
    if reason:
        raise JitCacheTrustError(f"jitk: will not use {what} {path}: {reason}.")
