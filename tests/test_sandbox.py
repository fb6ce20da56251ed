"""The Python sandbox: every bad behaviour ends in a bounded result that says what happened.

One pool serves most tests (its server starts once). Where this machine cannot isolate
(not root, no namespaces) the tests of that layer skip with the pool's stated reason.
Network checks never leave the machine: they read the namespace's interfaces and try a
port the test itself serves on 127.0.0.1.
"""

from __future__ import annotations

import ast
import glob
import json
import math
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid

import pytest

from rltrain.envs.sandbox import SandboxPool, run_python
from rltrain.envs.sandbox_server import MAX_OPEN_FILES, MINIMAL_ENV, UID_BASE

GRACE_S = 3.0  # a killed call must come back within its timeout plus this (busy 2-core CI)


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(size=2) as p:
        p.start()
        yield p


def _enforced(pool: SandboxPool, layer: str) -> None:
    if pool.isolation[layer].startswith("not isolated"):
        pytest.skip(f"{layer}: {pool.isolation[layer]}")


def test_trivial_code_and_the_shared_pool(pool):
    r = pool.run("print(1 + 1)")
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out, r.truncated, r.error) == (
        "2\n",
        "",
        0,
        False,
        False,
        None,
    )
    assert r.ok and 0 < r.seconds < 5
    assert pool.run("print(1)", timeout_s=1e9, memory_mb=10**6).stdout == "1\n"  # huge is fine
    assert run_python("print(6 * 7)").stdout == "42\n"  # the module's default pool


@pytest.mark.parametrize(
    "code",
    ["while True: pass", "import time\ntime.sleep(1000)", "import signal\nsignal.pause()"],
    ids=["busy-loop", "sleep", "pause"],
)
def test_code_that_never_ends_is_killed_at_the_deadline(pool, code):
    r = pool.run(code, timeout_s=0.5)
    assert r.timed_out and r.exit_code == -signal.SIGKILL
    assert 0.5 <= r.seconds < 0.5 + GRACE_S
    assert r.error == "timed out after 0.5 s of wall-clock time; the process was killed"


def test_the_cpu_time_limit_is_the_kernels(pool):
    """RLIMIT_CPU ends a busy loop by SIGXCPU (here lowered to 1 s, under the wall clock)."""
    code = (
        "import resource\n"
        "hard = resource.getrlimit(resource.RLIMIT_CPU)[1]\n"
        "resource.setrlimit(resource.RLIMIT_CPU, (1, hard))\n"
        "while True: pass"
    )
    r = pool.run(code, timeout_s=30)
    assert r.timed_out and r.exit_code == -signal.SIGXCPU and r.seconds < 30
    assert r.error == "exceeded the CPU time limit of 30 s; the process was killed"


def test_output_before_the_deadline_is_kept(pool):
    r = pool.run("print('started', flush=True)\nwhile True: pass", timeout_s=0.5)
    assert r.timed_out and r.stdout == "started\n"


def test_the_limits_are_set_in_the_worker(pool):
    code = (
        "import os, resource\n"
        "names = ['AS', 'CPU', 'NPROC', 'NOFILE', 'CORE', 'FSIZE']\n"
        "print([resource.getrlimit(getattr(resource, 'RLIMIT_' + n)) for n in names])\n"
        "print(os.getuid(), os.getgid(), os.getgroups())"
    )
    r = pool.run(code, timeout_s=2.5, memory_mb=300)
    limits, ids = r.stdout.splitlines()
    mem = 300 << 20
    assert eval(limits) == [(mem, mem), (3, 4), (0, 0), (MAX_OPEN_FILES,) * 2, (0, 0), (mem, mem)]
    if os.geteuid() == 0:  # its own unprivileged uid and gid, no supplementary groups
        uid, gid, groups = ids.split(" ", 2)
        assert int(uid) == int(gid) >= UID_BASE and groups == "[]"


@pytest.mark.parametrize(
    "code",
    [
        "a = []\nwhile True: a.append(bytearray(10**6))",
        "x = bytearray(400 * 2**20)",
        "x = ' ' * (400 * 2**20)",
    ],
    ids=["grow", "one-block", "str"],
)
def test_memory_is_bounded(pool, code):
    r = pool.run(code, timeout_s=5, memory_mb=200)
    assert r.exit_code == 1 and not r.timed_out
    assert (
        r.stderr.rstrip().endswith("MemoryError") and r.error == "exited with code 1: MemoryError"
    )


