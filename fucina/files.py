"""Files written so that readers see the old file or the complete new one and a killed writer
leaves nothing behind (shared by every layer: checkpoints, GGUF exports, the kernel cache).

Where Linux allows it the data goes to an unnamed O_TMPFILE file (a kill leaves nothing), which
gets a temp name only once complete and is then os.replace'd over the target; elsewhere a named
temp file `<path>.tmp.<pid>.<host tag><random>` in the same directory. Either way the temp
files that earlier, killed writers left in the directory are removed first (remove_stale_temps:
our pattern, this host, a writer that no longer runs).
"""
from __future__ import annotations

import os
import re
import secrets
import socket
import stat
import zlib

__all__ = ["write_file_atomic", "remove_stale_temps", "fsync_dir"]


def fsync_dir(path) -> None:
    """Make a rename or unlink inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_HOST_TAG = format(zlib.crc32(socket.gethostname().encode("utf-8", "replace")), "08x")
_TEMP_NAME = re.compile(r"\.tmp\.(\d+)\.([0-9a-f]{8})([0-9a-f]{8})\Z")
_STALE_SLACK_S = 2.0  # /proc/stat's boot time has whole-second resolution


def _temp_name(path: str) -> str:
    """`<path>.tmp.<pid>.<host tag><random>`: the pid and host tag let a later save tell a dead
    writer's leftover from a live writer's file."""
    return f"{path}.tmp.{os.getpid()}.{_HOST_TAG}{secrets.token_hex(4)}"


def _process_start(pid: int) -> float | None:
    """The start time (epoch seconds) of live process `pid`, or None where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _is_stale(pid: int, mtime: float) -> bool:
    """True when no process that could still be writing the temp file runs: pid is gone, or
    pid was reused by a process started after the file was last written."""
    if pid == os.getpid():
        return False  # ours (another thread may be mid-save)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OSError):
        return False  # alive (another user's) or unknowable: keep
    start = _process_start(pid)
    return start is not None and start > mtime + _STALE_SLACK_S


def remove_stale_temps(dir_path) -> list[str]:
    """Delete the temp files that killed saves left in dir_path (only names of our own pattern,
    written on this host, by processes that no longer run). Returns the removed paths."""
    removed = []
    try:
        entries = list(os.scandir(dir_path))
    except OSError:
        return removed
    for e in entries:
        m = _TEMP_NAME.search(e.name)
        if m is None or m.group(2) != _HOST_TAG:
            continue
        try:
            st = e.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or not _is_stale(int(m.group(1)), st.st_mtime):
                continue
            os.unlink(e.path)
            removed.append(e.path)
        except (FileNotFoundError, ValueError, OverflowError):
            continue  # another process cleaned it first
        except OSError:
            continue
    return removed


def _open_unnamed(parent: str):
    """An fd on an unnamed file in `parent` (Linux O_TMPFILE), or None where unsupported."""
    flag = getattr(os, "O_TMPFILE", 0)
    if not flag or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return os.open(parent, flag | os.O_RDWR, 0o666)
    except OSError:
        return None  # filesystem without O_TMPFILE support (EOPNOTSUPP/EISDIR/EINVAL)


def _link_unnamed(f, path: str) -> str:
    """Name the complete unnamed file f (linkat through /proc/self/fd, AT_SYMLINK_FOLLOW); where
    the kernel refuses the link, copy it into a named temp file instead. Returns the name."""
    try:
        proc_fd = os.open("/proc/self/fd", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        proc_fd = None
    try:
        while proc_fd is not None:
            tmp = _temp_name(path)
            try:
                os.link(str(f.fileno()), tmp, src_dir_fd=proc_fd, follow_symlinks=True)
                return tmp
            except FileExistsError:
                continue
            except OSError:
                break
    finally:
        if proc_fd is not None:
            os.close(proc_fd)
    fd, tmp = _open_named(path)
    try:
        with os.fdopen(fd, "wb") as out:
            f.flush()
            os.lseek(f.fileno(), 0, os.SEEK_SET)
            while True:
                chunk = os.read(f.fileno(), 1 << 20)
                if not chunk:
                    break
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def _open_named(path: str):
    while True:  # O_EXCL: never clobber another writer's temp file; 0o666 honours the umask
        tmp = _temp_name(path)
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                           0o666), tmp
        except FileExistsError:
            continue


def write_file_atomic(path, writer_fn, durable: bool = True) -> None:
    """Write `path` through writer_fn(f) (f: a binary file) so that readers see the old file or
    the complete new one, never a part, and a killed save leaves no litter.

    Where Linux allows it the data goes to an unnamed O_TMPFILE file (a kill leaves nothing),
    which is linked under a temp name only once complete and fsynced, then os.replace'd over
    `path`; elsewhere a named temp file in the same directory. Either way the temp files that
    earlier, killed saves left in the directory are removed first (remove_stale_temps). If
    writer_fn raises, the old file is untouched and the exception propagates. durable=False
    skips the fsyncs (a cache entry that a crash may lose is simply rebuilt)."""
    path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    remove_stale_temps(parent)
    fd = _open_unnamed(parent)
    tmp = None
    if fd is None:
        fd, tmp = _open_named(path)
    try:
        with os.fdopen(fd, "wb") as f:
            writer_fn(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
            if tmp is None:  # give the finished unnamed file its temp name, then replace
                tmp = _link_unnamed(f, path)
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        raise
    if durable:
        fsync_dir(parent)
