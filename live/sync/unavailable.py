"""A clock that cannot be followed on this machine (a package or a JACK server missing), and its fix worded for
whoever asked: the CLI (`--sync link`, `pip install aalink`) or a ComfyUI Stream node (its `sync` widget, the package
installed into ComfyUI's Python). Every clock adapter raises this; `worded(caller)` is the one place the two differ."""

from __future__ import annotations

CLI, COMFYUI = "cli", "comfyui"

ASKED = {  # a clock -> how each caller asks to follow it
    "link": {CLI: "--sync link", COMFYUI: "sync 'link'"},
    "jack": {CLI: "--sync jack", COMFYUI: "sync 'jack'"},
    "midi": {CLI: "--sync midi --midi-backend jack", COMFYUI: "sync 'midi (JACK)'"},
}
JACK_SERVER = "a running JACK server"
START_JACK = "start jackd (or PipeWire's JACK)"


class ClockUnavailable(RuntimeError):
    """`clock` (link | jack | midi) needs `needs` here: the Python `package` to install, or else the `action` to take.
    str() is the CLI's wording; `worded(COMFYUI)` the Stream node's."""

    def __init__(self, clock: str, needs: str, package: str | None = None, action: str = ""):
        self.clock, self.needs, self.package, self.action = clock, needs, package, action
        super().__init__(self.worded(CLI))

    def worded(self, caller: str) -> str:
        if self.package is None:
            fix = self.action + (", then queue the graph again" if caller == COMFYUI else "")
        elif caller == COMFYUI:
            fix = (
                f"install it into ComfyUI's Python (python -m pip install {self.package}, run with the Python that "
                "runs ComfyUI), then restart ComfyUI"
            )
        else:
            fix = f"pip install {self.package}"
        return f"{ASKED[self.clock][caller]} needs {self.needs}: {fix}"
