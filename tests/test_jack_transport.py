"""Following JACK transport with a real JACK server: a timebase master written with JACK's own client API (as
Ardour's would be) sets the tempo, the metre and the bar/beat/tick; the follower reads them, play and stop and a
locate included."""

import time

import pytest
from flowjam.live.sync.jack_transport import JackTransportFollower, clock_state
from helpers import jack_timebase_master, wait_for

BPM, BEATS_PER_BAR, TICKS_PER_BEAT = 128.0, 3.0, 1920.0


@pytest.fixture
def timebase_master(jack_server):
    """A JACK client that is the timebase master: bar/beat/tick at 128 BPM in 3/4 from the transport frame."""
    with jack_timebase_master(jack_server, "fj-timebase", BPM, int(BEATS_PER_BAR), TICKS_PER_BEAT) as client:
        yield client


def test_the_follower_reads_tempo_metre_play_stop_and_locate_from_the_timebase_master(timebase_master, jack_server):
    follower = JackTransportFollower("fj-follower", server=jack_server)
    try:
        timebase_master.transport_frame = 0
        wait_for(lambda: follower.state().bpm == BPM, 3, "the master's tempo")
        assert not follower.state().playing and follower.metre() == (BEATS_PER_BAR, 4.0)
        timebase_master.transport_start()
        wait_for(lambda: follower.state().playing, 3, "rolling")
        started = time.monotonic()
        time.sleep(1.0)
        state, elapsed = follower.state(), time.monotonic() - started
        assert state.bpm == BPM and state.playing
        assert state.beats == pytest.approx(elapsed * BPM / 60.0, abs=0.25), state  # within a JACK cycle or two
        timebase_master.transport_stop()
        wait_for(lambda: not follower.state().playing, 3, "stopped")
        timebase_master.transport_frame = int(48_000 * 60.0 / BPM * 7)  # beat 7: bar 3, beat 2 in 3/4
        wait_for(lambda: follower.state().beats == pytest.approx(7.0, abs=1e-3), 3, "the locate")
    finally:
        follower.close()


def test_without_a_timebase_master_there_is_no_tempo():
    state = clock_state(False, {"frame": 1000, "frame_rate": 48000, "usecs": 1})
    assert state.bpm is None and not state.playing and state.beats == 0.0
