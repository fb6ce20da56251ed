"""Run model-written Python in an isolated, bounded process: ``run_python(code)``.

A pool starts one fork server (:mod:`rltrain.envs.sandbox_server`, run as ``python -I
sandbox_server.py --serve``). As root the server unshares a mount, a network and a pid
namespace, becomes pid 1 of the new pid namespace, mounts a fresh /proc and /sys, makes
every mount read-only except the folder that holds the calls' folders, and imports the
common stdlib modules once. It keeps ``size`` workers forked ahead: each makes its own
folder, sets its rlimits, drops to its own unprivileged uid and waits on a pipe for
exactly one job. The worker's pipe ends reach the trainer over a unix socket
(SCM_RIGHTS). A call takes a ready worker, writes the job, reads stdout, stderr and the
status pipe itself (bounded, all at once) and asks the server to SIGKILL the worker at
the wall-clock deadline or on an output flood. The server reaps the worker, deletes its
folder, writes the wait status and forks a replacement. docs/sandbox.md says what is
enforced where and what falls back.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import queue
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from rltrain.envs import sandbox_server
from rltrain.envs.sandbox_server import (
    DEFAULT_DISK_MB,
    DEFAULT_MAX_FILES,
    MINIMAL_ENV,
    SETUP_FAILED,
    SETUP_MARK,
)

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_MB = 512
DEFAULT_MAX_OUTPUT_BYTES = 64 * 1024
KILL_GRACE_S = 5.0  # from SIGKILL to the server's report; past it the server is restarted
START_TIMEOUT_S = 30.0  # for the server's start and for a free worker
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT}


@dataclass(frozen=True)
class SandboxResult:
    """What one piece of code did. ``exit_code`` < 0 means killed by signal ``-exit_code``.

    ``timed_out``: killed at the wall-clock deadline or by the CPU time limit.
    ``truncated``: stdout or stderr reached ``max_output_bytes`` (the process was stopped).
    ``seconds``: wall time of the call, waiting for a worker included.
    ``error``: one line saying what went wrong (None when the code exited 0 in time).
    """

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    truncated: bool
    seconds: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        """The code exited 0 within its time and output limits."""
        return self.error is None


def check_limits(timeout_s: float, memory_mb: int, max_output_bytes: int) -> None:
    """Raise ValueError naming the first argument that is not a positive finite number."""
    for name, value, fix in (
        ("timeout_s", timeout_s, f"pass seconds, e.g. timeout_s={DEFAULT_TIMEOUT_S}"),
        ("memory_mb", memory_mb, f"pass MiB, e.g. memory_mb={DEFAULT_MEMORY_MB}"),
        ("max_output_bytes", max_output_bytes, "pass bytes, e.g. max_output_bytes=65536"),
    ):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive number; {fix}")
        if name != "timeout_s" and value != int(value):
            raise ValueError(f"{name}={value!r} must be a whole number; {fix}")


# ---- the trainer's side ----


@dataclass
class _Worker:
    """A ready worker as the trainer holds it: its pipe ends (stdout, stderr, job, status)."""

    wid: int
    out: int
    err: int
    job: int
    status_fd: int
    generation: int
    server: socket.socket  # its own server's socket: a message never reaches a later server
    status: int | None = None  # os.wait status; None when the server stopped first
    cpu_s: float = 0.0

    def read_status(self) -> None:
        """Read the server's report (the status pipe is readable: report or end of file)."""
        report = os.read(self.status_fd, 64).split()
        if report:
            self.status, self.cpu_s = int(report[0]), float(report[1])
        os.close(self.status_fd)


_GONE = object()  # put on the ready queue when a server stops: waiters start the next one


