"""The `serve`, `bridge` and `listen` commands: `add_commands` adds them to flowjam's subcommands and `run` runs
one. Heavy imports (torch, uvicorn, Ray) happen inside the commands, so --help stays instant."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..engine.params import BACKENDS, PRECISIONS, parse_lora_option
from ..live.midi import MIDI_BACKENDS

DTYPES = ("float32", "bfloat16")


def add_commands(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="serve live sessions over HTTP and WebSocket (one host, or Ray Serve)")
    serve.add_argument("--local", action="store_true", help="one host in this process, no Ray")
    serve.add_argument("--replicas", type=int, default=1, help="Ray Serve replicas, each a model on its GPU(s)")
    serve.add_argument(
        "--gpus-per-replica", type=float, help="GPUs each replica reserves (default 1 with --device cuda, else 0)"
    )
    serve.add_argument("--address", help="Ray cluster to join ('auto': the one `ray start --head` runs here)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (anything but loopback must be asked for)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--preset", default="tiny", help="network preset when no --checkpoint (tiny: no files)")
    serve.add_argument("--checkpoint", help="local weights (see `flowjam render --help`)")
    serve.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    serve.add_argument("--dtype", default="float32", choices=DTYPES)
    serve.add_argument("--precision", default="bf16", choices=PRECISIONS)
    serve.add_argument("--backend", choices=BACKENDS, help="tick backend (default: the session's)")
    serve.add_argument(
        "--lora",
        action="append",
        metavar="PATH[:STRENGTH]",
        help="a LoRA for the DiT on every replica, attached live so that each session plays it at its own strength "
        "(knob lora/<file name>, starting at STRENGTH, default 1); repeatable",
    )

    bridge = commands.add_parser("bridge", help="play a served session from OSC (and MIDI) controllers on this machine")
    add_server_arguments(bridge)
    bridge.add_argument("--osc-port", type=int, default=9110, help="UDP port for OSC control (0: none, MIDI only)")
    bridge.add_argument("--osc-host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    bridge.add_argument(
        "--osc-session", help="the <session> in /flowjam/<session>/... (default: --session), e.g. a layout's 'default'"
    )
    bridge.add_argument("--midi-port", help="MIDI input port name (pip install 'flowjam[midi]')")
    bridge.add_argument("--midi-map", type=Path, help="JSON CC mapping file: loaded if it exists, saved on exit")
    bridge.add_argument("--midi-learn", help="comma-separated knobs to map to the next controls moved, in order")
    bridge.add_argument("--midi-backend", help=f"MIDI system: {', '.join(MIDI_BACKENDS)} or a mido backend name")
    bridge.add_argument("--seconds", type=float, help="stop after this many seconds (default: run until Ctrl-C)")

    listen = commands.add_parser("listen", help="play a served session on this machine's sound card (and record it)")
    add_server_arguments(listen, session_required=False)
    listen.add_argument("--device", help="output device name or index (default: the system's)")
    listen.add_argument("--list-devices", action="store_true", help="print audio output devices and exit")
    listen.add_argument("--out", type=Path, help="write the audio that arrived to this WAV")
    listen.add_argument("--seconds", type=float, help="stop after this many seconds of audio (default: until Ctrl-C)")
    listen.add_argument("--no-audio", action="store_true", help="no sound card: only record (with --out)")


def add_server_arguments(parser: argparse.ArgumentParser, session_required: bool = True) -> None:
    parser.add_argument("--server", default="http://127.0.0.1:8000", help="the server's URL (flowjam serve)")
    parser.add_argument(
        "--session", required=session_required, help="the session's name (as POST /sessions returned it)"
    )


def run(args: argparse.Namespace) -> int:
    """Run one of the commands; the refusals that flowjam's main does not know (the server's, the sound card's)
    are shown like the others: one line on stderr, exit 2."""
    from ..live.playback import PlaybackError
    from ..serve.client import ServerError

    try:
        return {"serve": run_serve, "bridge": run_bridge, "listen": run_listen}[args.command](args)
    except (ServerError, PlaybackError) as error:
        print(f"flowjam {args.command}: error: {error}", file=sys.stderr)
        return 2


def run_serve(args: argparse.Namespace) -> int:
    from ..serve.host import HostOptions

    if args.local and (args.replicas != 1 or args.address or args.gpus_per_replica is not None):
        raise ValueError("--replicas, --gpus-per-replica and --address need Ray; --local serves one host in-process")
    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    options = HostOptions(
        preset=args.preset,
        checkpoint=args.checkpoint,
        device=args.device,
        dtype=args.dtype,
        backend=args.backend,
        precision=args.precision,
        loras=tuple((str(path), strength) for path, strength in map(parse_lora_option, args.lora or ())),
    )
    for path, _ in options.loras:  # before Ray or a model starts: a typo is one line, not a replica's traceback
        if not Path(path).exists():
            raise ValueError(
                f"--lora {path}: no such file or folder (on a Ray cluster it must be at this path on every node)"
            )
    if not args.local:
        from ..serve.deployment import run_on_ray

        gpus = args.gpus_per_replica
        if gpus is None:
            gpus = 1.0 if args.device.startswith("cuda") else 0.0
        run_on_ray(options, args.replicas, gpus, args.address, args.host, args.port)
        return 0

    import uvicorn

    from ..serve.gateway import LocalRouter, listening_socket, make_app

    sock = listening_socket(args.host, args.port)  # a busy port fails before the model loads
    host = options.build()
    router = LocalRouter(host)
    model = args.preset if args.checkpoint is None else args.checkpoint
    print(f"serving {model} on http://{args.host}:{sock.getsockname()[1]} (Ctrl-C stops)", flush=True)
    try:
        uvicorn.Server(uvicorn.Config(make_app(router), log_level="info")).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn shuts down gracefully on Ctrl-C, then raises it again
        print("stopped", flush=True)
    finally:
        router.close()
        host.close()
    return 0


def run_bridge(args: argparse.Namespace) -> int:
    from ..live.osc import OscConfig
    from ..serve.bridge import Bridge
    from ..serve.client import Client

    if args.seconds is not None and not args.seconds > 0:
        raise ValueError(f"--seconds must be > 0 (leave it out to run until Ctrl-C), got {args.seconds:g}")
    learn = tuple(knob.strip() for knob in args.midi_learn.split(",")) if args.midi_learn else ()
    uses_midi = args.midi_port is not None or args.midi_map is not None or bool(learn)
    if not args.osc_port and not uses_midi:
        raise ValueError("nothing to bridge: give --osc-port N (default 9110) or --midi-port NAME")
    osc = None
    if args.osc_port:
        osc = OscConfig(session=args.osc_session or args.session, host=args.osc_host, port=args.osc_port)
    bridge = Bridge(Client(args.server), args.session, osc)
    if uses_midi:
        bridge.enable_midi(args.midi_port, args.midi_map, learn, args.midi_backend)
    status = bridge.start()
    try:
        where = f"OSC on {bridge.osc.address[0]}:{bridge.osc.address[1]} /flowjam/{osc.session}/..." if osc else ""
        midi = f"MIDI from {bridge.midi.name}" if bridge.midi is not None else ""
        print(
            f"bridging {' and '.join(filter(None, (where, midi)))} to session {args.session} on {args.server} "
            f"(playhead {status.get('playhead_s', 0):.1f} s); Ctrl-C stops",
            file=sys.stderr,
        )
        started = time.monotonic()
        while args.seconds is None or time.monotonic() - started < args.seconds:
            time.sleep(0.1)
    except KeyboardInterrupt:
        pass
    finally:
        bridge.stop()
    forwarder = bridge.forwarder
    print(f"forwarded {forwarder.requests} requests to the server ({forwarder.failures} refused or failed)")
    return 0


def run_listen(args: argparse.Namespace) -> int:
    from ..serve.client import Client
    from ..serve.listen import listen

    if args.list_devices:
        from ..live.playback import list_devices

        print(list_devices())
        return 0
    if args.session is None:
        raise ValueError("--session is required: the session's name, as POST /sessions returned it")
    if args.no_audio and args.out is None:
        raise ValueError("--no-audio plays nothing: give --out FILE to record the session")
    report = listen(Client(args.server), args.session, args.seconds, args.out, args.device, play=not args.no_audio)
    print(report.summary() + (f"; wrote {args.out}" if args.out else ""))
    return 0
