"""``python -m easy_context launch ARGS``: ``accelerate launch ARGS`` with the rendezvous store on loopback.

    python -m easy_context launch --config_file accelerate_configs/cpu.yaml train.py --model ... --output-dir out

torch's TCPStore listens on every interface (``*:29500``) whatever the master address; under this command the
launcher's store listens on 127.0.0.1 when the master address is a loopback one (one node: accelerate's default),
so nothing off the host can read or write the rendezvous or the ranks' heartbeats. With ``--main_process_ip HOST``
(several nodes) it is torch's store, unchanged. Same arguments and exit status as ``accelerate launch``.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from accelerate.commands.launch import launch_command, launch_command_parser

    from easy_context.rendezvous import patch_launcher
    if not patch_launcher():
        print("python -m easy_context launch: warning: this torch's launcher does not make its store as expected; "
              "the rendezvous listens on all interfaces (torch's default)", file=sys.stderr)
    parser = launch_command_parser()
    parser.prog = "python -m easy_context launch"
    launch_command(parser.parse_args(list(sys.argv[1:] if argv is None else argv)))
    return 0


__all__ = ["main"]
