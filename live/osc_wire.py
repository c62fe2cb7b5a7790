"""OSC datagrams in and out. python-osc reads a message cut short as if its missing argument bytes were zeros (a
truncated `knob/velocity_scale ,f` would set the knob to 0.0), so every message, bundled or not, is first checked
against the sizes its type tags declare. A message carrying one number, what a fader sends, is read by
`one_number` without python-osc's general parser (0.6 against 5 us), so a flood of them is read as fast as a
sender sends."""

from __future__ import annotations

import struct

from pythonosc.osc_bundle import OscBundle
from pythonosc.osc_message import OscMessage
from pythonosc.osc_message_builder import OscMessageBuilder

FIXED_SIZES = {**dict.fromkeys("ifcrm", 4), **dict.fromkeys("dht", 8), **dict.fromkeys("TFNI[]", 0)}
ONE_NUMBER = {
    b",f\0\0": struct.Struct(">f"),
    b",i\0\0": struct.Struct(">i"),
    b",d\0\0": struct.Struct(">d"),
    b",h\0\0": struct.Struct(">q"),
}


def parse(datagram: bytes) -> OscMessage | OscBundle:
    """The message or bundle in `datagram`; ValueError for anything that is not whole, valid OSC."""
    if OscBundle.dgram_is_bundle(datagram):
        bundle = OscBundle(datagram)
        for content in bundle:
            if isinstance(content, OscMessage):
                check_complete(content.dgram)
        return bundle
    if OscMessage.dgram_is_message(datagram):
        check_complete(datagram)
        return OscMessage(datagram)
    raise ValueError("neither a message (starts with '/') nor a bundle (starts with '#bundle')")


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
