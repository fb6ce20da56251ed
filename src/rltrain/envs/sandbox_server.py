"""The sandbox's fork server and its workers; run as ``python -I sandbox_server.py --serve``.

Standard library only: it runs by path, in isolated mode, outside the trainer's import
path. :mod:`rltrain.envs.sandbox` starts it and talks to it over a unix socket:

* server -> trainer: ``I <json>`` once (what this machine enforces), ``R <id>`` with the
  worker's stdout, stderr, job and status pipe ends (SCM_RIGHTS); on the status pipe
  ``<wait status> <cpu s>`` once the worker was reaped and its folder deleted (end of
  file without it: the server stopped);
* trainer -> server: ``T <id>`` (taken: fork a replacement), ``K <id>`` (SIGKILL it).
  End of file on the socket stops every worker and the server.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import errno
import gc
import heapq
import io
import json
import linecache
import math
import os
import re
import resource
import selectors
import shutil
import signal
import socket
import stat
import sys
import traceback

UID_BASE = 1_900_000_000  # a worker's uid is UID_BASE + its slot: unnamed, owns nothing else
MAX_SLOTS = 4096  # at most this many live workers per pool
MAX_OPEN_FILES = 64
# Each call's folder is a tmpfs of its own where the server has a mount namespace (root):
# these bound what one call may write there, in MiB and in files (folders included).
DEFAULT_DISK_MB = 64
DEFAULT_MAX_FILES = 256
SETUP_FAILED = 125  # a worker's exit code when its isolation could not be set up
SETUP_MARK = "rltrain sandbox: worker setup failed: "
# The whole environment the code sees (plus HOME and TMPDIR = its folder). No thread can
# start (RLIMIT_NPROC=0), so numerical libraries are told to use the calling thread only.
MINIMAL_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"} | {
    f"{lib}_NUM_THREADS": "1" for lib in ("OMP", "OPENBLAS", "MKL", "NUMEXPR")
}
PRELOAD = [
    *("array", "base64", "bisect", "cmath", "collections", "copy", "dataclasses", "datetime"),
    *("decimal", "fractions", "functools", "hashlib", "heapq", "itertools", "json", "math"),
    *("operator", "random", "re", "statistics", "string", "struct", "textwrap", "typing"),
    "unicodedata",
]


# ---- Linux calls the standard library lacks before Python 3.12 (unshare, mount, prctl) ----

_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = (
    0x20000,
    0x10000000,
    0x20000000,
    1 << 30,
)
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT = 1, 2, 4, 8, 32
_MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC, _MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
_MS_RELATIME, _MS_STRICTATIME = 1 << 21, 1 << 24
_MOUNT_OPTIONS = {
    "nosuid": _MS_NOSUID,
    "nodev": _MS_NODEV,
    "noexec": _MS_NOEXEC,
    "noatime": _MS_NOATIME,
    "nodiratime": _MS_NODIRATIME,
    "relatime": _MS_RELATIME,
    "strictatime": _MS_STRICTATIME,
}
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
_libc: ctypes.CDLL | None = None


def _libc_call(name: str, *args: object) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if getattr(_libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def _unshare(flags: int) -> None:
    _libc_call("unshare", ctypes.c_int(flags))


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    enc = [s.encode() if s is not None else None for s in (source, target, fstype, data or None)]
    _libc_call("mount", enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3])


def _detach(target: str) -> None:
    _libc_call("umount2", target.encode(), ctypes.c_int(2))  # MNT_DETACH: the whole subtree


def _prctl(option: int, value: int) -> None:
    _libc_call("prctl", ctypes.c_int(option), *[ctypes.c_ulong(v) for v in (value, 0, 0, 0)])


# ---- the fork server and its workers (run in the server's interpreter) ----


def _enter_namespaces(root: bool, report: dict[str, str]) -> int:
    """Unshare what this machine allows; returns the CLONE_ flags that took effect."""
    if not root:  # an unprivileged user namespace (own uid mapped to itself) for the network
        reason = "not root, so no mount or pid namespace and no uid of its own"
        report["filesystem"] = (
            f"not isolated ({reason}): writes reach what the trainer's user may write"
        )
        report["pid"] = f"not isolated ({reason}): the code shares the trainer's uid and pid space"
        try:
            uid, gid = os.getuid(), os.getgid()
            _unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
            with open("/proc/self/gid_map", "w") as f:
                f.write(f"{gid} {gid} 1")
            return _CLONE_NEWNET
        except OSError as e:
            report["network"] = f"not isolated: user+network namespace failed ({e.strerror})"
            return 0
    got = 0
    for flag, name in (
        (_CLONE_NEWNS, "filesystem"),
        (_CLONE_NEWNET, "network"),
        (_CLONE_NEWPID, "pid"),
    ):
        try:
            _unshare(flag)
            got |= flag
        except OSError as e:
            report[name] = f"not isolated: unshare failed ({e.strerror})"
    return got


def _mounts() -> list[tuple[str, str]]:
    """(mount point, per-mount options) of every mount this process sees."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])  # \040
            out.append((point, fields[5]))
    return out


