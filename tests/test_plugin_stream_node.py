"""The ComfyUI Stream node with audio_device "plugin": its stream's control block and loop buffer are published under
its session_id as `flowjam live --plugin` publishes them, and the CLAP build in the minimal CLAP host
(plugin/tools/clap_render.cpp) renders the node's stream from the host's transport: 8 bars at 123 BPM with every
click within one sample of the host's bar lines, and the loop audible. The node runs in this process as ComfyUI runs
it (its classic class, the tiny preset); Stream stop takes the control block away."""

import os
import subprocess

import numpy as np
import pytest
from daw_host import BAR_FRAMES, click_onset_near
from flowjam.live import performances
from flowjam.live.plugin_link import CONTROL_PREFIX, ENGINE_CLICK, ENGINE_LOOP_BARS, HOST_BLOCKS
from flowjam.nodes.spec import NodeInputError
from helpers import node, stream, text, wait_for
from plugin_build import build

BARS = 8
BPM = 123.0
SESSION = f"comfy-{os.getpid()}"

pytestmark = pytest.mark.usefixtures("stop_streams")


def test_a_stream_node_plays_through_the_daw_plugin_on_the_hosts_bar_lines(model, tmp_path):
    folder = build()  # before the stream starts: the compile has both cores
    conditioning = text(model, "ambient pads", bpm=int(BPM))
    stream(model, conditioning, SESSION, audio_device="plugin", bpm=BPM, bars=2, click=True)
    app = performances.get(SESSION)
    assert app.playback.stats()["device"] == f"DAW plugin (session {SESSION!r})"
    control = app.playback.control  # the engine's side of what the plugin attaches to, by the stream's name
    assert control.name == CONTROL_PREFIX + SESSION and os.path.exists(f"/dev/shm/{control.name}")
    assert control.buffer_name == app.buffer.name
    assert control.counters[ENGINE_LOOP_BARS] == 2 and control.counters[ENGINE_CLICK] == 1
    wait_for(lambda: app.runner.stats.writes >= 2, 180, "the stream's loop")
    rendered = tmp_path / "out.f32"
    subprocess.run(
        [str(folder / "clap_render"), str(folder / "flowjam.clap"), str(rendered), f"{BPM:g}", str(BARS)],
        check=True,
        env={**os.environ, "FLOWJAM_SESSION": SESSION},
        timeout=60,
    )
    assert control.counters[HOST_BLOCKS] > 0, "the plugin rendered no block of this session"
    audio = np.fromfile(rendered, np.float32).reshape(-1, 2)[:, 0]
    assert audio.size >= BARS * BAR_FRAMES
    ideal = np.round(np.arange(BARS) * BAR_FRAMES).astype(int)
    errors = [click_onset_near(audio, int(at)) - int(at) for at in ideal]
    print(f"\nStream node via the CLAP plugin: clicks {errors} samples off the host's bar lines", flush=True)
    assert max(map(abs, errors)) <= 1, f"clicks against the host's bar lines (samples): {errors}"
    assert np.sqrt(np.mean(audio**2)) > 1e-2, "the loop plays"

    node("FlowjamStreamStop").run(stream=SESSION)
    assert not os.path.exists(f"/dev/shm/{CONTROL_PREFIX}{SESSION}"), "Stream stop left the control block behind"
    assert not os.path.exists(f"/dev/shm/{app.buffer.name}"), "Stream stop left the loop buffer behind"


def test_a_plugin_stream_needs_a_session_name_the_plugin_can_attach_by_and_no_clock_of_its_own(model):
    conditioning = text(model, "ambient pads")
    with pytest.raises(NodeInputError) as refused:
        stream(model, conditioning, "my jam", audio_device="plugin")
    assert str(refused.value).startswith("Stream: input 'session_id' with audio_device 'plugin': a plugin session")
    with pytest.raises(NodeInputError) as refused:
        stream(model, conditioning, "plugin_synced", audio_device="plugin", sync="link")
    assert "set sync to off" in str(refused.value)
    assert performances.get("my jam") is None and performances.get("plugin_synced") is None