def test_file_size_is_bounded(pool):
    code = "with open('big', 'wb') as f:\n    for _ in range(100):\n        f.write(bytes(2**20))"
    r = pool.run(code, timeout_s=5, memory_mb=50)
    assert r.exit_code == 1 and "File too large" in r.error, r.error


# Hostile writers: what each managed to write before the bound stopped it, and the errno.
_FLOOD = (
    "import os\nn = 0\ntry:\n    while True:\n        open(f'f{n}', 'w').close(); n += 1\n"
    "except OSError as e:\n    print(n, os.stat('.').st_size, e.errno)"
)
_MANY_LARGE = (
    "n = 0\ntry:\n    while True:\n        with open(f'f{n}', 'wb') as f: f.write(bytes(3 << 20))\n"
    "        n += 1\nexcept OSError as e:\n    import os\n"
    "    print(n, sum(os.path.getsize(p) for p in os.listdir('.')), e.errno)"
)
_HUGE = (
    "import os\ntry:\n    with open('big', 'wb') as f:\n        while True: f.write(bytes(1 << 20))\n"
    "except OSError as e:\n    print(1, os.path.getsize('big'), e.errno)"
)


@pytest.fixture(scope="module")
def small_disk_pool():
    with SandboxPool(size=1, disk_mb=8, max_files=32) as p:
        p.start()
        yield p


@pytest.mark.parametrize(
    "code", [_FLOOD, _MANY_LARGE, _HUGE], ids=["file-flood", "many-large", "huge"]
)
def test_what_a_call_writes_is_bounded_in_files_and_bytes(small_disk_pool, code):
    """Each call's folder is a tmpfs of disk_mb MiB and max_files files: a flood of empty
    files, files each under RLIMIT_FSIZE but together over the cap, and one huge file (under
    a per-file limit of 1000 MiB) all stop at ENOSPC within the cap, and the next call's
    folder is empty again."""
    _enforced(small_disk_pool, "disk")
    r = small_disk_pool.run(code, timeout_s=10, memory_mb=1000)
    assert r.exit_code == 0, r.error
    files, size, err = (int(x) for x in r.stdout.split())
    assert err == 28  # ENOSPC: No space left on device
    assert files < 32 and size <= 8 << 20
    if code is _FLOOD:
        assert files >= 16  # the cap counts the folder itself and leaves room
    else:
        assert size >= 6 << 20  # the bytes ran out, not the files
    again = small_disk_pool.run("import os\nprint(os.listdir('.'))")
    assert again.stdout.strip() == "[]"


def test_bad_disk_limits_name_the_argument():
    with pytest.raises(ValueError, match="disk_mb=0 must be a whole number >= 1"):
        SandboxPool(disk_mb=0)
    with pytest.raises(ValueError, match="max_files=1.5 must be a whole number >= 1"):
        SandboxPool(max_files=1.5)  # type: ignore[arg-type]


def test_the_env_registry_lists_the_sandbox_environment():
    """The server runs under ``python -I`` and cannot import rltrain: its MINIMAL_ENV is
    declared again in the env registry (src/rltrain/env.py), which must say the same."""
    from rltrain import env

    assert {v.name: v.value for v in env.SANDBOX_ENV} == MINIMAL_ENV


@pytest.mark.parametrize(
    "code, needle",
    [
        ("import os\nwhile True: os.fork()", "BlockingIOError"),
        ("import subprocess\nsubprocess.run(['true'])", "BlockingIOError"),
        ("import threading\nthreading.Thread(target=print).start()", "can't start new thread"),
    ],
    ids=["fork-bomb", "subprocess", "thread"],
)
def test_no_new_process_or_thread(pool, code, needle):
    r = pool.run(code, timeout_s=2)
    assert r.exit_code == 1 and needle in r.stderr, r.stderr


def test_an_exec_stays_inside_the_limits(pool):
    """exec replaces the worker (the kernel refuses it only at times): its program cannot fork."""
    r = pool.run("import os\nos.execv('/bin/sh', ['sh', '-c', '/bin/true && echo ran'])")
    assert "ran" not in r.stdout and r.exit_code != 0, r