# Top-level folders the code keeps seeing (read-only): the system. Every other one (the
# project, data, checkpoints, /tmp, /run, /home, /root, ...) is covered by an empty tmpfs.
SYSTEM_FOLDERS = (
    "bin",
    "dev",
    "etc",
    "lib",
    "lib32",
    "lib64",
    "libx32",
    "proc",
    "sbin",
    "sys",
    "usr",
)


def _hide_folders(calls_dir: str) -> list[str]:
    """Cover the non-system folders with empty tmpfs; bind back what a worker needs.

    Kept: the interpreter's prefixes and import path (lazy imports read them) and
    calls_dir (writable). A kept path keeps its own name, and a folder closed to others
    on its way (/root is 0700 when Python lives in /root/.pyenv) is covered too, so an
    unprivileged uid reaches it. Returns the covered folders.
    """
    wanted = {sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path}
    keep = sorted({os.path.realpath(p) for p in wanted if p and os.path.exists(p)} | {calls_dir})
    keep = [p for i, p in enumerate(keep) if not any(p.startswith(q + "/") for q in keep[:i])]
    covered = {f"/{e.name}" for e in os.scandir("/") if e.is_dir(follow_symlinks=False)}
    covered -= {f"/{name}" for name in SYSTEM_FOLDERS}
    covered.add("/dev/shm")
    for path in keep:  # a closed folder on the way to a kept path, outside the covered ones
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            folder = "/" + "/".join(parts[:i])
            if folder in covered:
                break
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                covered.add(folder)
                break
    fds = {p: os.open(p, os.O_PATH) for p in keep}
    for folder in sorted(covered):
        if os.path.isdir(folder) and not os.path.islink(folder):
            _mount("tmpfs", folder, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=755,size=64k")
    for path, fd in fds.items():
        if any(path.startswith(c + "/") for c in covered):
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                os.makedirs(path, 0o755, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), 0o755, exist_ok=True)
                open(path, "a").close()
        _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
        os.close(fd)
    return sorted(covered)


