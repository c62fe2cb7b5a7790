"""`flowjam serve`: live sessions over HTTP and WebSocket, from one host in this process or on Ray Serve."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .flags import (
    add_backend,
    add_key_file,
    add_lora_arguments,
    add_model_arguments,
    add_window_seconds,
    check_port,
    check_window,
    lora_option,
)


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser("serve", help="serve live sessions over HTTP and WebSocket (one host, or Ray Serve)")
    parser.add_argument("--local", action="store_true", help="one host in this process, no Ray")
    parser.add_argument("--replicas", type=int, default=1, help="Ray Serve replicas, each a model on its GPU(s)")
    parser.add_argument(
        "--gpus-per-replica", type=float, help="GPUs each replica reserves (default 1 with --device cuda, else 0)"
    )
    parser.add_argument("--address", help="Ray cluster to join ('auto': the one `ray start --head` runs here)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (anything but loopback must be asked for)")
    parser.add_argument("--port", type=int, default=8000)
    add_key_file(parser, "; required to bind anything but loopback")
    parser.add_argument(
        "--allow-host", action="append", default=[], metavar="NAME", help="another name clients reach it by (Host)"
    )
    parser.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a web page origin allowed to call it, e.g. https://my.app (default: none, browsers are kept out)",
    )
    add_window_seconds(parser)  # a session's create may give its own (window_seconds), or ask for endless play
    add_model_arguments(parser)
    add_backend(parser, default=None)
    add_lora_arguments(
        parser,
        help="a LoRA for the DiT on every replica, attached live so that each session plays it at its own strength "
        "(knob lora/<file name>, starting at STRENGTH, default 1); repeatable",
        modes=False,
    )
    return parser


def run(args: argparse.Namespace) -> int:
    check_port("--port", args.port, "any free port")
    check_window(args.window_seconds)
    from ..serve.access import AccessPolicy, read_key
    from ..serve.host import HostOptions

    policy = AccessPolicy.for_server(
        args.host, read_key(args.key_file), tuple(args.allow_host), tuple(args.allow_origin)
    )

    if args.local and (args.replicas != 1 or args.address or args.gpus_per_replica is not None):
        raise ValueError("--replicas, --gpus-per-replica and --address need Ray; --local serves one host in-process")
    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    ray_note = "" if args.local else " (on a Ray cluster, every node needs it at this path)"
    loras = [lora_option(spec, ray_note) for spec in args.lora or ()]  # a bad one is one line, not a replica's trace
    options = HostOptions(
        preset=args.preset,
        checkpoint=None if args.checkpoint is None else str(args.checkpoint),
        device=args.device,
        dtype=args.dtype,
        backend=args.backend,
        precision=args.precision,
        loras=tuple((str(path), strength) for path, strength in loras),
        window_seconds=args.window_seconds,
    )
    if not args.local:
        from ..serve.deployment import run_on_ray

        gpus = args.gpus_per_replica
        if gpus is None:
            gpus = 1.0 if args.device.startswith("cuda") else 0.0
        run_on_ray(options, args.replicas, gpus, args.address, args.host, args.port, policy)
        return 0

    import uvicorn

    from ..serve.gateway import LocalRouter, listening_socket, make_app
    from ..serve.guard import server_config

    sock = listening_socket(args.host, args.port)  # a busy port fails before the model loads
    host = options.build()
    router = LocalRouter(host)
    model = args.preset if args.checkpoint is None else args.checkpoint
    print(f"serving {model} on http://{args.host}:{sock.getsockname()[1]} (Ctrl-C stops)", flush=True)
    try:
        uvicorn.Server(server_config(make_app(router, policy))).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn shuts down gracefully on Ctrl-C, then raises it again
        print("stopped", flush=True)
    finally:
        router.close()
        host.close()
    exit_without_teardown()


def exit_without_teardown() -> None:
    """End the process now: every session has ended, every socket is closed and the shared memory unlinked; what
    is left is the interpreter freeing the model's objects one by one, 1-2 s of CPU that would keep Ctrl-C waiting."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
