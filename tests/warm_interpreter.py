"""A warm Python with Triton's interpreter, for tests/common.py `run_interpreted`.

The interpreter is chosen when a Triton kernel is defined, so each interpreted check runs
outside the test process, where TRITON_INTERPRET=1 was set before anything was imported.
Started afresh each time, such a child spent about 1.4 s importing torch and Triton, a
dozen times a run. This process (run as a script) imports them once and forks one child
per check, which runs `python -c CODE ARGS...` or `python -m MODULE ARGS...` as a fresh
interpreter would: its own environment, working directory, argv, sys.path[0] and __main__,
stdin empty, stdout and stderr in files, atexit handlers run, its exit code reported
(tests/test_warm_interpreter.py). What torch and Triton read from the environment as they
are imported comes from the warm process's, the test process's environment when the first
check started it. Nothing runs a torch op before the fork, so a child inherits no thread
pool (a forked child with live OpenMP threads can hang: tests/harness.py).

Protocol, one JSON object a line: the test process writes {"args", "cwd", "env", "out",
"err"}; this process answers {"pid": ...} once the child is forked and {"code": ...} when it
has ended (negative: the signal that ended it). It leaves when its stdin closes.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _child(request: dict) -> None:
    """Become `python ARGS` for one request; never returns."""
    import builtins
    import runpy
    import traceback
    import types

    code = 1
    try:
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        for fd, path in ((1, request["out"]), (2, request["err"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        args = request["args"]
        try:
            if args[0] == "-c":
                sys.argv = ["-c", *args[2:]]
                sys.path[0] = ""  # what `python -c` puts first
                main = types.ModuleType("__main__")
                main.__builtins__ = builtins
                sys.modules["__main__"] = main
                exec(compile(args[1], "<string>", "exec"), main.__dict__)
            elif args[0] == "-m":
                sys.argv = [args[1], *args[2:]]  # runpy puts the module's file first
                sys.path[0] = os.getcwd()  # what `python -m` puts first
                runpy.run_module(args[1], run_name="__main__", alter_sys=True)
            else:
                raise ValueError(f"run_interpreted takes -c CODE or -m MODULE, not {args[0]!r}")
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc)
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _serve() -> None:
    import torch  # noqa: F401  (the bulk of every child's start)
    import triton  # noqa: F401
    import triton.language  # noqa: F401

    def answer(message: dict) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    for line in sys.stdin:
        request = json.loads(line)
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        answer({"pid": pid})
        _, status = os.waitpid(pid, 0)
        answer({"code": os.waitstatus_to_exitcode(status)})


class _Warm:
    """The test process's side: one warm process, started at the first request."""

    def __init__(self):
        self.log = tempfile.TemporaryFile("w+b")  # the warm process's own stderr
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env)
        self.buffer = b""
        atexit.register(self.close)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _answer(self, deadline: float | None) -> dict:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                self.log.seek(0)
                raise RuntimeError("the warm interpreter ended: "
                                   + self.log.read().decode(errors="replace")[-3000:])
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def run(self, args: list[str], env: dict, cwd: str, timeout: float) -> tuple[int, str, str]:
        with tempfile.TemporaryDirectory() as tmp:
            out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
            request = {"args": args, "cwd": cwd, "env": env, "out": out, "err": err}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            pid = self._answer(None)["pid"]
            try:
                code = self._answer(time.monotonic() + timeout)["code"]
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                self._answer(None)
                raise subprocess.TimeoutExpired([sys.executable, *args], timeout) from None
            with open(out) as f_out, open(err) as f_err:
                return code, f_out.read(), f_err.read()


_WARM: list[_Warm] = []


def run(args: list[str], env: dict, cwd: str, timeout: float) -> tuple[int, str, str]:
    """`python ARGS` in `env` and `cwd`, forked from the warm process: (exit code, stdout,
    stderr). Where os.fork is missing, a fresh process."""
    if not hasattr(os, "fork"):
        proc = subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True,
                              text=True, timeout=timeout)
        return proc.returncode, proc.stdout, proc.stderr
    if not _WARM or not _WARM[0].alive():
        _WARM[:] = [_Warm()]
    return _WARM[0].run(args, env, cwd, timeout)


if __name__ == "__main__":
    _serve()