def test_writes_outside_its_folder_fail(pool, tmp_path):
    _enforced(pool, "filesystem")
    outside = [
        f"/tmp/rltrain-escape-{uuid.uuid4().hex}",
        str(tmp_path / "escape"),
        os.path.join(pool.calls_folder, "escape"),  # beside the calls' folders
        "../escape",
    ]
    code = (
        "import errno, os\n"
        f"for path in {outside!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('wrote', path)\n"
        "    except OSError as e:\n"
        "        print('refused', errno.errorcode[e.errno])\n"
        "open('mine.txt', 'w').write('mine')\n"
        "print(open('mine.txt').read(), os.getcwd())"
    )
    r = pool.run(code, timeout_s=3)
    lines = r.stdout.splitlines()
    assert r.exit_code == 0 and all(line.startswith("refused") for line in lines[:4]), lines
    assert lines[4].startswith("mine " + pool.calls_folder + "/")
    assert not any(os.path.exists(p) for p in outside[:3])
    assert lines[0] == "refused EROFS"  # /tmp is writable by anyone, but not from here


def _wait_for_idle_workers(pool: SandboxPool, n: int, timeout_s: float = 60.0) -> None:
    """Until the server has announced ``n`` forked, idle workers (each with its folder)."""
    ready, _ = pool._current()
    deadline = time.monotonic() + timeout_s
    while ready.qsize() < n:
        if time.monotonic() > deadline:
            pytest.fail(f"the pool announced {ready.qsize()} of {n} idle workers in {timeout_s} s")
        time.sleep(0.01)


def test_other_calls_folders_are_closed(pool):
    """The idle workers' folders exist beside this call's; none can be listed or written."""
    _enforced(pool, "uid")
    _wait_for_idle_workers(pool, 2)  # the call takes one; the other's folder stands beside it
    code = (
        "import os\n"
        "calls, own = os.path.split(os.getcwd())\n"
        "others = [f for f in map(str, range(10000)) if f != own and os.path.isdir(f'{calls}/{f}')]\n"
        "written = 0\n"
        "for f in others:\n"
        "    try:\n"
        "        open(f'{calls}/{f}/x', 'w').close()\n"
        "        written += 1\n"
        "    except PermissionError:\n"
        "        pass\n"
        "try:\n"
        "    os.listdir(calls)\n"
        "except PermissionError:\n"
        "    print('unlistable')\n"
        "print(len(others) > 0, written)"
    )
    assert pool.run(code).stdout == "unlistable\nTrue 0\n"


def _tmp_in_sight(pool) -> list[str]:
    """What a worker may see in /tmp: the pool's own folder, and the top folder of the
    interpreter's prefixes where they live under /tmp (a checkout and its venv there)."""
    seen = {os.path.basename(os.path.dirname(pool.calls_folder))}
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix}:
        real = os.path.realpath(prefix)
        if real.startswith("/tmp/"):
            seen.add(real.split("/")[2])
    return sorted(seen)


def test_only_the_system_and_the_interpreter_are_in_sight(pool):
    _enforced(pool, "filesystem")
    code = (
        "import os, sys\n"
        f"print(os.path.exists({__file__!r}), os.listdir('/tmp'), os.listdir('/run'))\n"
        "print(os.path.isdir(os.path.dirname(os.__file__)), os.path.isdir('/usr/bin'))"
    )
    hidden, kept = pool.run(code).stdout.splitlines()
    exists, in_tmp, in_run = hidden.split(" ", 1)[0], *hidden.split(" ", 1)[1].rsplit(" ", 1)
    # this file, other temp files, sockets: only the pool's folder and the interpreter's
    assert exists == "False" and in_run == "[]"
    assert sorted(ast.literal_eval(in_tmp)) == _tmp_in_sight(pool)
    assert kept == "True True"


def test_a_user_namespace_of_its_own_changes_nothing(pool):
    """Root of a new user namespace cannot lift the covers, remount or fork."""
    _enforced(pool, "filesystem")
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "if libc.unshare(0x10000000 | 0x20000) != 0:  # CLONE_NEWUSER | CLONE_NEWNS\n"
        "    raise SystemExit('refused')\n"
        "print([libc.umount2(p, 2) for p in (b'/tmp', b'/work', b'/root')], os.listdir('/tmp'))\n"
        "print(libc.mount(None, b'/tmp', None, ctypes.c_ulong(32 | 4096), None))  # rw remount\n"
        "os.fork()"
    )
    r = pool.run(code)
    if r.stderr == "refused\n":
        pytest.skip("this kernel refuses unprivileged user namespaces")
    umounts, rest = r.stdout.split("] ", 1)
    in_tmp, remount = rest.rsplit("\n", 2)[:2]
    assert umounts == "[-1, -1, -1" and remount == "-1"
    assert sorted(ast.literal_eval(in_tmp)) == _tmp_in_sight(pool)
    assert "BlockingIOError" in r.stderr


