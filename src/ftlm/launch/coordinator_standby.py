"""A warm standby coordinator: a process that has imported everything and read the job's config,
waiting for the word to serve.

Starting ``ftlm coordinator`` costs seconds before it answers: reading the config imports torch
(the model's config lives next to the model), and on a loaded machine that is 3 to 7 s, all of it
a stall of every group while the coordinator is down (BENCHMARKS.md, coordinator crash).
``CoordinatorProcess`` keeps one standby ready: when the coordinator dies it writes ``serve`` (or
``serve PORT``, to serve on another port than ``--port``: the old one was taken) to the
standby's stdin and the standby builds a fresh ``Coordinator`` (a new epoch, no state: the
same rebuild from the groups' heartbeats as any restart) and binds the port within tens of
milliseconds. EOF on stdin (the supervisor is gone) makes it exit.

    python -m ftlm.launch.coordinator_standby CONFIG --port PORT [--host HOST] [--events PATH] [--record PATH]

Not responsible for: deciding when to take over (``ftlm.launch.coordinator_process``), or
anything the coordinator does once serving (``ftlm.ft.coordinator``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

SERVE = "serve"
"""The line that makes the standby serve (optionally followed by the port to serve on)."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ftlm.launch.coordinator_standby", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--events", default="")
    p.add_argument("--record", default="")
    args = p.parse_args(argv)
    # Everything slow happens now, before the coordinator is needed.
    from ftlm.config import load_config
    from ftlm.errors import FtlmError
    from ftlm.ft.coordinator import Coordinator
    from ftlm.launch.coordinator_process import ERROR_PREFIX, CoordinatorEvents
    from ftlm.observe.events import EventLog
    try:
        config = load_config(args.config)
    except FtlmError as e:
        print(f"{ERROR_PREFIX}{e}", file=sys.stderr, flush=True)
        return 2
    words = sys.stdin.readline().split()
    if not words or words[0] != SERVE:
        return 0  # EOF: the supervisor stopped without needing us
    port = args.port
    if len(words) == 2 and words[1].isdigit():
        port = int(words[1])
    elif len(words) != 1:
        print(f"{ERROR_PREFIX}standby told {' '.join(words)!r}; expected 'serve' or 'serve PORT'",
              file=sys.stderr, flush=True)
        return 2
    events = CoordinatorEvents(EventLog(Path(args.events), group="coordinator")) if args.events else None
    try:
        coordinator = Coordinator(config.ft.coordinator_config(
            host=args.host, port=port, token=os.environ.get("FTLM_TOKEN", ""), insecure=False),
            events=events)
        from ftlm.ft.coordinator_record import with_record
        coordinator.events = with_record(args.record, coordinator.membership, coordinator.events)
        coordinator.serve_forever()
    except FtlmError as e:
        print(f"{ERROR_PREFIX}{e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
