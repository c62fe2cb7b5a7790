"""A client that takes a few chunks (acknowledging them), stalls, then drains to the live audio: what waited for it
and what was dropped, for the flow-control tests (tests/test_serve_flow.py, tests/test_serve_ray.py)."""

import time
from dataclasses import dataclass

from flowjam.serve.client import Client
from flowjam.serve.host import BLOCK_FRAMES
from flowjam.serve.protocol import SAMPLE_RATE


@dataclass(frozen=True)
class Stall:
    waited_s: float  # audio that had waited for the stalled client (taken before the jump to live)
    skipped_chunks: int  # chunks between the backlog and the live audio, never sent
    counted_dropped: int  # what the chunk headers say was dropped across that jump


def stall_and_drain(client: Client, session: str, stall_s: float, taken_first: int = 12) -> Stall:
    with client.stream(session) as stream:

        def take():
            while True:
                item = stream.receive(30.0)
                if item is None:
                    raise AssertionError(f"the stream closed (code {stream.close_code})")
                if not isinstance(item, dict):
                    return item

        before = [take() for _ in range(taken_first)]
        time.sleep(stall_s)
        playhead = client.status(session)["sample"]
        taken = [take()]
        deadline = time.monotonic() + 20
        while taken[-1].sample < playhead - BLOCK_FRAMES:
            assert time.monotonic() < deadline, "the client never caught up with the live audio"
            taken.append(take())
    jumps = [i for i in range(1, len(taken)) if taken[i].sample - taken[i - 1].sample > BLOCK_FRAMES]
    if not jumps:
        return Stall((taken[-1].sample + BLOCK_FRAMES - before[-1].sample) / SAMPLE_RATE, 0, 0)
    jump = jumps[0]
    return Stall(
        (taken[jump - 1].sample + BLOCK_FRAMES - before[-1].sample) / SAMPLE_RATE,
        (taken[jump].sample - taken[jump - 1].sample) // BLOCK_FRAMES - 1,
        taken[jump].dropped - taken[jump - 1].dropped,
    )