def _lock_filesystem(calls_dir: str, flags: int, report: dict[str, str]) -> None:
    """In the new mount namespace: fresh /proc and /sys, the non-system folders hidden,
    everything read-only but calls_dir."""
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    if flags & _CLONE_NEWPID:  # /proc lists the processes of the mounter's pid namespace
        _detach("/proc")
        _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    if flags & _CLONE_NEWNET:  # /sys/class/net shows the mounter's network namespace
        _detach("/sys")
        _mount("sysfs", "/sys", "sysfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    covered = _hide_folders(calls_dir)
    failed = []
    for point, options in _mounts():
        if point == calls_dir:
            continue
        keep = sum(_MOUNT_OPTIONS.get(o, 0) for o in options.split(","))
        try:
            _mount(None, point, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | keep)
        except OSError as e:
            hidden = any(point.startswith(c + "/") for c in covered)
            if not (hidden and e.errno in (errno.ENOENT, errno.EINVAL)):  # under a cover
                failed.append(f"{point} ({e.strerror})")
    report["filesystem"] = (
        "read-only mount namespace; writable: only the call's own folder; hidden (empty): "
        + ", ".join(covered)
        + " except the interpreter's folders"
        + (f"; still writable: {', '.join(failed)}" if failed else "")
    )


def server_main(ctl_fd: int, calls_dir: str, size: int, disk_mb: int, max_files: int) -> None:
    root = os.geteuid() == 0
    report: dict[str, str] = {}
    flags = _enter_namespaces(root, report)
    if flags & _CLONE_NEWPID:  # the pid namespace starts with the next child: it serves
        pid = os.fork()
        if pid:
            os.close(ctl_fd)
            os._exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) & 0xFF)
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # if the relay above is killed, so is pid 1
        report["pid"] = "own pid namespace: the server is pid 1, the trainer is out of reach"
    if flags & _CLONE_NEWNS:
        try:
            _lock_filesystem(calls_dir, flags, report)
        except OSError as e:
            report["filesystem"] = f"not isolated: setting up the mount namespace failed ({e})"
    # A size-capped tmpfs per call needs the mount namespace (and root, to mount it).
    fs_isolated = not report.get("filesystem", "not isolated").startswith("not isolated")
    disk = disk_mb if root and flags & _CLONE_NEWNS and fs_isolated else 0
    report["disk"] = (
        f"each call's folder is a tmpfs of {disk_mb} MiB and {max_files} files (folders "
        "included), nosuid, nodev, noexec; RLIMIT_FSIZE=memory_mb per file"
        if disk
        else "not isolated (no mount namespace): only RLIMIT_FSIZE=memory_mb per file; the "
        "number of files and their sum are unbounded"
    )
    if flags & _CLONE_NEWNET:
        report["network"] = "own network namespace: only lo, and it is down"
    report["uid"] = (
        f"own uid per worker ({UID_BASE} + slot), no capabilities, no_new_privs"
        if root
        else f"not isolated: the trainer's uid {os.getuid()} (setuid needs root)"
    )
    report["limits"] = (
        "RLIMIT_NPROC=0 (no fork or thread), RLIMIT_AS and RLIMIT_FSIZE=memory_mb, "
        f"RLIMIT_CPU=ceil(timeout_s), RLIMIT_NOFILE={MAX_OPEN_FILES}, RLIMIT_CORE=0"
    )
    for name in PRELOAD:
        __import__(name)
    gc.freeze()  # the collector in a worker leaves the server's objects (and pages) alone
    sock = socket.socket(fileno=ctl_fd)
    sock.send(b"I " + json.dumps(report).encode())
    _serve(sock, calls_dir, size, root, (disk, max_files) if disk else None)