def test_the_environment_is_minimal(monkeypatch):
    monkeypatch.setenv("RLTRAIN_SANDBOX_SECRET", "do-not-leak")
    with SandboxPool(size=1) as fresh:  # started after the secret was set
        r = fresh.run("import json, os\nprint(json.dumps([dict(os.environ), os.getcwd()]))")
    env, cwd = json.loads(r.stdout)
    assert "do-not-leak" not in r.stdout
    assert env == {**MINIMAL_ENV, "HOME": cwd, "TMPDIR": cwd}


def test_the_network_namespace_has_only_lo(pool):
    _enforced(pool, "network")
    code = (
        "import os\n"
        "rows = open('/proc/net/dev').read().splitlines()[2:]\n"
        "print(sorted(r.split(':')[0].strip() for r in rows), sorted(os.listdir('/sys/class/net')))"
    )
    proc_net, sys_net = pool.run(code).stdout.split(" ", 1)
    assert proc_net == "['lo']"  # what a socket of the code can use
    if not pool.isolation["filesystem"].startswith("not isolated"):  # sysfs mounted afresh
        assert sys_net == "['lo']\n"


def test_the_trainers_loopback_port_is_out_of_reach(pool):
    _enforced(pool, "network")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        code = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    print('connected')\n"
            "except OSError as e:\n"
            "    print(type(e).__name__, e.errno)"
        )
        r = pool.run(code, timeout_s=5)
        assert r.exit_code == 0 and r.stdout.split()[0] in {
            "ConnectionRefusedError",
            "OSError",  # ENETUNREACH: the namespace's lo is down
        }, r.stdout
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing ever connected


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_an_output_flood_is_truncated_and_stopped(pool, stream):
    code = f"import sys\nwhile True: print('x' * 1000, file=sys.{stream})"
    r = pool.run(code, timeout_s=5, max_output_bytes=5000)
    assert r.truncated and not r.timed_out and r.exit_code == -signal.SIGKILL
    assert getattr(r, stream) == ("x" * 1000 + "\n") * 4 + "x" * 996  # the first 5000 bytes
    assert r.seconds < 5  # stopped at the limit, not at the deadline
    assert r.error == f"{stream} reached max_output_bytes=5000; output truncated, process stopped"


def test_output_under_the_limit_is_whole(pool):
    r = pool.run("print('y' * 5000, end='')", max_output_bytes=5000)
    assert r.stdout == "y" * 5000 and not r.truncated and r.ok


def test_signalling_the_parent_or_the_trainer_fails(pool):
    _enforced(pool, "uid")  # without these the code could signal the trainer's processes
    _enforced(pool, "pid")
    code = (
        "import os\n"
        f"for pid in (os.getppid(), {os.getpid()}, 1):\n"
        "    try:\n"
        "        os.kill(pid, 9)\n"
        "        print('killed', pid)\n"
        "    except OSError as e:\n"
        "        print(type(e).__name__)"
    )
    r = pool.run(code)
    assert r.exit_code == 0 and "killed" not in r.stdout, r.stdout
    os.kill(pool.server_pid, 0)  # the server lives on (the test process obviously does)
    assert pool.run("print('still here')").stdout == "still here\n"


def test_os_exit_keeps_its_code_and_output(pool):
    r = pool.run("import os\nprint('before', end='')\nos._exit(7)")
    assert (r.exit_code, r.stdout, r.error) == (7, "before", "exited with code 7")


def test_an_interpreter_crash_is_reported(pool):
    r = pool.run("import ctypes\nctypes.string_at(0)")
    assert r.exit_code == -signal.SIGSEGV and not r.timed_out
    assert r.error == "killed by SIGSEGV (the interpreter crashed)"


def test_errors_show_the_codes_own_traceback(pool):
    r = pool.run("x = 1\ny = x / 0")
    assert r.exit_code == 1 and r.error == "exited with code 1: ZeroDivisionError: division by zero"
    assert 'File "<sandbox>", line 2' in r.stderr and "y = x / 0" in r.stderr
    assert "sandbox_server" not in r.stderr
    bad = pool.run("print(")
    assert bad.exit_code == 1 and "SyntaxError" in bad.error
    assert pool.run("raise SystemExit(3)").exit_code == 3
    assert pool.run("import sys\nsys.exit('bye')").stderr == "bye\n"


