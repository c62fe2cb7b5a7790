"""OSC datagrams in and out. Bundles are walked here, not by python-osc, whose walk loops forever on a negative
element size: every size field read is bounded, at any nesting. python-osc reads a message cut short as if its
missing argument bytes were zeros (a truncated `knob/velocity_scale ,f` would set the knob to 0.0), so every
message, bundled at any depth or not, is first checked against the sizes its type tags declare, and only then handed
to python-osc's message parser. A message carrying one number, what a fader sends, is read by `one_number` without
python-osc's general parser (0.6 against 5 us), so a flood of them is read as fast as a sender sends. `shown` cuts
arguments to what a status line and a log can hold."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from pythonosc import osc_message
from pythonosc.osc_message import OscMessage
from pythonosc.osc_message_builder import OscMessageBuilder
from pythonosc.parsing import osc_types

FIXED_SIZES = {**dict.fromkeys("ifcrm", 4), **dict.fromkeys("dht", 8), **dict.fromkeys("TFNI[]", 0)}
BUNDLE_PREFIX = b"#bundle\0"
BUNDLE_HEADER_BYTES = len(BUNDLE_PREFIX) + 8  # and the timetag
ELEMENT_SIZE = struct.Struct(">i")
MAX_BUNDLE_DEPTH = 8  # a 64 KiB datagram could nest thousands deep
SHOWN_CHARS = 40  # of one argument in stats and logs: a 60,000-character prompt must not fill the status line
SHOWN_ARGS = 4
SHOWN_ADDRESS_CHARS = 100
ONE_NUMBER = {
    b",f\0\0": struct.Struct(">f"),
    b",i\0\0": struct.Struct(">i"),
    b",d\0\0": struct.Struct(">d"),
    b",h\0\0": struct.Struct(">q"),
}


@dataclass(frozen=True)
class Bundle:
    """A bundle read by parse(): its timetag in epoch seconds (0 = immediately) and its elements in order."""

    timestamp: float
    contents: tuple[OscMessage | Bundle, ...]


def parse(datagram: bytes) -> OscMessage | Bundle:
    """The message or bundle in `datagram`; ValueError for anything that is not whole, valid OSC."""
    return _parse_packet(datagram, depth=0)


def _parse_packet(packet: bytes, depth: int) -> OscMessage | Bundle:
    if packet.startswith(BUNDLE_PREFIX):
        return _parse_bundle(packet, depth)
    if packet[:1] == b"/":
        check_complete(packet)
        try:
            return OscMessage(packet)
        except osc_message.ParseError as error:
            raise ValueError(str(error)) from None
    raise ValueError("neither a message (starts with '/') nor a bundle (starts with '#bundle')")


def _parse_bundle(bundle: bytes, depth: int) -> Bundle:
    """Every element size is checked before it is used: positive, a multiple of 4, inside the bundle, so the walk
    always moves forward and ends (python-osc's own walk steps back on a negative size and never ends)."""
    if depth >= MAX_BUNDLE_DEPTH:
        raise ValueError(f"bundles nested more than {MAX_BUNDLE_DEPTH} deep")
    if len(bundle) < BUNDLE_HEADER_BYTES:
        raise ValueError(f"truncated: a bundle takes {BUNDLE_HEADER_BYTES} bytes before its elements")
    timestamp, position = osc_types.get_date(bundle, len(BUNDLE_PREFIX))
    contents = []
    while position < len(bundle):
        if position + 4 > len(bundle):
            raise ValueError(f"truncated: a bundle element's size at byte {position} is cut short")
        (size,) = ELEMENT_SIZE.unpack_from(bundle, position)
        position += 4
        if size <= 0 or size % 4 or position + size > len(bundle):
            raise ValueError(
                f"a bundle element's size {size} at byte {position - 4} is not a positive multiple of 4 within "
                f"the {len(bundle) - position} bytes left"
            )
        contents.append(_parse_packet(bundle[position : position + size], depth + 1))
        position += size
    return Bundle(timestamp, tuple(contents))


def one_number(datagram: bytes) -> tuple[str, float] | None:
    """(address, value) of a whole message with one number argument (type tag f, i, d or h), as parse() reads it;
    None for anything else."""
    address_end = datagram.find(b"\0")
    tags_start = (address_end // 4 + 1) * 4
    layout = ONE_NUMBER.get(datagram[tags_start : tags_start + 4])
    if address_end < 1 or datagram[0] != ord("/") or layout is None or len(datagram) != tags_start + 4 + layout.size:
        return None
    try:
        address = datagram[:address_end].decode()
    except UnicodeDecodeError:
        return None
    return address, layout.unpack_from(datagram, tags_start + 4)[0]


def check_complete(message: bytes) -> None:
    """ValueError unless `message` holds every byte its address, type tags and arguments take."""
    tags_start = _string_end(message, 0)
    if tags_start >= len(message):
        return  # no type tags: a message without arguments
    if message[tags_start : tags_start + 1] != b",":
        raise ValueError("the type tags do not start with ','")
    tags = message[tags_start + 1 : message.index(b"\0", tags_start)].decode("ascii", "replace")
    position = _string_end(message, tags_start)  # the first argument
    for tag in tags:
        if tag in FIXED_SIZES:
            position += FIXED_SIZES[tag]
        elif tag in "sS":
            position = _string_end(message, position)
        elif tag == "b":
            size = int.from_bytes(message[position : position + 4], "big")
            position += 4 + -(-size // 4) * 4
        else:
            raise ValueError(f"unknown type tag {tag!r}")
        if position > len(message):
            raise ValueError(f"truncated: its type tags need {position} bytes, the datagram has {len(message)}")


def encode(address: str, value: float | str) -> bytes:
    """One message with one float or string argument."""
    builder = OscMessageBuilder(address)
    is_text = isinstance(value, str)
    builder.add_arg(value, OscMessageBuilder.ARG_TYPE_STRING if is_text else OscMessageBuilder.ARG_TYPE_FLOAT)
    return builder.build().dgram


def _string_end(data: bytes, start: int) -> int:
    """Where the padded, NUL-terminated string starting at `start` ends (a multiple of 4 past it)."""
    end = data.find(b"\0", start)
    if end < 0:
        raise ValueError("truncated: a string has no terminating NUL")
    return start + ((end - start) // 4 + 1) * 4


def shown(args: list) -> str:
    """Arguments as the status line and logs show them: each cut to SHOWN_CHARS, at most SHOWN_ARGS of them."""
    parts = [clip(repr(arg), SHOWN_CHARS) for arg in args[:SHOWN_ARGS]]
    if len(args) > SHOWN_ARGS:
        parts.append(f"(and {len(args) - SHOWN_ARGS} more)")
    return " ".join(parts) or "(no arguments)"


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "…"