class SandboxPool:
    """A fork server and ``size`` pre-isolated workers; ``run`` is safe from many threads.

    The server starts on the first call (about 0.1-0.3 s). ``isolation`` says what this
    machine enforces (filled after the start). ``close()`` stops every worker and deletes
    the pool's folder; a call on a closed pool raises RuntimeError.
    """

    def __init__(
        self, size: int = 4, disk_mb: int = DEFAULT_DISK_MB, max_files: int = DEFAULT_MAX_FILES
    ) -> None:
        if size < 1:
            raise ValueError(f"size={size} must be at least 1 (the number of idle workers)")
        for name, value, unit in (("disk_mb", disk_mb, "MiB"), ("max_files", max_files, "files")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"{name}={value!r} must be a whole number >= 1 ({unit} one call may write)"
                )
        self.size = size
        # What one call may write into its folder (a tmpfs of its own where the server has a
        # mount namespace: `isolation["disk"]` says whether it does).
        self.disk_mb, self.max_files = disk_mb, max_files
        self.isolation: dict[str, str] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._closed = False
        self._generation = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._reader: threading.Thread | None = None
        self._folder = ""
        self._ready: queue.Queue[object] = queue.Queue()

    @property
    def server_pid(self) -> int | None:
        """The pid of the server process as the trainer sees it (None before the start)."""
        return self._proc.pid if self._proc else None

    @property
    def calls_folder(self) -> str:
        """Where the calls' folders are made (each is deleted when its worker ends)."""
        return os.path.join(self._folder, "calls") if self._folder else ""

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the server now rather than on the first call."""
        self._current()

    def _current(self) -> tuple[queue.Queue[object], int]:
        with self._lock:
            if self._closed:
                raise RuntimeError("this SandboxPool is closed; make a new one")
            if self._proc is None:
                self._start()
            return self._ready, self._generation

    def _start(self) -> None:
        self._generation += 1
        self._ready = queue.Queue()
        self._folder = tempfile.mkdtemp(prefix="rltrain-sandbox-")
        calls = os.path.join(self._folder, "calls")
        os.mkdir(calls)
        for path in (self._folder, calls):
            os.chmod(path, 0o711)  # workers pass through, and list nothing
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        log_path = os.path.join(self._folder, "server.log")
        with open(log_path, "wb") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", os.path.abspath(sandbox_server.__file__), "--serve"]
                + [str(theirs.fileno()), os.path.realpath(calls), str(self.size)]
                + [str(self.disk_mb), str(self.max_files)],
                pass_fds=[theirs.fileno()],
                env=dict(MINIMAL_ENV),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,  # no controlling terminal, out of the trainer's group
                cwd="/",
            )
        theirs.close()
        ours.settimeout(START_TIMEOUT_S)
        try:
            hello = ours.recv(1 << 16)
        except OSError:
            hello = b""
        if not hello.startswith(b"I "):
            ours.close()
            self._stop_server()
            with open(log_path, errors="replace") as f:
                tail = f.read()[-2000:]
            raise RuntimeError(f"the sandbox server did not start: {tail.strip() or 'no output'}")
        ours.settimeout(None)
        self.isolation = json.loads(hello[2:])
        self._sock = ours
        args = (ours, self._generation, self._ready)
        self._reader = threading.Thread(target=self._read_server, args=args, daemon=True)
        self._reader.start()

    def _read_server(self, sock: socket.socket, generation: int, ready: queue.Queue) -> None:
        """Queue each worker the server announces (``R <id>`` with its 4 pipe ends)."""
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(sock, 256, 4, socket.MSG_CMSG_CLOEXEC)
            except OSError:
                msg, fds = b"", []
            if not msg:
                break
            out, err, job, status = fds
            ready.put(_Worker(int(msg.split()[1]), out, err, job, status, generation, sock))
        with self._lock:  # the server is gone (the workers' status pipes end too)
            if generation == self._generation:
                self._stop_server()
        _drain(ready)

    def _stop_server(self, kill: bool = False) -> None:
        """Stop the server (its pid namespace dies with it), delete its folder; lock held.

        Closing the socket ends a healthy server at once; ``kill`` is for a stuck one.
        """
        if self._sock is not None:
            with contextlib.suppress(OSError):  # the server may have closed its end
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            if kill:
                self._proc.kill()  # the relay; pid 1 of the namespace follows (PDEATHSIG)
            try:
                self._proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._folder:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = ""

    def close(self) -> None:
        """Stop the server and every worker, delete the pool's folder. Idempotent."""
        with self._lock:
            self._closed = True
            self._stop_server()
            reader = self._reader
        if reader is not None:  # it drains the queue of the server it served
            reader.join(KILL_GRACE_S)
        _drain(self._ready)

    def _send(self, w: _Worker, kind: str) -> None:
        """Tell the worker's server ``T`` (taken) or ``K`` (kill it)."""
        with self._send_lock, contextlib.suppress(OSError):  # a server that is gone has
            w.server.send(f"{kind} {w.wid}".encode())  # ended every status pipe already

    def _take(self, until: float) -> _Worker | None:
        """A ready worker of the current server (started if needed), or None at ``until``."""
        while True:
            ready, _ = self._current()
            try:
                item = ready.get(timeout=max(0.0, until - time.monotonic()))
            except queue.Empty:
                return None
            if item is _GONE:
                ready.put(_GONE)  # wake the next waiter on this stopped server too
                if self._closed:
                    raise RuntimeError("this SandboxPool is closed; make a new one")
                continue
            assert isinstance(item, _Worker)
            if not select.select([item.status_fd], [], [], 0)[0]:
                return item
            _close_fds(item.out, item.err, item.job, item.status_fd)  # ended while idle

    def run(
        self,
        code: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        memory_mb: int = DEFAULT_MEMORY_MB,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    ) -> SandboxResult:
        """Run ``code`` in one fresh worker; returns within about timeout_s + KILL_GRACE_S."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a str of Python source, not {type(code).__name__}")
        check_limits(timeout_s, memory_mb, max_output_bytes)
        start = time.monotonic()
        job = json.dumps({"timeout_s": timeout_s, "memory_mb": int(memory_mb)}).encode()
        job += b"\n" + code.encode("utf-8", "replace")
        # A worker killed before it took its job is skipped; every idle one may be dead
        # (killed from outside, not yet reaped by the server), so try one more than it holds.
        tries = self.size + 1
        for _ in range(tries):
            worker = self._take(start + START_TIMEOUT_S)
            if worker is None:
                text = f"no sandbox worker was ready within {START_TIMEOUT_S:g} s"
                return SandboxResult("", "", -1, False, False, time.monotonic() - start, text)
            deadline = time.monotonic() + timeout_s
            if not _write_all(worker.job, job, deadline):
                _close_fds(worker.out, worker.err, worker.status_fd)
                continue
            self._send(worker, "T")  # taken: the server forks a replacement while it runs
            result = self._collect(worker, start, deadline, timeout_s, int(max_output_bytes))
            if result is not None:
                return result
        text = f"{tries} sandbox workers in a row were killed before taking the job"
        return SandboxResult("", "", -1, False, False, time.monotonic() - start, text)

    def _collect(
        self, w: _Worker, start: float, deadline: float, timeout_s: float, limit: int
    ) -> SandboxResult | None:
        """Read stdout and stderr up to ``limit`` bytes each and the status, kill at the deadline.

        None: the worker died by a signal before it acknowledged its job (the first byte
        on stdout), so the code never ran; the caller tries another worker.
        """
        started = False
        bufs = {w.out: bytearray(), w.err: bytearray()}
        sel = selectors.DefaultSelector()
        for fd in (w.out, w.err, w.status_fd):
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        reason = ""  # why the trainer's side killed the worker: "timeout" or the flooded stream
        until = deadline
        while sel.get_map():
            now = time.monotonic()
            if now >= until:
                if reason:  # killed but unreported: the server is stuck; restart it
                    with self._lock:
                        if w.generation == self._generation:
                            self._stop_server(kill=True)
                    break
                reason, until = "timeout", now + KILL_GRACE_S
                self._send(w, "K")
            for key, _ in sel.select(_wait_s(until)):
                fd = int(key.fd)
                if fd == w.status_fd:
                    sel.unregister(fd)
                    w.read_status()
                    continue
                data = os.read(fd, 1 << 16)
                if not data:
                    sel.unregister(fd)
                    continue
                if fd == w.out and not started:
                    started, data = True, data[1:]
                buf = bufs[fd]
                room = limit - len(buf)
                buf += data[: max(0, room)]
                if len(data) > room and not reason:
                    reason, until = ("stdout" if fd == w.out else "stderr"), now + KILL_GRACE_S
                    self._send(w, "K")
        if w.status_fd in sel.get_map():  # unread only after a stuck server
            _close_fds(w.status_fd)
        sel.close()
        _close_fds(w.out, w.err)
        if not started and not reason and w.status is not None and os.WIFSIGNALED(w.status):
            return None
        stdout, stderr = (bytes(bufs[fd]).decode("utf-8", "replace") for fd in (w.out, w.err))
        return _result(w, stdout, stderr, reason, timeout_s, limit, time.monotonic() - start)


def _result(
    w: _Worker, stdout: str, stderr: str, reason: str, timeout_s: float, limit: int, seconds: float
) -> SandboxResult:
    cpu_limit = max(1, math.ceil(timeout_s))
    code = -signal.SIGKILL if w.status is None else os.waitstatus_to_exitcode(w.status)
    sig = -code if code < 0 else 0
    if reason == "timeout" and sig != signal.SIGKILL:
        reason = ""  # it ended on its own before the kill arrived
    cpu_out = sig == signal.SIGXCPU or (
        sig == signal.SIGKILL and not reason and w.cpu_s >= cpu_limit
    )
    last = stderr.strip().splitlines()[-1:] if stderr.strip() else []
    if w.status is None:
        error = "the sandbox server stopped before the code ended (it was restarted)"
    elif reason == "timeout":
        error = f"timed out after {timeout_s:g} s of wall-clock time; the process was killed"
    elif reason:
        stopped = ", process stopped" if sig else ""
        error = f"{reason} reached max_output_bytes={limit}; output truncated{stopped}"
    elif cpu_out:
        error = f"exceeded the CPU time limit of {cpu_limit} s; the process was killed"
    elif code == SETUP_FAILED and stderr.startswith(SETUP_MARK):
        error = stderr.strip()
    elif sig:
        crash = " (the interpreter crashed)" if sig in _CRASH_SIGNALS else ""
        error = f"killed by {signal.Signals(sig).name}{crash}"
    elif code:
        error = f"exited with code {code}" + (f": {last[0]}" if last else "")
    else:
        error = None
    timed_out = reason == "timeout" or cpu_out
    return SandboxResult(
        stdout, stderr, code, timed_out, reason in ("stdout", "stderr"), seconds, error
    )


def _write_all(fd: int, data: bytes, deadline: float) -> bool:
    """Write the job and close the pipe; False if the worker is gone (or stuck) before it."""
    os.set_blocking(fd, False)
    view = memoryview(data)
    try:
        view = view[os.write(fd, view) :]  # a job within the pipe's buffer: one write
        if not view:
            return True
        with selectors.DefaultSelector() as sel:  # a larger one as the worker reads it
            sel.register(fd, selectors.EVENT_WRITE)
            while view:
                if not sel.select(_wait_s(deadline)):
                    if time.monotonic() >= deadline:
                        return False
                    continue
                view = view[os.write(fd, view) :]
        return True
    except (BrokenPipeError, BlockingIOError):
        return False
    finally:
        os.close(fd)


def _drain(ready: queue.Queue[object]) -> None:
    """Close the pipes of the workers left on a stopped server's queue, then wake waiters."""
    while True:
        try:
            item = ready.get_nowait()
        except queue.Empty:
            break
        if isinstance(item, _Worker):
            _close_fds(item.out, item.err, item.job, item.status_fd)
    ready.put(_GONE)


