"""``ftlm sft | dpo | grpo | pairs``: post-training commands.

``ftlm sft CONFIG`` trains one replica group (fault tolerant under ``FTLM_COORDINATOR``, as
``ftlm train``); with ``--groups N`` it launches a local job of N groups instead (coordinator,
supervisor, optional chaos), whose groups each run ``ftlm sft CONFIG``. ``dpo`` and ``grpo`` are the
same. ``ftlm pairs CONFIG --out FILE`` samples preference pairs for DPO from the task suite.

Not responsible for: anything but parsing, composing and printing: building and training a
group (``ftlm.post.run``), sampling pairs (``ftlm.post.pairs``), supervising a job
(``ftlm.launch.local``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ftlm.config import RunConfig


def _config(args: argparse.Namespace):
    from ftlm.config import load_config
    from ftlm.observe.logs import configure_logging
    config = load_config(args.config, args.overrides)
    configure_logging(config.observe.log_format, group=os.environ.get("FTLM_GROUP_ID", "g0"),
                      rank=int(os.environ.get("RANK", "0")))
    return config


def launch(kind: str, config: RunConfig, groups: int, chaos_mtbf: float = 0.0,
           chaos_hang: bool = False, chaos_seed: int = 0, ranks_per_group: int = 1) -> dict:
    """Coordinator + ``groups`` local groups running ``ftlm KIND``, optionally with chaos."""
    from ftlm.launch.local import LocalLauncher
    from ftlm.post.run import build
    build(kind, config)  # a bad config or file fails here, once, not in every group
    return LocalLauncher(config, groups=groups, chaos_mtbf=chaos_mtbf, chaos_hang=chaos_hang,
                         chaos_seed=chaos_seed, ranks_per_group=ranks_per_group,
                         command=kind).run()


def cmd_post(args: argparse.Namespace) -> int:
    from ftlm.errors import ConfigError
    from ftlm.observe.report import format_summary
    from ftlm.post import run
    config = _config(args)
    if args.groups:
        if os.environ.get("FTLM_COORDINATOR"):
            raise ConfigError("--groups starts a job of its own; a group of a job (FTLM_COORDINATOR "
                              "set) runs without it")
        summary = launch(args.kind, config, args.groups, chaos_mtbf=args.chaos_mtbf,
                         chaos_hang=args.chaos_hang, chaos_seed=args.chaos_seed,
                         ranks_per_group=args.ranks_per_group)
        for problem in summary.get("problems", []):
            print(f"ftlm: run failed its checks: {problem}", file=sys.stderr)
        return 1 if summary.get("problems") else 0
    from ftlm.train.group import init_group
    init_group(config.train, config.ft)
    result = run.run(args.kind, config)
    coordinator = config.ft.coordinator or os.environ.get("FTLM_COORDINATOR", "")
    if not coordinator and int(os.environ.get("RANK", "0")) == 0:
        print(format_summary(result))
    return 0


def cmd_pairs(args: argparse.Namespace) -> int:
    import torch

    from ftlm.post.data import training_tasks
    from ftlm.post.pairs import make_pairs, write_pairs
    from ftlm.post.run import load_reference, load_tokenizer
    from ftlm.tasks import VERIFIERS
    config = _config(args)
    if config.train.threads:
        torch.set_num_threads(config.train.threads)
    tokenizer = load_tokenizer(config)
    model = load_reference(config, torch.device("cpu"))
    tasks, _ = training_tasks(config.post)
    post = config.post
    records, counts = make_pairs(model, tokenizer, tasks, samples=post.pair_samples,
                                 max_new_tokens=post.max_new_tokens, temperature=post.temperature,
                                 top_k=post.top_k, seed=config.run.seed,
                                 solution_fallback=not args.no_solution_fallback,
                                 verify=VERIFIERS[post.verify])
    if not records:
        from ftlm.errors import DataError
        raise DataError(f"no preference pairs from {counts['tasks']} tasks (every sample was "
                        "correct, or none and --no-solution-fallback); use more or harder tasks")
    path = write_pairs(records, Path(args.out))
    total = counts["tasks"] * post.pair_samples
    print(f"{len(records)} pairs from {counts['tasks']} tasks written to {path}: "
          f"{counts['sample']} sampled correct vs incorrect, {counts['solution']} reference "
          f"solution vs incorrect, {counts['all_correct']} tasks all correct (skipped); "
          f"{counts['correct_samples']}/{total} samples correct")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``ftlm sft``, ``ftlm dpo``, ``ftlm grpo`` and ``ftlm pairs``."""
    helps = {"sft": "supervised fine-tuning on instruction data or the task suite (loss on "
                    "completions, packed with document masking)",
             "dpo": "direct preference optimisation against a frozen reference (sigmoid or IPO)",
             "grpo": "RL with verifiable rewards: G samples per prompt, task checker, clipped "
                     "ratio, KL to the reference"}
    for kind, text in helps.items():
        p = sub.add_parser(kind, help=text)
        p.add_argument("config", help="TOML run config with a [post] section, e.g. configs/sft.toml")
        p.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="SECTION.KEY=VALUE", help="override a config field (repeatable)")
        p.add_argument("--groups", type=int, default=0,
                       help="launch a local fault-tolerant job of this many replica groups "
                            "(0: train this one group)")
        p.add_argument("--ranks-per-group", type=int, default=1,
                       help="with --groups: ranks per group (FSDP2 inside a group)")
        p.add_argument("--chaos-mtbf", type=float, default=0.0,
                       help="with --groups: mean seconds between injected failures (0: none)")
        p.add_argument("--chaos-hang", action="store_true",
                       help="with --groups: SIGSTOP (a hang) for half the failures")
        p.add_argument("--chaos-seed", type=int, default=0, help="seed of the failure schedule")
        p.set_defaults(fn=cmd_post, kind=kind)
    p = sub.add_parser("pairs", help="DPO preference pairs from the task suite: verified-correct "
                                     "vs incorrect samples of the reference (SFT) model")
    p.add_argument("config", help="TOML run config (model, data.tokenizer, [post])")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override a config field (repeatable)")
    p.add_argument("--out", required=True, help="output .jsonl file")
    p.add_argument("--no-solution-fallback", action="store_true",
                   help="skip tasks with no correct sample instead of using the reference solution")
    p.add_argument("--solution-fallback", dest="no_solution_fallback", action="store_false",
                   help="use the reference solution as the chosen answer of a task with no correct "
                        "sample (the default; the last of the two flags given wins)")
    p.set_defaults(fn=cmd_pairs)
