"""The OSC datagram parser (live/osc_wire.py) on hostile input: every bundle size field bounded at any nesting, messages
cut short refused at any depth, and a fuzz of random, truncated and corrupted nested datagrams that each parse to
exactly what was sent or are refused with a ValueError, never a hang."""

import random
import struct
import threading
import time
from functools import partial

import pytest
from flowjam.live.osc_wire import MAX_BUNDLE_DEPTH, Bundle, parse
from pythonosc.osc_message_builder import OscMessageBuilder

KNOB = "/flowjam/default/knob/"
NEGATIVE_SIZE_BUNDLE = b"#bundle\0" + bytes(8) + struct.pack(">i", -8) + b"/x\0\0"  # the 24-byte datagram


def finishes(call, timeout_s: float = 5.0):
    """call()'s result, raised error included; fails the test if it does not return within timeout_s (a parser that
    loops forever would otherwise hang the run: the stuck daemon thread is left behind)."""
    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as error:  # noqa: BLE001 - handed back to the test
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        pytest.fail(f"still running after {timeout_s:g} s: the parser loops")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def message(address: str, *args) -> bytes:
    builder = OscMessageBuilder(address)
    for arg in args:
        builder.add_arg(arg)
    return builder.build().dgram


def bundle(*elements: bytes, timetag: bytes = bytes(7) + b"\1") -> bytes:
    return b"#bundle\0" + timetag + b"".join(struct.pack(">i", len(e)) + e for e in elements)


def flattened(packet) -> list[tuple[str, list]]:
    """(address, params) of every message in a parsed packet, depth first."""
    if isinstance(packet, Bundle):
        return [m for content in packet.contents for m in flattened(content)]
    return [(packet.address, packet.params)]


def test_a_negative_bundle_element_size_is_refused_not_looped_on():
    with pytest.raises(ValueError, match="size -8"):
        finishes(lambda: parse(NEGATIVE_SIZE_BUNDLE))


@pytest.mark.parametrize("size", [-4, 0, 6, 1 << 30])
def test_every_bundle_element_size_is_bounded_at_any_nesting(size):
    inner = b"#bundle\0" + bytes(8) + struct.pack(">i", size) + message("/x", 1.0)
    for _ in range(3):
        with pytest.raises(ValueError, match=f"size {size}"):
            finishes(partial(parse, inner))
        inner = bundle(inner)


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
def test_a_message_cut_before_its_float_is_refused_at_any_depth(depth):
    cut = message(KNOB + "volume", 0.5)[:-4]
    packet = cut
    for _ in range(depth):
        packet = bundle(packet)
    with pytest.raises(ValueError, match="truncated"):
        parse(packet)


def test_bundles_nested_past_the_limit_are_refused():
    packet = message(KNOB + "volume", 0.5)
    for _ in range(MAX_BUNDLE_DEPTH):
        packet = bundle(packet)
    assert flattened(parse(packet)) == [(KNOB + "volume", [0.5])]
    with pytest.raises(ValueError, match="nested"):
        parse(bundle(packet))


def random_packet(rng: random.Random, depth: int) -> tuple[bytes, list[tuple[str, list]]]:
    """A valid message or nested bundle, and the messages it holds."""
    if depth >= 3 or rng.random() < 0.4:
        address = KNOB + rng.choice(["volume", "guidance", "denoise"])
        args = rng.choice([[], [0.25], [7], ["text"], [0.5, "two"], [b"blob!"]])
        return message(address, *args), [(address, args)]
    elements, expected = [], []
    for _ in range(rng.randint(0, 3)):
        element, held = random_packet(rng, depth + 1)
        elements.append(element)
        expected += held
    return bundle(*elements), expected


def corrupted(rng: random.Random, datagram: bytes) -> bytes:
    """One random word of the datagram overwritten: often a size field, with a negative, zero, odd or huge size."""
    position = rng.randrange(0, max(1, len(datagram) - 3)) & ~3
    word = struct.pack(">i", rng.choice([-8, -4, -1, 0, 3, 4, 8, 1 << 20, rng.randint(-(1 << 31), (1 << 31) - 1)]))
    return datagram[:position] + word + datagram[position + 4 :]


def test_fuzzed_datagrams_parse_to_what_was_sent_or_are_refused():
    """2,000 random nested datagrams, each whole, cut short at random and corrupted at random: whole ones parse to
        exactly their messages, cut ones to a whole prefix of them (a bundle cut between elements; a bare message cut right
    after its address is that address's query) or a refusal, and
        corrupted ones to a result or a ValueError; all within a time limit."""
    rng = random.Random(43)

    def fuzz() -> int:
        refused = 0
        for _ in range(2000):
            datagram, expected = random_packet(rng, 0)
            assert flattened(parse(datagram)) == expected, datagram
            cut = datagram[: rng.randrange(len(datagram))]
            try:
                got = flattened(parse(cut))
            except ValueError:
                refused += 1
            else:
                query = [(expected[0][0], [])] if not datagram.startswith(b"#") else None  # cut right after the address
                assert got in (expected[: len(got)], query), f"{cut!r} parsed to {got}, not a prefix of {expected}"
            try:
                parse(corrupted(rng, datagram))
            except ValueError:
                refused += 1
        return refused

    started = time.monotonic()
    refused = finishes(fuzz, timeout_s=60)
    assert refused > 1000, f"only {refused} of 4,000 cut or corrupted datagrams refused"
    assert time.monotonic() - started < 60
