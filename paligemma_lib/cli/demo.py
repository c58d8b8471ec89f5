# Hand-written CLI wiring, not exported from a notebook: it parses, then calls the lib.
"""`python -m paligemma_lib demo`: serve the demo page (chapter 13)."""

import argparse
import errno
import socket

from .adapter_checks import adapter_folder, check_adapter_base
from .interrupt import ON_INTERRUPT
from .options import (
    DEFAULT_MODEL,
    DEVICE_HELP,
    add_model_arguments,
    check_device,
    check_model,
    command_parser,
)


def add_demo_parser(commands) -> None:
    demo = command_parser(
        commands,
        "demo",
        "serve a web page that asks the model about images (Gradio); Ctrl-C stops it",
    )
    add_model_arguments(demo, adapter=False)
    demo.add_argument(
        "--adapter",
        default=None,
        help="a LoRA adapter folder in PEFT's format or a shipped adapter's name, "
        "switchable in the page (on for the receipt task), or 'none'. Default: "
        "the shipped receipts adapter (chapter 12) when serving the shipped nano",
    )
    demo.add_argument(
        "--segment-adapter",
        default=None,
        help="the LoRA adapter (folder or shipped name) of the segment task "
        "(section 12.1), on for it and switchable in the page, or 'none'. Default: "
        "the shipped segment adapter when serving the shipped nano; without one, the "
        "segment task answers without an adapter and says so",
    )
    demo.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; anything but this machine's own is warned about",
    )
    demo.add_argument("--port", type=int, default=7860, help="port to listen on")
    demo.add_argument("--device", default="auto", help=DEVICE_HELP)


def demo_command(args: argparse.Namespace, argv=None) -> int:
    "Checks the flags, then imports Gradio (only now) and serves the page"
    from ..demo import shipped_adapter

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if ":" in args.host:  # Gradio builds http://HOST:PORT and cannot parse it back
        raise ValueError(
            f"--host {args.host}: the demo's server takes an IPv4 address or a name, "
            "not an IPv6 address; give 127.0.0.1 for this machine or 0.0.0.0 for "
            "every interface"
        )
    check_device(args.device)
    # the shipped adapters were trained on the shipped nano: another model (even
    # nano-real, fine-tuned from it) gets none unless asked for
    nano = args.model == DEFAULT_MODEL
    adapter = adapter_flag(
        "--adapter", args.adapter, shipped_adapter("receipts") if nano else None
    )
    segment = adapter_flag(
        "--segment-adapter",
        args.segment_adapter,
        shipped_adapter("segment") if nano else None,
    )
    check_model(args.model, used=[args.adapter])
    given = (("--adapter", args.adapter), ("--segment-adapter", args.segment_adapter))
    for flag, value in given:  # trained on another model: refused, as generate does
        if value not in (None, "none"):
            check_adapter_base(args.model, value, flag)
    check_port(args.host, args.port)
    try:
        from ..app import serve
    except ModuleNotFoundError as e:
        if e.name != "gradio":
            raise
        raise ValueError(
            "the demo needs Gradio: pip install 'paligemma_lib[demo]'"
        ) from None
    # Ctrl-C is how the demo is stopped: not an error, status 0
    ON_INTERRUPT.update(message=lambda: "demo stopped", status=0)
    return serve(args.model, adapter, args.host, args.port, args.device, segment)


def adapter_flag(flag: str, value, shipped):
    """An adapter flag's folder, its files checked: a folder or a shipped adapter's
    name (as for generate's --adapter); `shipped` when not given, None for 'none'"""
    if value is None:
        return shipped
    if value == "none":
        return None
    return adapter_folder(value, flag)


def check_port(host: str, port: int) -> None:
    "A ValueError naming --port if nothing can listen on host:port (before loading)"
    try:
        family, kind, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM
        )[0]
        with socket.socket(family, kind) as probe:
            # as the server binds: a port left in TIME_WAIT is free
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as e:
        hint = (
            "is another demo running there? Choose another port with --port N"
            if e.errno == errno.EADDRINUSE
            else "check --host and --port"
        )
        message = f"cannot serve on {host}:{port} ({e.strerror or e}): {hint}"
        raise ValueError(message) from None
