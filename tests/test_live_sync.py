"""The live app on a musical grid and following JACK transport: a loop of whole bars (not whole latent frames) with
the tempo and metre in its prompts' metas, OSC `sync` and the tempo fed back to controllers, and a transport tempo
change that makes the loop again at the new tempo and switches to it."""

import json
import socket

import jack
import pytest
import soundfile
from flowjam.live.app import LiveApp, LiveConfig
from flowjam.live.sync.band import TimebaseMaster
from flowjam.live.sync.grid import Grid
from helpers import wait_for
from pythonosc.osc_message import OscMessage
from pythonosc.udp_client import SimpleUDPClient

SR = 48_000


def test_a_loop_of_whole_bars_plays_with_the_tempo_in_its_metas(session):
    app = LiveApp(
        session,
        LiveConfig(prompt="grid check", bpm=123.0, bars=1, click=True, playback_mode="null", osc_port=None),
    )
    try:
        assert app.buffer.frames == Grid(123.0).loop_samples(1, SR) == 93_659  # 48.8 latent frames
        assert app.runner.frames == 49
        metas = session.encode_text("grid check", bpm=123, time_signature=4).encoder_hidden_states
        plain = session.encode_text("grid check").encoder_hidden_states
        playing = app.runner._prompts["a"].encoder_hidden_states
        assert playing.equal(metas) and not playing.equal(plain), "the caption's metas carry the grid"
        app.start()
        wait_for(lambda: app.runner.stats.writes >= 5 and app.buffer.played_frames > 2 * SR, 60, "two seconds")
        status = app.status()
        assert status["bpm"] == 123.0 and status["bars"] == 1 and status["bar_beat"].startswith("1.")
        assert status["errors"] == 0 and status["underruns"] == 0
    finally:
        app.stop()


@pytest.fixture
def master(jack_server):
    client = jack.Client("fj-test-master", no_start_server=True)
    timebase = TimebaseMaster(client, 120.0, 4)
    client.activate()
    client.transport_frame = 0
    yield timebase
    client.transport_stop()
    client.deactivate()
    client.close()


def test_jack_transport_sets_the_tempo_and_a_tempo_change_makes_the_loop_again(session, master):
    feedback = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    feedback.bind(("127.0.0.1", 0))
    feedback.settimeout(0.2)
    app = LiveApp(
        session,
        LiveConfig(
            prompt="transport check",
            sync="jack",
            bars=1,
            playback_mode="null",
            osc_port=0,
            osc_feedback=feedback.getsockname(),
        ),
    )
    heard: list[tuple[str, list]] = []

    def listen(what: str) -> bool:
        try:
            message = OscMessage(feedback.recv(65536))
            heard.append((message.address, message.params))
        except TimeoutError:
            pass
        return any(address.endswith(what) for address, _ in heard)

    try:
        assert app.grid.bpm == 120.0 and app.buffer.frames == 2 * SR, "the tempo is the transport's"
        app.start()
        wait_for(lambda: app.runner.stats.writes > 0, 60, "the first write")
        assert not app.buffer.playing, "silent until the transport rolls"
        master.client.transport_start()
        wait_for(lambda: app.buffer.playing, 10, "the start on the transport's next bar line")
        client = SimpleUDPClient("127.0.0.1", app.osc.address[1])
        client.send_message("/flowjam/default/sync", [])
        wait_for(lambda: listen("/sync"), 10, "the sync reply")
        sync = json.loads(next(params[0] for address, params in heard if address.endswith("/sync")))
        assert sync["sync"]["source"] == "jack" and sync["sync"]["clock_bpm"] == 120.0 and sync["bars"] == 1
        old_runner = app.runner
        master.change_tempo_at_next_bar(96.0)
        wait_for(lambda: listen("/tempo") and any(p == [96.0] for a, p in heard if a.endswith("/tempo")), 10, "tempo")
        wait_for(lambda: app.following.tempo_switch.switches == 1, 60, "the loop at the new tempo")
        assert app.runner is not old_runner and not old_runner.alive
        assert app.grid.bpm == 96.0 and app.buffer.frames == Grid(96.0).loop_samples(1, SR)
        assert app.runner.config.bpm == 96, "the new loop's prompts carry the new tempo"
        assert app.status()["errors"] == 0 and app.buffer.gaps == 0
    finally:
        app.stop()
        feedback.close()


def test_a_cover_on_the_grid_loops_whole_bars_of_the_source_from_its_first_downbeat(session, tmp_path):
    pytest.importorskip("librosa", reason="librosa is not installed (pip install 'flowjam[grid]')")
    from test_source_grid import drum_track

    path = tmp_path / "drums.wav"
    soundfile.write(path, drum_track(97.0, 4, 0.37, 12.0).T, SR)
    app = LiveApp(
        session,
        LiveConfig(prompt="cover on the grid", source=path, bpm=123.0, bars=2, playback_mode="null", osc_port=None),
    )
    try:
        assert app.source_grid.bpm == pytest.approx(97.0, abs=0.5)
        assert app.source_grid.downbeat_s == pytest.approx(0.37, abs=0.02)
        assert app.grid.bpm == 123.0 and app.bars == 2
        assert app.buffer.frames == Grid(123.0).loop_samples(2, SR) == 187_317
        assert app.runner.frames == app.runner.current_source.frames == 98
        assert app.runner.loop_map.seam == "loop", "a cover's latent repeats the loop's start past its end"
        app.start()
        wait_for(lambda: app.runner.stats.writes >= 3, 60, "three writes")
        assert app.status()["errors"] == 0
    finally:
        app.stop()
    own = LiveApp(
        session,
        LiveConfig(
            prompt="its own tempo",
            source=path,
            source_bpm=97.0,
            source_downbeat_s=0.37,
            osc_port=None,
            playback_mode="null",
        ),
    )
    try:  # its own tempo and downbeat from the flags, no estimate: every whole bar after the downbeat
        assert own.grid.bpm == 97.0 and own.bars == 4 and own.buffer.frames == Grid(97.0).loop_samples(4, SR)
    finally:
        own.stop()
