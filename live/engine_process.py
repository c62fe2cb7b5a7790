"""`flowjam live --plugin` run as a process of its own (the plugin bench's engine, the DAW tests'): its status lines
are read as they come, for the generations it finished, its sessions and its panel's URL."""

from __future__ import annotations

import re
import subprocess
import threading
import time


class EngineProcess:
    """An engine started from `command` (with `env`, None: this process's); `restart()` starts it again."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None):
        self.command, self.env = command, env
        self.restart()

    def restart(self, *flags: str) -> None:
        """Start the engine (again, after kill()) with the same command, and `flags` after it this time (a later
        flag wins)."""
        self.process = subprocess.Popen(
            [*self.command, *flags], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=self.env
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, args=(self.process, self.lines), daemon=True).start()

    @staticmethod
    def _read(process: subprocess.Popen, lines: list[str]) -> None:
        for line in process.stderr:
            lines.append(line)

    def latents(self) -> int:
        """Generations finished so far (from the newest status line)."""
        for line in reversed(self.lines):
            found = re.search(r"latents (\d+)", line)
            if found:
                return int(found.group(1))
        return 0

    def sessions(self) -> dict[str, int]:
        """The sessions on the engine's ring and the generations each finished (from the newest status line)."""
        for line in reversed(self.lines):
            found = re.search(r"sessions \d+ on one ring: (.*)$", line.strip())
            if found:
                pairs = (re.fullmatch(r"(\S+) latents (\d+)", part) for part in found.group(1).split(", "))
                return {pair.group(1): int(pair.group(2)) for pair in pairs if pair}
        return {}

    def panel_url(self) -> str:
        """The panel's URL as the engine printed it at its start (a new one after each restart)."""
        for line in list(self.lines):
            found = re.search(r"flowjam panel .*: (http://127\.0\.0\.1:\d+/[\w-]+/)$", line.strip())
            if found:
                return found.group(1)
        raise RuntimeError("the engine printed no panel URL:\n" + "".join(self.lines[:20]))

    def wait_ready(self, latents: int = 2, timeout_s: float = 300.0) -> None:
        """Until the loop is made (its first generations written); RuntimeError when the engine exits or is late."""
        deadline = time.monotonic() + timeout_s
        while self.latents() < latents:
            if self.process.poll() is not None:
                raise RuntimeError("the engine exited:\n" + "".join(self.lines[-30:]))
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine made no loop within {timeout_s:g} s:\n" + "".join(self.lines[-10:]))
            time.sleep(0.1)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