def _wait_s(until: float) -> float:
    """Seconds to wait for ``until`` (monotonic), at most an hour per wait (epoll's range)."""
    return min(max(0.0, until - time.monotonic()), 3600.0)


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


_default_pool: SandboxPool | None = None
_default_lock = threading.Lock()


def default_pool() -> SandboxPool:
    """The module's shared pool, made on first use and closed at interpreter exit."""
    global _default_pool
    with _default_lock:
        if _default_pool is None:
            _default_pool = SandboxPool()
            atexit.register(_default_pool.close)
        return _default_pool


def run_python(
    code: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    pool: SandboxPool | None = None,
) -> SandboxResult:
    """Run model-written ``code`` in the sandbox (``pool`` or the shared default pool).

    Whatever the code does, this returns a SandboxResult within about timeout_s plus a
    few seconds; non-positive limits raise ValueError naming the argument.
    """
    check_limits(timeout_s, memory_mb, max_output_bytes)
    return (pool or default_pool()).run(code, timeout_s, memory_mb, max_output_bytes)


def measure_calls_per_s(n: int, threads: int = 1, pool: SandboxPool | None = None) -> float:
    """Calls per second of ``print(1 + 1)`` through a warm pool, ``n`` calls over ``threads``.

    Every result is checked; a pool is made (and closed) when none is given. Shared with
    the benchmarks (scripts/bench_sandbox.py and the multi-turn one).
    """
    own = pool is None
    pool = pool or SandboxPool()
    try:
        for _ in range(max(4, pool.size)):  # warm: the server runs, every idle worker forked
            pool.run("print(1 + 1)")
        counts = [n // threads + (i < n % threads) for i in range(threads)]
        bad: list[SandboxResult] = []

        def calls(count: int) -> None:
            bad.extend(
                r for r in (pool.run("print(1 + 1)") for _ in range(count)) if r.stdout != "2\n"
            )

        workers = [threading.Thread(target=calls, args=(c,)) for c in counts]
        start = time.perf_counter()
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        seconds = time.perf_counter() - start
        if bad:
            raise RuntimeError(f"{len(bad)} of {n} sandbox calls failed, e.g. {bad[0]}")
        return n / seconds
    finally:
        if own:
            pool.close()
