"""Several plugin instances (several DAW tracks) are several sessions of one engine: `flowjam live --plugin` on the tiny
preset serves every instance a session of its own, each a lane of its one ring. Two instances in one host (our CLAP
host, and DawDreamer's VST3) get two sessions, each plays its own loop and knobs, a removed instance's session ends
after the grace period, and a project saved and opened again in another process gives each instance its session
back, which the engine makes again from the saved prompt. The ring itself does not change a session's latents: a
session with another on its ring makes, bit for bit from its second generation on, the latents it makes alone (its
audio cannot be compared so: the writer patches it at times, and so places, that differ from run to run)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from daw_host import BAR_FRAMES, Engine, plugin_for_session, saved_state
from flowjam.engine.params import KNOB_SPECS
from flowjam.engine.session import Session
from flowjam.live.plugin_link import ControlBlock
from flowjam.live.plugin_sessions import GRACE_S, pick_session
from helpers import track_latents, wait_for
from plugin_build import build

PRIMARY = f"tracks-{os.getpid()}"  # the engine's --session: the first instance's; the second gets PRIMARY-2
SEED, BLEND = (next(i for i, spec in enumerate(KNOB_SPECS) if spec.name == name) for name in ("seed", "prompt_blend"))


def test_a_new_instance_gets_a_session_no_live_instance_holds_and_a_named_one_its_own():
    assert pick_session("", "default", set(), set()) == "default"
    assert pick_session("", "default", {"default"}, {"default"}) == "track-2"
    assert pick_session("", "default", {"default", "track-3"}, {"track-2"}) == "track-4", "track-2 ends: not reused"
    assert pick_session("", "jam", {"jam"}, set()) == "jam-2"
    assert pick_session("track-2", "default", {"track-2"}, {"track-2"}) == "track-2", "a project's name as it is"


def test_a_session_on_a_shared_ring_makes_the_latents_it_makes_alone(one_torch_thread):
    """(First in the module: beside a running engine's process this takes minutes on a 2-core machine.)
    Bit for bit from its second generation on. The first differs by at most 1e-6: its first tick alone is a batch
    of one row (the first slot), beside another session one of two, and on a CPU a one-row product is a matrix-vector
    kernel that rounds otherwise than the matrix-matrix one (the lane's later ticks batch several slots either way)."""
    session = Session.load(None, preset="tiny")
    loop_samples = round(2 * BAR_FRAMES)

    def latents(prompts: tuple[str, ...]) -> dict[int, torch.Tensor]:
        return track_latents(session, prompts, loop_samples, ticks=22)[0]

    alone, shared = latents(("ambient pads",)), latents(("ambient pads", "solo piano"))
    assert len(alone) > 3 and alone.keys() == shared.keys(), "as many generations alone as on the shared ring"
    first = float((alone[1] - shared[1]).abs().max())
    assert first <= 1e-6, f"the first generation differs by {first:.3g} on the shared ring"
    differing = [
        generation for generation in alone if generation > 1 and not alone[generation].equal(shared[generation])
    ]
    assert not differing, f"generations the shared ring changed: {differing} of {len(alone)}"
    assert not alone[len(alone)].equal(latents(("solo piano",))[len(alone)]), "another prompt makes another loop"


@pytest.fixture(scope="module")
def own_lobby():
    """A lobby of this module's own: plugin instances that other modules' tests left alive in this process (a
    DawDreamer host is freed when Python collects it) ask their old lobby, never this module's engine."""
    before = os.environ.get("FLOWJAM_LOBBY")
    os.environ["FLOWJAM_LOBBY"] = f"flowjam-lobby-tracks-{os.getpid()}"
    yield
    if before is None:
        os.environ.pop("FLOWJAM_LOBBY")
    else:
        os.environ["FLOWJAM_LOBBY"] = before


@pytest.fixture(scope="module")
def engine(own_lobby):
    build()
    started = Engine(PRIMARY, "--bpm", "123", "--bars", "2", "--prompt", "ambient pads", "--prompt-b", "solo piano")
    try:
        started.wait_ready()
        yield started
    finally:
        started.stop()


def control_block(session: str) -> ControlBlock | None:
    """The session's control block, or None where the engine has none (ended, or not whole yet: being made)."""
    try:
        return ControlBlock(session, create=False)
    except (FileNotFoundError, ValueError):
        return None


def wait_ended(engine: Engine, session: str) -> None:
    """Until the engine has ended `session` (its control block gone, its lane off the ring)."""
    wait_for(lambda: control_block(session) is None, GRACE_S + 20, f"session {session} ended", poll_s=0.2)
    wait_for(lambda: session not in engine.sessions(), 5, f"session {session} off the ring", poll_s=0.2)


def test_two_instances_in_one_host_play_two_sessions_of_one_ring_with_their_own_knobs(engine, tmp_path):
    folder = build()
    rendered = tmp_path / "track.f32"
    subprocess.run(
        [str(folder / "clap_render"), str(folder / "flowjam.clap"), str(rendered), "123", "4", "--instances", "2"]
        + ["--wait", "8", "--set", "1:prompt_blend=1", "--set", "1:seed=7"],
        check=True,
        env={key: value for key, value in os.environ.items() if key != "FLOWJAM_SESSION"},
        timeout=180,
    )
    played = [np.fromfile(path, np.float32).reshape(-1, 2)[:, 0] for path in (rendered, Path(f"{rendered}.1"))]
    second = f"{PRIMARY}-2"
    assert set(engine.sessions()) == {PRIMARY, second}, f"two sessions on the ring: {engine.lines[-1]}"
    blocks = {name: control_block(name) for name in (PRIMARY, second)}
    try:
        knobs = {name: (block.engine_values[SEED], block.engine_values[BLEND]) for name, block in blocks.items()}
    finally:
        for block in blocks.values():
            block.close()
    # which instance's ask the lobby answered first (and so which took the --session session) is the threads' race
    assert sorted(knobs.values()) == [(7, 1.0), (42, 0.0)], f"each instance's knobs reach its own session: {knobs}"

    loop = slice(round(2 * BAR_FRAMES), round(4 * BAR_FRAMES))  # the second cycle of the 2-bar loop
    rms = [float(np.sqrt(np.mean(audio[loop] ** 2))) for audio in played]
    assert min(rms) > 1e-2, f"both tracks play their loops (rms {rms})"
    apart = float(np.sqrt(np.mean((played[0][loop] - played[1][loop]) ** 2)))
    assert apart > 0.5 * min(rms), f"the tracks play different loops (rms {rms}, of their difference {apart:.3g})"

    wait_ended(engine, second)  # both instances went with the host: the second session ends, the first plays on
    assert control_block(PRIMARY) is not None, "the --session session plays until the engine stops"


SAVE_TWO_TRACKS = """
import sys, pathlib, time
import dawdreamer
from daw_host import dpf_state, load_state, plugin_for_session, saved_state
folder = pathlib.Path(sys.argv[2])
tracks = []
for index, prompt in enumerate(sys.argv[3:]):
    state = folder / f"track-{index}"
    host, plugin = plugin_for_session(dawdreamer, sys.argv[1], "", state)  # a new instance: no session of its own
    tracks.append((host, plugin, state, prompt))
deadline = time.monotonic() + 120
for host, plugin, state, prompt in tracks:
    while True:  # the engine's lobby names the instance's session, which the project then saves
        host.render(0.2)
        plugin.save_state(str(state))
        if saved_state(state, "session") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    dpf_state(state, prompt=prompt)
    load_state(plugin, state)
    host.render(0.2)
time.sleep(1.0)  # the engine takes the prompts, and gives them back to the instances
for host, plugin, state, prompt in tracks:
    plugin.save_state(str(state))
"""


def test_a_project_of_two_tracks_opened_again_in_another_process_gets_each_its_session_back(engine, tmp_path):
    vst3 = build() / "flowjam.vst3"
    prompts = ("lofi hip hop", "solo piano")
    tests = Path(__file__).parent
    subprocess.run(
        [sys.executable, "-c", SAVE_TWO_TRACKS, str(vst3), str(tmp_path), *prompts],
        check=True,
        cwd=tests,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])},
        timeout=300,
    )
    states = [tmp_path / f"track-{index}" for index in range(2)]
    names = [saved_state(state, "session") for state in states]
    assert sorted(names) == sorted([PRIMARY, f"{PRIMARY}-2"]), f"each track saved its own session: {names}"
    assert [saved_state(state, "prompt") for state in states] == list(prompts)
    second = f"{PRIMARY}-2"
    wait_ended(engine, second)  # the project closed: its second session ends after the grace period

    daw = pytest.importorskip("dawdreamer", reason="DawDreamer (pip install 'flowjam[test]') hosts the VST3")
    opened = [plugin_for_session(daw, vst3, "", state) for state in states]  # the saved states name the sessions
    for host, _ in opened:
        host.render(0.2)

    def playing() -> list[str | None]:
        """Each saved session's prompt A as the engine plays it (None: no such session)."""
        found = []
        for name in names:
            block = control_block(name)
            found.append(None if block is None else (block.engine_prompts() or {}).get("a"))
            if block is not None:
                block.close()
        return found

    deadline = time.monotonic() + 120  # making a session takes seconds, up to ~15 s on a loaded 2-core machine
    while playing() != list(prompts) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert playing() == list(prompts), f"each session made again with its saved prompt: {engine.lines[-1]}"
    wait_for(lambda: set(engine.sessions()) == {PRIMARY, second}, 5, "both sessions on the ring", poll_s=0.2)
    for (_, plugin), state, name in zip(opened, states, names, strict=True):
        plugin.save_state(str(state))
        assert saved_state(state, "session") == name, "the instance keeps its session's name"