def test_no_state_leaks_between_calls(pool):
    code = "import math\nprint(getattr(math, 'leak', None), 'g' in globals())\nmath.leak = g = 1"
    assert [pool.run(code).stdout for _ in range(3)] == ["None False\n"] * 3


def test_large_code_is_delivered(pool):
    code = "total = 0\n" + "total += 1\n" * 20000 + "print(total)"  # ~220 kB, > a pipe
    assert pool.run(code, timeout_s=10).stdout == "20000\n"


def test_concurrent_calls_from_threads(pool):
    results: dict[tuple[int, int], str] = {}

    def caller(i: int) -> None:
        for j in range(10):
            results[i, j] = pool.run(f"print({i} * {j})").stdout

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {(i, j): f"{i * j}\n" for i in range(8) for j in range(10)}


def test_each_calls_folder_is_deleted(pool):
    code = "import os\nopen('f', 'w').write('x' * 1000)\nos.mkdir('d')\nprint(os.getcwd())"
    folders = [pool.run(code).stdout.strip() for _ in range(3)]
    folders.append(pool.run("import os\nprint(os.getcwd(), flush=True)\nwhile 1: pass", 0.3).stdout)
    assert len(set(folders)) == 4 and all(f.startswith(pool.calls_folder) for f in folders)
    assert not any(os.path.exists(f.strip()) for f in folders)


def test_close_deletes_the_pools_folder_and_closes_its_pipes():
    pattern = os.path.join(tempfile.gettempdir(), "rltrain-sandbox-*")
    before, fds = set(glob.glob(pattern)), len(os.listdir("/proc/self/fd"))
    p = SandboxPool(size=3)
    assert [p.run("print(1)", timeout_s=1).stdout for _ in range(4)] == ["1\n"] * 4
    assert p.run("while True: pass", timeout_s=0.2).timed_out
    assert len(set(glob.glob(pattern)) - before) == 1
    p.close()
    assert set(glob.glob(pattern)) == before
    assert len(os.listdir("/proc/self/fd")) == fds  # idle workers' pipe ends included
    with pytest.raises(RuntimeError, match="closed"):
        p.run("print(1)")


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_the_pool_refills_after_killed_workers(pool):
    for _ in range(5):  # more than the pool holds: each one is replaced
        r = pool.run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
        assert r.exit_code == -signal.SIGKILL and r.error == "killed by SIGKILL"
    server = pool.server_pid
    workers = [w for c in _children(server) for w in _children(c)] or _children(server)
    assert workers
    for w in workers:  # idle workers killed from outside
        os.kill(w, signal.SIGKILL)
    # wait for the event, not a time: the server has reaped every killed worker
    parents = _children(server) or [server]
    deadline = time.monotonic() + 60
    while any(w in _children(p) for p in parents for w in workers):
        assert time.monotonic() < deadline, "the sandbox server did not reap its killed workers"
        time.sleep(0.01)
    assert [pool.run(f"print({i})").stdout for i in range(6)] == [f"{i}\n" for i in range(6)]


def test_a_dead_server_is_replaced():
    with SandboxPool(size=1) as p:
        assert p.run("print(1)").stdout == "1\n"
        first = p.server_pid
        os.kill(first, signal.SIGKILL)
        stopped = "the sandbox server stopped before the code ended (it was restarted)"
        results = [p.run("print(2)") for _ in range(3)]  # the first may race the old server's end
        assert all(r.stdout == "2\n" or r.error == stopped for r in results)
        assert results[-1].stdout == "2\n" and p.server_pid != first


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"timeout_s": 0}, "timeout_s=0 must be a positive number"),
        ({"timeout_s": -1.5}, "timeout_s=-1.5"),
        ({"timeout_s": math.nan}, "timeout_s=nan"),
        ({"memory_mb": 0}, "memory_mb=0 must be a positive number; pass MiB"),
        ({"memory_mb": 1.5}, "memory_mb=1.5 must be a whole number"),
        ({"max_output_bytes": -1}, "max_output_bytes=-1 must be a positive number"),
        ({"max_output_bytes": True}, "max_output_bytes=True"),
    ],
)
def test_bad_limits_name_the_argument(pool, kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        pool.run("print(1)", **kwargs)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        run_python("print(1)", **kwargs)


def test_code_must_be_text(pool):
    with pytest.raises(TypeError, match="code must be a str"):
        pool.run(b"print(1)")  # type: ignore[arg-type]
