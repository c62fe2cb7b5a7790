"""Run many `python -m flowjam ARGS` commands at the cost of one start-up: this script imports torch and flowjam's
command modules once, then runs each command in a forked child as a fresh process would run it (`python -m flowjam`
through runpy, its own stdout, stderr and exit status, its atexit handlers at exit). Whatever the imports printed on
stderr is put before each command's own stderr, so a test that wants one line on stderr still sees it.

Reads a JSON list of {"argv": [...], "stdout": path, "stderr": path} on stdin; writes a JSON list of exit statuses
(None: killed after the timeout) on stdout. `python tests/cli_forks.py JOBS TIMEOUT_S`."""

import importlib
import json
import os
import runpy
import signal
import sys
import tempfile
import time

PRELOAD = (
    "torch",
    *(f"flowjam.cli.{command}" for command in ("bench", "bridge", "demo", "info", "listen", "live", "render", "serve")),
    "flowjam.engine.render",
    "flowjam.engine.session",
    "flowjam.live.app",
    "flowjam.serve.gateway",
)  # not flowjam.__main__: runpy runs it fresh in each child


def preload() -> bytes:
    """Import what the commands import lazily; returns what that wrote on stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            for module in PRELOAD:
                importlib.import_module(module)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        return captured.read()


def start(command: dict, imports_said: bytes) -> int:
    """Fork a child that runs the command and exits with its status; returns the child's pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    for fd, key in ((1, "stdout"), (2, "stderr")):
        target = os.open(command[key], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.write(2, imports_said)
    sys.argv = ["flowjam", *command["argv"]]
    runpy.run_module("flowjam", run_name="__main__", alter_sys=True)
    sys.exit(0)


def status(wait_status: int) -> int:
    return os.waitstatus_to_exitcode(wait_status)


def run_all(commands: list[dict], jobs: int, timeout_s: float) -> list[int | None]:
    imports_said = preload()
    results: list[int | None] = [None] * len(commands)
    running: dict[int, tuple[int, float]] = {}  # pid -> (index, started)
    waiting = list(range(len(commands)))
    while waiting or running:
        while waiting and len(running) < jobs:
            index = waiting.pop(0)
            running[start(commands[index], imports_said)] = (index, time.monotonic())
        for pid, (index, started) in list(running.items()):
            done, wait_status = os.waitpid(pid, os.WNOHANG)
            if done:
                results[index] = status(wait_status)
                del running[pid]
            elif time.monotonic() - started > timeout_s:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                del running[pid]
        time.sleep(0.005)
    return results


if __name__ == "__main__":
    jobs, timeout_s = int(sys.argv[1]), float(sys.argv[2])
    print(json.dumps(run_all(json.load(sys.stdin), jobs, timeout_s)))
