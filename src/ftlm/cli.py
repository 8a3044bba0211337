"""The ``ftlm`` command: one entry point whose subcommands delegate to the modules.

Nothing here decides anything; it parses arguments, builds configs and calls the component that
does the work. ``FtlmError`` is reported as one line (exit status 2) instead of a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any
from pathlib import Path

from ftlm import startup_beacon
from ftlm.errors import EXIT_RETIRED, ConfigError, FaultError, FtlmError, RetiredError

startup_beacon.start()  # a rank's sign of life while it starts, when its supervisor asks for one


def _add_config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("config", nargs=None if required else "?", help="TOML run config, e.g. configs/tiny.toml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config field (repeatable), e.g. --set train.steps=100")


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from ftlm.data.tokenizer import train_tokenizer
    tok = train_tokenizer([Path(p) for p in args.inputs], Path(args.out), vocab_size=args.vocab_size,
                          text_field=args.field, column=args.column)
    print(f"tokenizer with {tok.vocab_size} tokens written to {args.out}")
    return 0


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from ftlm.data.prepare import prepare
    manifest = prepare(Path(args.input), Path(args.out), Path(args.tokenizer), args.seq_len,
                       text_field=args.field, column=args.column, workers=args.workers)
    print(f"{manifest['num_samples']} samples of {manifest['seq_len']} tokens in "
          f"{len(manifest['shards'])} shard(s) under {args.out}")
    return 0


def _exit_on_sigterm_during_setup(command: str = "train") -> None:
    """Until the trainer (or a script's ``ftlm.train.Session``) takes over SIGTERM (it then
    leaves the quorum explicitly), a stop request during set-up ends a group of one rank at once
    with status 0: it has not joined yet.

    A rank of a larger group does not exit: its peers would wait for it in the set-up's
    collectives until a timeout (a node drain signals the ranks of one node only). It notes the
    request (``stop.requested``), and the trainer honours it from its first step, with its peers
    (``Trainer.train``)."""
    alone = int(os.environ.get("WORLD_SIZE", "1")) <= 1

    def stop(signum: int, _frame: Any) -> None:
        if alone:
            print(f"ftlm {command}: stopped by signal {signum} during set-up", file=sys.stderr,
                  flush=True)
            os._exit(0)
            return  # (only where os._exit is replaced: tests)
        print(f"ftlm {command}: signal {signum} during set-up; the group stops at its first step",
              file=sys.stderr, flush=True)
        stop.requested = True  # type: ignore[attr-defined]
    stop.requested = False  # type: ignore[attr-defined]
    signal.signal(signal.SIGTERM, stop)


def cmd_train(args: argparse.Namespace) -> int:
    _exit_on_sigterm_during_setup()
    from ftlm.config import load_config
    from ftlm.train.group import init_group
    from ftlm.train.trainer import Trainer
    config = load_config(args.config, args.overrides)
    from ftlm.observe.logs import configure_logging
    configure_logging(config.observe.log_format, group=os.environ.get("FTLM_GROUP_ID", "g0"),
                      rank=int(os.environ.get("RANK", "0")))
    init_group(config.train, config.ft)
    coordinator = config.ft.coordinator or os.environ.get("FTLM_COORDINATOR", "")
    if not coordinator:
        if int(os.environ.get("RANK", "0")) != 0:
            Trainer.for_run(config).train()
            _leave_group()
            return 0
        # Alone, this process owns the run directory as a launch does (refused while another
        # holds it), and a fresh start sets the earlier record aside instead of appending to it.
        from ftlm.launch.run_lock import lock_run_dir
        from ftlm.train.run_record import resume_step, set_aside
        with lock_run_dir(config.run.path):
            from ftlm.train.job_token import checkpoint_signing
            key, run = checkpoint_signing(config.ft, config.run.path)
            resume = resume_step(config.checkpoint, config.run.path, key, run)
            moved = set_aside(config.run.path, resume)
            if moved:
                print(f"ftlm: {moved}", file=sys.stderr)
            # Marks where this run begins in a record a relaunch continues, as a launch does: the
            # time between two runs is neither a stall nor a gap between commits.
            from ftlm.observe.events import EventLog
            EventLog(config.run.path / "events.jsonl", group="supervisor").emit(
                "run_start", step=-1, groups=1, resume_from=resume)
            summary = Trainer.for_run(config).train()
            _leave_group()
            from ftlm.observe.report import format_summary, write_report
            from ftlm.observe.events import read_events
            write_report(config.run.path, summary, read_events(config.run.path / "events.jsonl"))
        print(format_summary(summary))
        return 0
    from ftlm.train.job import run_group
    run_group(config, coordinator, lambda **kw: Trainer.for_run(config, **kw))
    _leave_group()
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Run a user's training script as ``__main__`` (``sys.argv`` = [SCRIPT, *ARGS]), as
    ``python SCRIPT ARGS`` would, inside the process set-up of every ``ftlm`` command: the start-up
    beacon (from the import of this module), ``ftlm`` logging, ``FtlmError`` as one line with the
    statuses of ``ftlm.errors``, and the group process's exit (``_exit``) under a coordinator.
    The script's ``sys.exit(code)`` is its status. The fault tolerance itself is the script's
    ``ftlm.train.Session``, which reads the launcher's environment (``FTLM_CONFIG``...)."""
    import runpy
    script = Path(args.script)
    if not script.is_file():
        raise ConfigError(f"script {script} does not exist or is not a file; give the path of a "
                          "Python training script, e.g. ftlm run my_train.py")
    in_job = bool(os.environ.get("FTLM_COORDINATOR"))
    if in_job:  # a preemption during the imports leaves the job as ``ftlm train`` does
        _exit_on_sigterm_during_setup("run")
    from ftlm.observe.logs import configure_logging
    configure_logging(_log_format(), group=os.environ.get("FTLM_GROUP_ID", "g0"),
                      rank=int(os.environ.get("RANK", "0")))
    startup_beacon.phase(f"running {script.name}")
    sys.argv = [args.script, *args.args]
    sys.path.insert(0, str(script.resolve().parent))  # the script's own modules, as python does
    code = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message"): printed, status 1, as python does
            print(e.code, file=sys.stderr)
            code = 1
    if code == 0 and "torch.distributed" in sys.modules:
        _leave_group()
    return code


