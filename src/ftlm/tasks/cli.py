"""``ftlm tasks ...``: write the verifiable task suite to instruction-data files, list its families.

Not responsible for: generating or checking tasks (``ftlm.tasks.suite``) or file formats
(``ftlm.tasks.files``); this module only parses arguments and prints.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_tasks_write(args: argparse.Namespace) -> int:
    from ftlm.errors import ConfigError
    from ftlm.tasks import generate, write_tasks
    if args.n < 1:
        raise ConfigError(f"--n={args.n} must be at least 1")
    tasks = generate(args.families, args.split, args.n, args.seed)
    path = write_tasks(tasks, Path(args.out), style=args.style)
    counts = {}
    for task in tasks:
        counts[task.family] = counts.get(task.family, 0) + 1
    print(f"{len(tasks)} {args.split} tasks ({', '.join(f'{k} {v}' for k, v in counts.items())}) "
          f"written to {path}")
    return 0


def cmd_tasks_list(args: argparse.Namespace) -> int:
    from ftlm.tasks import FAMILY_TABLE, generate
    for name, family in FAMILY_TABLE.items():
        example = generate([name], "train", 1, 0)[0]
        print(f"{name:<6} {family.description}  e.g. {example.prompt!r} -> {example.answer!r}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``ftlm tasks write`` and ``ftlm tasks list``."""
    from ftlm.tasks.files import STYLES
    from ftlm.tasks.suite import FAMILIES, SPLITS
    p = sub.add_parser("tasks", help="the verifiable task suite (arithmetic, mod, sort, count)")
    tsub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    wp = tsub.add_parser("write", help="write generated tasks as JSONL or Parquet instruction data")
    wp.add_argument("--out", required=True, help="output file, ending in .jsonl or .parquet")
    wp.add_argument("--split", default="train", choices=SPLITS,
                    help="train, or test (held out: never shares a problem with train)")
    wp.add_argument("--n", type=int, default=1000, help="number of tasks (default 1000)")
    wp.add_argument("--families", default=",".join(FAMILIES),
                    help=f"comma-separated families (default all: {','.join(FAMILIES)})")
    wp.add_argument("--seed", type=int, default=0, help="seed of the draw (default 0)")
    wp.add_argument("--style", default="messages", choices=STYLES,
                    help="messages (chat turns) or prompt_completion (default messages)")
    wp.set_defaults(fn=cmd_tasks_write)
    lp = tsub.add_parser("list", help="list the task families with an example each")
    lp.set_defaults(fn=cmd_tasks_list)