def _serve(
    sock: socket.socket, calls_dir: str, size: int, root: bool, disk: tuple[int, int] | None
) -> None:
    """Keep ``size`` idle workers; kill on request; reap, clean up and report each one."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    live: dict[int, tuple[int, str, int, int]] = {}  # id -> (pid, folder, slot, status fd)
    by_pid: dict[int, int] = {}
    idle: set[int] = set()
    free_slots = list(range(MAX_SLOTS))
    next_id = 0
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    while True:
        while len(idle) < size and free_slots:
            slot = heapq.heappop(free_slots)
            wid, next_id = next_id, next_id + 1
            folder = os.path.join(calls_dir, str(wid))
            job_r, job_w = os.pipe()
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            status_r, status_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                uid = UID_BASE + slot if root else None
                _worker_main(job_r, out_w, err_w, folder, uid, disk)
            for fd in (job_r, out_w, err_w):
                os.close(fd)
            socket.send_fds(sock, [f"R {wid}".encode()], [out_r, err_r, job_w, status_r])
            for fd in (out_r, err_r, job_w, status_r):
                os.close(fd)
            live[wid] = (pid, folder, slot, status_w)
            by_pid[pid] = wid
            idle.add(wid)
        for key, _ in sel.select():
            if key.fd == wake_r:
                os.read(wake_r, 4096)
                while True:
                    try:
                        pid, status, usage = os.wait4(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    wid = by_pid.pop(pid)
                    _, folder, slot, status_w = live.pop(wid)
                    idle.discard(wid)
                    _remove(folder, disk is not None)
                    heapq.heappush(free_slots, slot)
                    cpu_s = usage.ru_utime + usage.ru_stime
                    os.write(status_w, f"{status} {cpu_s:.3f}".encode())
                    os.close(status_w)
                continue
            msg = sock.recv(64)
            if not msg:  # the trainer closed the pool or died: stop every worker, clean up
                for pid, folder, _, _ in live.values():
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    _remove(folder, disk is not None)
                os._exit(0)
            kind, wid = msg.split()[0], int(msg.split()[1])
            if kind == b"T":
                idle.discard(wid)
            elif kind == b"K" and wid in live:
                os.kill(live[wid][0], signal.SIGKILL)


def _remove(folder: str, mounted: bool) -> None:
    """Delete a call's folder: unmount its tmpfs (whatever it holds goes at once), or delete
    what it holds file by file."""
    if mounted:
        with contextlib.suppress(OSError):  # the worker died before it mounted its folder
            _detach(folder)
    try:
        os.rmdir(folder)  # most calls leave their folder empty
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)


def _worker_main(
    job_r: int, out_w: int, err_w: int, folder: str, uid: int | None, disk: tuple[int, int] | None
) -> None:
    """A forked worker: isolate, wait for one job, run it, exit. Never returns. ``disk``:
    (MiB, files) of the tmpfs mounted on its folder (None: a plain folder)."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd, target in ((job_r, 0), (out_w, 1), (err_w, 2)):
            os.dup2(fd, target)
        os.closerange(3, max(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[0]))
        os.mkdir(folder, 0o700)
        if disk is not None and uid is not None:  # still root, in the server's namespaces
            owner = f"uid={uid},gid={uid}"
            data = f"size={disk[0]}m,nr_inodes={disk[1]},mode=0700,{owner}"
            _mount("tmpfs", folder, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, data)
        elif uid is not None:
            os.chown(folder, uid, uid)
        os.chdir(folder)  # after the mount: the cwd is the tmpfs, not the folder under it
        for limit, value in (
            (resource.RLIMIT_NPROC, 0),
            (resource.RLIMIT_NOFILE, MAX_OPEN_FILES),
            (resource.RLIMIT_CORE, 0),
        ):
            resource.setrlimit(limit, (value, value))
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)  # from root: every capability goes with it
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        os.environ.clear()
        os.environ.update(MINIMAL_ENV, HOME=folder, TMPDIR=folder)
        chunks = []
        while chunk := os.read(0, 1 << 16):
            chunks.append(chunk)
        header, _, source = b"".join(chunks).partition(b"\n")
        limits = json.loads(header)
        cpu_s = max(1, math.ceil(limits["timeout_s"]))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        for limit in (resource.RLIMIT_AS, resource.RLIMIT_FSIZE):
            resource.setrlimit(limit, (limits["memory_mb"] << 20,) * 2)
        os.write(1, b"+")  # the job is taken: the trainer strips this first byte
    except BaseException as e:
        os.write(2, f"{SETUP_MARK}{e!r}\n".encode())
        os._exit(SETUP_FAILED)
    _run_code(source.decode("utf-8", "replace"))


def _run_code(source: str) -> None:
    """exec ``source`` as __main__ in a fresh dict, exit with its status (like ``python -u``)."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(raw, "utf-8", "backslashreplace", write_through=True)  # type: ignore[arg-type]
        setattr(sys, name, stream)
    sys.argv = ["<sandbox>"]
    linecache.cache["<sandbox>"] = (len(source), None, source.splitlines(True), "<sandbox>")
    status = 0
    try:
        exec(
            compile(source, "<sandbox>", "exec"), {"__name__": "__main__", "__builtins__": builtins}
        )
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = (e.code or 0) & 0xFF
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next  # show the code's own frames only
        traceback.print_exception(type(e), e, tb)
        status = 1
    os._exit(status)


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    server_main(int(sys.argv[2]), sys.argv[3], *(int(a) for a in sys.argv[4:7]))