def _log_format() -> str:
    """``observe.log_format`` of the launcher's config (``FTLM_CONFIG``), else text."""
    path = os.environ.get("FTLM_CONFIG", "")
    if not path:
        return "text"
    from ftlm.config import load_config
    return load_config(path).observe.log_format


def _leave_group() -> None:
    """After a run that ended well: destroy the group's process group before the interpreter's
    teardown, where gloo's native threads, still owned by a live process group, ended a rank with
    "terminate called without an active exception" (SIGABRT, status -6) after its last step, now
    and then on a loaded box (a finished run that looks failed to its supervisor). Not after an
    error: a peer that died may keep the group from tearing down; the process exits anyway."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def cmd_coordinator(args: argparse.Namespace) -> int:
    from ftlm.config import load_config
    from ftlm.ft.coordinator import Coordinator
    config = load_config(args.config, args.overrides)
    events = None
    if args.events:
        from ftlm.launch.coordinator_process import CoordinatorEvents
        from ftlm.observe.events import EventLog
        events = CoordinatorEvents(EventLog(Path(args.events), group="coordinator"))
    coordinator = Coordinator(config.ft.coordinator_config(
        host=args.host, port=args.port, token=os.environ.get("FTLM_TOKEN", ""),
        insecure=args.insecure), events=events)
    from ftlm.ft.coordinator_record import with_record
    coordinator.events = with_record(args.record, coordinator.membership, coordinator.events)
    if args.lease:
        from ftlm.launch.lease import LeaseTiming, serve_with_lease
        return serve_with_lease(coordinator, args.lease, LeaseTiming(
            args.lease_duration, args.lease_deadline, args.lease_retry))
    coordinator.serve_forever()
    return 0


def cmd_launch_local(args: argparse.Namespace) -> int:
    from ftlm.config import load_config
    from ftlm.launch.local import LocalLauncher
    script, *script_args = args.script_command or [None]
    if args.config is None and script is None:
        raise ConfigError("ftlm launch local needs a CONFIG (e.g. configs/tiny.toml), a script "
                          "after -- (e.g. -- my_train.py), or both")
    config = load_config(args.config, args.overrides)
    summary = LocalLauncher(config, groups=args.groups, ranks_per_group=args.ranks_per_group,
                            chaos_mtbf=args.chaos_mtbf, chaos_hang=args.chaos_hang,
                            chaos_seed=args.chaos_seed,
                            chaos_coordinator=args.chaos_coordinator,
                            chaos_preempt=args.chaos_preempt, spares=args.spares,
                            script=script, script_args=script_args).run()
    # The run proves fault-tolerant training only with n identical final states of n groups and
    # every sample trained exactly once (a launch stopped on request: over the steps it committed).
    if summary.get("stopped"):
        print(f"ftlm: stopped on request after {summary.get('steps_committed', 0)} committed "
              f"step(s); summary in {config.run.path / 'summary.json'}", file=sys.stderr)
    for problem in summary.get("problems", []):
        print(f"ftlm: run failed its checks: {problem}", file=sys.stderr)
    return 1 if summary.get("problems") else 0


def cmd_launch_cluster(args: argparse.Namespace) -> int:
    from ftlm.config import load_config
    config = load_config(args.config, args.overrides)
    if args.target == "k8s":
        from ftlm.launch.k8s import generate_k8s as generate
    else:
        from ftlm.launch.slurm import generate_slurm as generate
    paths = generate(config, config.cluster, Path(args.out), config.to_toml())
    print(f"{len(paths)} file(s) written under {args.out}; see docs/{'kubernetes' if args.target == 'k8s' else 'slurm'}.md")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from ftlm.observe.events import read_events
    from ftlm.observe.report import format_summary, write_report
    run_dir = Path(args.run_dir)
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise FtlmError(f"{summary_path} not found: is {run_dir} a run directory of a finished run?")
    summary = json.loads(summary_path.read_text())
    path = write_report(run_dir, summary, read_events(run_dir / "events.jsonl"))
    print(format_summary(summary))
    print(f"report written to {path}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ftlm.demo import run_demo
    return run_demo(args)


def cmd_sim_check(args: argparse.Namespace) -> int:
    from ftlm.sim.check import check, format_report
    from ftlm.sim.protocol import FAULTS, SimConfig
    faults = tuple(f.strip() for f in args.faults.split(",") if f.strip()) if args.faults else FAULTS
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        raise ConfigError(f"--faults: unknown {', '.join(unknown)}; valid: {', '.join(FAULTS)}")
    for name in ("seeds", "steps", "groups", "jobs"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name}={getattr(args, name)} must be at least 1")
    if args.fault_mtbf < 0:
        raise ConfigError(f"--fault-mtbf={args.fault_mtbf} must be >= 0 (0: no faults)")
    if args.bad_links < 1:
        raise ConfigError(f"--bad-links={args.bad_links} must be at least 1")
    if args.spares < 0:
        raise ConfigError(f"--spares={args.spares} must be >= 0 (0: every group trains)")
    sdc = SimConfig.sdc if args.sdc is None else args.sdc
    if not 0 <= sdc <= 1:
        raise ConfigError(f"--sdc={sdc} must be a probability in [0, 1]")
    from ftlm.sim.check import LONG_STEPS
    config = SimConfig(groups=args.groups + args.spares, spares=args.spares, steps=args.steps,
                       fault_mtbf=args.fault_mtbf, faults=faults, bad_links=args.bad_links, sdc=sdc,
                       **(LONG_STEPS if args.long_steps else {}))  # type: ignore[arg-type]
    report = check(args.seeds, config, start=args.start, jobs=args.jobs, progress=True)
    print(format_report(report, config))
    return 0 if report.ok else 1


# Modules that add their own subcommands: each defines ``register(sub)`` taking the subparsers
# action and adding its parsers (with ``set_defaults(fn=...)``). Keep them light to import: the
# heavy imports belong inside the command functions.
COMMAND_MODULES: tuple[str, ...] = (
    "ftlm.infer_cli",
    "ftlm.goodput.cli",
    "ftlm.tasks.cli",
    "ftlm.convert_cli",
    "ftlm.evaluate_cli",
    "ftlm.post_cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ftlm", description="Fault-tolerant LLM training (FT-HSDP).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="fault-tolerant training of the tiny model with chaos on the demo corpus")
    p.add_argument("--groups", type=int, default=3, help="replica groups (default 3)")
    p.add_argument("--seconds", type=float, default=120.0, help="approximate training time (default 120)")
    p.add_argument("--chaos-mtbf", type=float, default=25.0, help="mean seconds between injected failures")
    p.add_argument("--run-dir", default="runs/demo", help="run directory (default runs/demo)")
    p.add_argument("--data-dir", default="data/demo", help="demo data cache (default data/demo)")
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("train", help="train one replica group (fault tolerant when FTLM_COORDINATOR is set)")
    _add_config_args(p)
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("run", help="run a Python training script (its own loop, fault tolerant through "
                                   "ftlm.train.Session) as ftlm runs each rank of a job")
    p.add_argument("script", help="the Python script to run as __main__, e.g. my_train.py")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments (its sys.argv[1:])")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("coordinator", help="run the coordinator (membership, per-step quorum, status page)")
    _add_config_args(p, required=False)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=29510, help="port (default 29510; 0 = any free port)")
    p.add_argument("--events", default="", metavar="PATH",
                   help="append the coordinator's events (quorums, deaths, rollbacks) to this "
                        "events.jsonl; the token comes from the FTLM_TOKEN environment variable")
    p.add_argument("--record", default="", metavar="PATH",
                   help="keep the groups found corrupt and those that left finished in this file "
                        "(JSON lines) and take them in again when a coordinator starts on it, so that "
                        "quarantines and the end of the job survive a restart")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without a job token (FTLM_TOKEN or "
                        "ft.token_file): anyone who reaches the port can then steer the job")
    p.add_argument("--lease", default="", metavar="NAME",
                   help="on Kubernetes: serve only while holding the Lease NAME (in POD_NAMESPACE), "
                        "as a warm standby until then; the generated manifests run two such pods "
                        "(docs/kubernetes.md, 'The coordinator')")
    p.add_argument("--lease-duration", type=float, default=10.0, metavar="S",
                   help="with --lease: how long an unrenewed lease lasts before the standby takes "
                        "it (default 10)")
    p.add_argument("--lease-deadline", type=float, default=6.0, metavar="S",
                   help="with --lease: the holder stops serving this long after its last renewal "
                        "began (default 6; less than --lease-duration)")
    p.add_argument("--lease-retry", type=float, default=1.0, metavar="S",
                   help="with --lease: how often the holder renews and the standby tries (default 1)")
    p.set_defaults(fn=cmd_coordinator)

    p = sub.add_parser("launch", help="launch a fault-tolerant job")
    lsub = p.add_subparsers(dest="target", required=True, metavar="TARGET")
    lp = lsub.add_parser(
        "local", help="coordinator + N replica groups as local processes, with chaos",
        usage="ftlm launch local [CONFIG] [options] [-- SCRIPT [ARGS ...]]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start a coordinator and N replica groups on this machine, restart the groups\n"
                    "that fail, optionally inject failures, and check the run at the end\n"
                    "(summary.json and report.md in the run directory).",
        epilog="Every rank of every group runs `ftlm train CONFIG`, or, with a script after --,\n"
               "`ftlm run SCRIPT ARGS`: your own training loop, fault tolerant through\n"
               "ftlm.train.Session (CONFIG is then optional: its defaults apply). Each group\n"
               "process gets FTLM_CONFIG (the resolved run config the launcher writes,\n"
               "RUN_DIR/config.toml, TOML) and FTLM_RUN_DIR (the run directory), besides\n"
               "FTLM_COORDINATOR, FTLM_GROUP_ID, FTLM_INCARNATION, FTLM_TOKEN, FTLM_GROUPS and\n"
               "torchrun's RANK, WORLD_SIZE, MASTER_ADDR... A script must print the FTLM_RESULT\n"
               "line at its end and write events.jsonl in FTLM_RUN_DIR (the Session does both):\n"
               "the launcher's checks are the same as for ftlm train.\n\n"
               "example: ftlm launch local configs/tiny.toml --groups 3 --chaos-mtbf 10 "
               "-- my_train.py --lr 3e-3")
    _add_config_args(lp, required=False)
    lp.add_argument("--groups", type=int, default=2, help="number of replica groups (default 2)")
    lp.add_argument("--spares", type=int, default=0,
                    help="hot spare groups started beside them: up to date with every step, they "
                         "train nothing and replace a failed group at once (default 0)")
    lp.add_argument("--ranks-per-group", type=int, default=1,
                    help="ranks (processes) per group; the model is sharded over them with FSDP2")
    lp.add_argument("--chaos-mtbf", type=float, default=0.0,
                    help="mean seconds between failures injected with SIGKILL (0: no chaos)")
    lp.add_argument("--chaos-hang", action="store_true",
                    help="use SIGSTOP (a hang) for half the failures of groups, on any rank")
    lp.add_argument("--chaos-seed", type=int, default=0, help="seed of the failure schedule")
    lp.add_argument("--chaos-coordinator", action="store_true",
                    help="chaos also SIGKILLs the coordinator process (one more target, drawn like "
                         "a group); the supervisor restarts it on the same port")
    lp.add_argument("--chaos-preempt", action="store_true",
                    help="make a third of the failures of groups preemptions (SIGTERM, to every rank "
                         "or to one): the group leaves gracefully and the supervisor restarts it")
    lp.set_defaults(fn=cmd_launch_local, script_command=[])
    for target, what in (("k8s", "Kubernetes manifests (coordinator, JobSet / Jobs / TrainJob, monitoring)"),
                         ("slurm", "Slurm batch scripts (coordinator, one requeueable job per group, watcher)")):
        cp = lsub.add_parser(target, help=f"write {what}")
        _add_config_args(cp)
        cp.add_argument("--out", required=True, help="output directory")
        cp.set_defaults(fn=cmd_launch_cluster)

    p = sub.add_parser("data", help="data preparation")
    dsub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    dp = dsub.add_parser("prepare", help="tokenise text into packed Parquet training samples")
    dp.add_argument("input", help="folder of .txt, a .jsonl or a .parquet file")
    dp.add_argument("--out", required=True, help="output directory")
    dp.add_argument("--tokenizer", required=True, help="tokenizer.json (see `ftlm tokenizer train`)")
    dp.add_argument("--seq-len", type=int, default=256, help="tokens per sample (default 256)")
    dp.add_argument("--field", default="text", help="JSONL field holding the text (default text)")
    dp.add_argument("--column", default="text", help="Parquet column holding the text (default text)")
    dp.add_argument("--workers", type=int, default=0, help="tokeniser processes (0: automatic)")
    dp.set_defaults(fn=cmd_data_prepare)

    p = sub.add_parser("tokenizer", help="tokenizer training")
    tsub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    tp = tsub.add_parser("train", help="train a byte-level BPE tokenizer")
    tp.add_argument("inputs", nargs="+", help=".txt files or folders, .jsonl or .parquet files")
    tp.add_argument("--out", required=True, help="path of the tokenizer.json to write")
    tp.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size (default 4096)")
    tp.add_argument("--field", default="text", help="JSONL field holding the text (default text)")
    tp.add_argument("--column", default="text", help="Parquet column holding the text (default text)")
    tp.set_defaults(fn=cmd_tokenizer_train)

    p = sub.add_parser("sim", help="protocol simulation: the real FT protocol under seeded faults")
    ssub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    sp = ssub.add_parser("check", help="simulate many seeded jobs with faults at every protocol point "
                                       "and check the invariants after every event")
    sp.add_argument("--seeds", type=int, default=1000, help="number of seeds (default 1000)")
    sp.add_argument("--start", type=int, default=0, help="first seed (default 0); replay one with --seeds 1")
    sp.add_argument("--steps", type=int, default=200, help="steps per simulated job (default 200)")
    sp.add_argument("--groups", type=int, default=3, help="replica groups per job (default 3)")
    sp.add_argument("--spares", type=int, default=0,
                    help="hot spare groups beside them (default 0): current, training nothing, "
                         "promoted when a training group fails")
    sp.add_argument("--fault-mtbf", type=float, default=4.0,
                    help="mean simulated seconds between faults (default 4)")
    sp.add_argument("--faults", default="", help="comma-separated fault kinds (default: all)")
    sp.add_argument("--bad-links", type=int, default=1,
                    help="groups with a bad link at once, at most (default 1; two good groups always remain)")
    sp.add_argument("--sdc", type=float, default=None,
                    help="probability that a seed's job has one silent data corruption (default 0.5)")
    sp.add_argument("--long-steps", action="store_true",
                    help="every step a 1-2 s phase with the timeouts above it, as a DiLoCo "
                         "synchronisation's inner steps (default: 20-60 ms steps)")
    sp.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    sp.set_defaults(fn=cmd_sim_check)

    p = sub.add_parser("report", help="(re)write report.md of a run directory and print its headline")
    p.add_argument("run_dir", help="run directory, e.g. runs/demo")
    p.set_defaults(fn=cmd_report)

    import importlib
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _split_script_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``ftlm launch local ... -- SCRIPT ARGS``: the launcher's own arguments, and the script's
    command line (everything after the first ``--``, options included; None without one):
    argparse alone would mix the two. Other commands are left whole."""
    if argv[:2] != ["launch", "local"] or "--" not in argv:
        return argv, None
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def main(argv: list[str] | None = None) -> int:
    own, script_command = _split_script_command(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    args = parser.parse_args(own)
    if script_command is not None:
        if not script_command:
            parser.error("launch local: nothing after --; give the script to run, "
                         "e.g. -- my_train.py")
        args.script_command = script_command
    try:
        return args.fn(args)
    except FtlmError as e:
        print(f"ftlm: error: {e}", file=sys.stderr)
        # A fault (declared hung, no quorum, a failed transfer) exits as a crash, to be restarted;
        # status 2 tells a supervisor that a restart would fail the same way (bad input); status 3
        # that the coordinator retired the group for failing its steps (a bad link or device).
        if isinstance(e, RetiredError):
            return EXIT_RETIRED
        return 1 if isinstance(e, FaultError) else 2


def _exit(code: int) -> None:
    """End a process of a job's replica group (``FTLM_COORDINATOR`` set) without the
    interpreter's teardown: once ``main`` returned, its result line is out and its events, model
    and checkpoints are on disk; what is left (collecting torch's objects, joining gloo's native
    threads) took longer than the supervisor's teardown bound on a loaded box, and the group was
    killed for exiting slowly. Any other command exits as usual."""
    if not os.environ.get("FTLM_COORDINATOR"):
        sys.exit(code)
    import logging
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
