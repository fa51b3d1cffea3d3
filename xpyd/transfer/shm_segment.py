"""Shared-memory segments for the shm transfer backend: create, map a peer's, clean up the dead's.

A segment is a file ``/dev/shm/xpyd-kv-<pid>-<tag>`` of the KV pool's size. Its owner holds a shared
``flock`` on it for as long as it lives (the kernel drops the lock when the process dies, SIGKILL
included), so a later start can tell a leftover segment from a live one without trusting pids
(``remove_stale``): a segment nobody holds a lock on is removed. The owner unlinks its segment on
``close()`` and at interpreter exit; mappings stay valid after the unlink.

Peers on the same host map a segment read-only by name (``map_peer``). "Same host" means the same
/dev/shm and network namespace: ``host_key()`` is what both sides compare.

The file mode is what keeps other users out of a pool: a segment is created 0600 (owner only: the
``O_EXCL`` open names the mode, and a umask only removes bits), and ``map_peer`` maps only a segment
owned by its own user with no group or other permissions, so no other user can have written it.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import itertools
import logging
import mmap
import os
import re
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "xpyd-kv-"
_NAME_RE = re.compile(r"xpyd-kv-(\d+)-([A-Za-z0-9_.-]{1,64})")
_counter = itertools.count()
_live: dict[str, "Segment"] = {}  # name -> segment, unlinked at exit
_live_lock = threading.Lock()


class SegmentError(Exception):
    """A segment cannot be created or mapped."""


def host_key() -> str:
    """Identifies this host's /dev/shm and network namespace; equal keys mean a segment name is reachable."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "noboot"
    st = os.stat(SHM_DIR)
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = "nonet"
    return f"{boot}/{st.st_dev}.{st.st_ino}/{netns}"


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise SegmentError(f"invalid segment name {name!r:.80}")
    return name


@dataclass(eq=False)
class Segment:
    """One owned segment: its name, the writable mapping, and the fd holding the liveness lock."""

    name: str
    size: int
    mapping: mmap.mmap
    fd: int

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    def buffer(self) -> memoryview:
        return memoryview(self.mapping)

    def unlink(self) -> None:
        """Remove the name (idempotent); the mapping stays usable until the process exits."""
        with _live_lock:
            _live.pop(self.name, None)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def create(size: int, tag: str | None = None) -> Segment:
    """Create, lock and map a zero-filled segment of ``size`` bytes named after this process."""
    if type(size) is not int or size <= 0:
        raise SegmentError(f"segment size must be a positive int, got {size!r}")
    remove_stale()
    st = os.statvfs(SHM_DIR)
    if st.f_bavail * st.f_frsize < size:  # e.g. a container's 64 MiB /dev/shm: fail now, not with SIGBUS later
        raise SegmentError(f"{SHM_DIR} has {st.f_bavail * st.f_frsize} bytes free, the segment needs {size}")
    tag = tag or str(next(_counter))
    name = check_name(f"{PREFIX}{os.getpid()}-{tag}")
    tmp = os.path.join(SHM_DIR, f".{name}.tmp")  # locked before it gets a name the sweeper looks at
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise SegmentError(f"cannot create {tmp}: {e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            os.posix_fallocate(fd, 0, size)  # reserve the pages now: ENOSPC here, not SIGBUS on first write
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, size)
        if os.path.exists(os.path.join(SHM_DIR, name)):
            raise SegmentError(f"segment {name} already exists")
        os.rename(tmp, os.path.join(SHM_DIR, name))
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapping = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException as e:
        os.close(fd)
        for p in (tmp, os.path.join(SHM_DIR, name)):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        if isinstance(e, OSError):
            raise SegmentError(f"cannot create segment {name} of {size} bytes: {e}") from None
        raise
    seg = Segment(name, size, mapping, fd)
    with _live_lock:
        _live[name] = seg
    return seg


def map_peer(name: str, size: int) -> mmap.mmap:
    """Map a peer's segment read-only; it must hold at least ``size`` bytes."""
    path = os.path.join(SHM_DIR, check_name(name))
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise SegmentError(f"cannot open peer segment {name}: {e}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise SegmentError(f"peer segment {name} is not private to this user (owner uid {st.st_uid}, "
                               f"mode {st.st_mode & 0o777:o}; expected uid {os.geteuid()}, mode 600)")
        actual = st.st_size
        if actual < size or size <= 0:
            raise SegmentError(f"peer segment {name} holds {actual} bytes, expected {size}")
        # Not MAP_POPULATE (its own pool's mapping has it): populating a peer's whole pool took 0.8-3.4 s for
        # 1.5 GiB, paid by the first transfer from each new prefill worker; a transfer touches only its blocks'
        # pages, each faulted in once (~10 ms more for the first 8 MiB copied).
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except OSError as e:
        raise SegmentError(f"cannot map peer segment {name}: {e}") from None
    finally:
        os.close(fd)


def remove_stale() -> list[str]:
    """Unlink xpyd-kv-* segments whose owner is gone (nobody holds their lock); the names removed."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if not _NAME_RE.fullmatch(name):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner (or another sweeper) holds it
        else:
            try:
                if os.path.samestat(os.fstat(fd), os.stat(path)):
                    os.unlink(path)
                    removed.append(name)
            except OSError:
                pass
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d stale KV segment(s) of dead workers: %s", len(removed), ", ".join(removed))
    return removed


@atexit.register
def _unlink_all() -> None:
    with _live_lock:
        segs = list(_live.values())
    for seg in segs:
        seg.unlink()
