"""Every command the documentation shows runs as written (README.md and docs/*.md).

Commands are read from the fenced code blocks: ``bash``, ``sh``, ``shell`` and ``console`` blocks
hold one command per line (continuation lines joined, comments dropped, ``NAME="..."`` lines kept
as shell variables of the commands after them); ``python`` blocks are scripts.

* Default tier (about a second): every ``ftlm`` command (also the one ``torchrun -m ftlm.cli``
  runs) parses with the real argument parser (``ftlm.cli.build_parser``), the config it names
  loads with its ``--set`` overrides against the schema (``ftlm.config.load_config``: unknown
  keys, wrong types and each section's ``__post_init__`` validation), and every python block
  compiles.
* Slow tier: each file's commands run in order, with ``bash``, in a copy of a prepared working
  directory (``prepared``: what the commands expect to find there, each item with the reason),
  shrunk only by flags the docs themselves show (``SHRINK``, appended to the command: a later
  ``--set`` or flag wins), never otherwise edited. A server command (``ftlm serve``,
  ``ftlm coordinator``) runs in the background from when it answers on its port until the file's
  next server command or its end; the python blocks after it talk to it.

Commands that cannot run here are in ``NOT_RUNNABLE`` with the reason (a cluster, a GPU, the
network); an entry that matches no command of its file fails the default tier, so the list
stays the docs' own.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console"}


@dataclass(frozen=True)
class DocCommand:
    """One command (or python block) of a doc file, as written."""

    doc: str
    """Path of the doc file, relative to the repository root."""
    line: int
    """Line of the doc file where the command starts."""
    text: str
    """The command: continuation lines joined, the trailing comment dropped (python: the block)."""
    python: bool = False

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text.splitlines()[0]}"


def _drop_comment(line: str) -> str:
    """``line`` without a shell comment (a ``#`` that starts a word outside quotes)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def doc_commands(path: Path) -> list[DocCommand]:
    """The commands of ``path``'s fenced shell and python blocks, in order."""
    doc = str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    commands: list[DocCommand] = []
    i = 0
    while i < len(lines):
        fence = re.match(r"\s*```\s*([\w+-]*)", lines[i])
        if not fence:
            i += 1
            continue
        lang, start = fence.group(1).lower(), i + 1
        end = start
        while end < len(lines) and not lines[end].strip().startswith("```"):
            end += 1
        body = lines[start:end]
        if lang == "python":
            commands.append(DocCommand(doc, start + 1, "\n".join(body), python=True))
        elif lang in SHELL_LANGS:
            pending: list[str] = []
            first = 0
            for n, raw in enumerate(body, start + 1):
                line = raw[2:] if lang == "console" and raw.startswith("$ ") else raw
                if not pending:
                    if not line.strip() or line.lstrip().startswith("#"):
                        continue
                    first = n
                if line.rstrip().endswith("\\"):
                    pending.append(line.rstrip()[:-1].strip())
                    continue
                pending.append(_drop_comment(line).strip())
                commands.append(DocCommand(doc, first, " ".join(p for p in pending if p)))
                pending = []
        i = end + 1
    return commands


ALL_COMMANDS = [c for path in DOC_FILES for c in doc_commands(path)]

_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def is_assignment(command: DocCommand) -> bool:
    """``NAME=value`` alone on its line: a shell variable for the commands after it."""
    return not command.python and bool(_ASSIGNMENT.match(command.text)) and " " not in \
        command.text.split("=", 1)[0]


_OPERATORS = {">", ">>", "<", "|", "||", "&", "&&", ";", "2>", "2>&1"}


def argv_of(command: DocCommand, variables: dict[str, str]) -> list[str]:
    """The words of ``command``'s first program, up to a redirection or another program, with
    ``$NAME`` / ``${NAME}`` expanded from ``variables``."""
    lexer = shlex.shlex(command.text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = []
    for word in lexer:
        if word in _OPERATORS:
            break
        expanded = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?",
                          lambda m: variables.get(m.group(1), m.group(0)), word)
        # An unquoted variable splits into words, as the shell does.
        words.extend(expanded.split() if expanded != word and "$" in word else [expanded])
    return words


# --- what cannot run here ------------------------------------------------------------------

NOT_RUNNABLE: dict[tuple[str, str], str] = {
    ("README.md", "make demo"):
        "creates .venv and installs torch and ftlm from PyPI (network); the environment the "
        "other commands run in is that .venv, and its data is what `prepared` builds",
    ("README.md", "make test"): "runs the whole suite, this test among it",
    ("README.md", "ftlm launch local examples/chaos.toml"):
        "run as written, under chaos, by tests/examples/test_examples.py (the script's own "
        "--steps must match the config's, which this test's shrinking breaks)",
    ("README.md", "source .venv/bin/activate"):
        "activation puts .venv/bin first on PATH; the commands here run with this "
        "interpreter's bin directory first on PATH, which is the same",
    ("docs/hsdp.md", "export FTLM_COORDINATOR=http://coordinator.example:29510"):
        "a group of a job whose coordinator runs on another machine (coordinator.example)",
    ("docs/hsdp.md", "export FTLM_GROUPS=4"): "part of that same cluster example",
    ("docs/hsdp.md", "torchrun --standalone --nnodes 1 --nproc-per-node 8"):
        "8 GPUs (configs/hsdp_8gpu.toml) and the coordinator above; parsed and validated in the "
        "default tier",
    ("docs/kubernetes.md", "docker "): "Docker and a container registry",
    ("docs/kubernetes.md", "kubectl "): "a Kubernetes cluster",
    ("docs/kubernetes.md", "TOKEN=$(kubectl"): "a Kubernetes cluster",
    ("docs/kubernetes.md", "curl -s -H \"Authorization: Bearer $TOKEN\" localhost:29510"):
        "the port-forward of a Kubernetes cluster's coordinator",
    ("docs/slurm.md", "python3 -m venv /shared/ftlm/.venv"):
        "a shared file system at /shared and PyPI (network)",
    ("docs/slurm.md", "/shared/ftlm/.venv/bin/pip install"):
        "a shared file system at /shared and PyPI (network)",
    ("docs/slurm.md", "ftlm launch slurm configs/hsdp_8gpu.toml --out /shared/jobs/big"):
        "writes to /shared, outside the working directory; parsed and validated in the default "
        "tier, and the same generator runs in README.md's `ftlm launch slurm`",
    ("docs/slurm.md", "/shared/jobs/big/submit-all.sh"): "a Slurm cluster (sbatch)",
    ("docs/slurm.md", "squeue "): "a Slurm cluster",
    ("docs/slurm.md", "tail -f /shared/jobs/big/logs"): "a Slurm job's logs (and never ends)",
    ("docs/slurm.md", "TOKEN=$(cat /shared/jobs/big/token)"): "a Slurm job's files",
    ("docs/slurm.md", "curl -s -H \"Authorization: Bearer $TOKEN\" \"$(cat /shared"):
        "a Slurm job's coordinator",
    ("docs/slurm.md", "scancel "): "a Slurm cluster",
    ("docs/inference.md", "ftlm verifier head runs/sft-small"):
        "fits a head on the policy's right and wrong samples; the prepared runs/sft (SFT shrunk "
        "to 4 steps) answers none right, and a head needs both (the 300-step SFT of "
        "docs/post-training.md does); parsed in the default tier",
    ("docs/inference.md", "ftlm generate runs/sft --chat --tasks 200 -n 16 --strategy best-of-n "
                          "--scorer verifier --verifier runs/sft-small --verifier-head"):
        "reads runs/head.json, which the head command above writes",
    ("docs/inference.md", "ftlm serve runs/sft --verifier runs/sft-small --verifier-head"):
        "reads runs/head.json, which the head command above writes",
    ("docs/post-training.md", "ftlm train configs/tiny.toml --set run.dir=runs/1b"):
        "the 1b shape: about 20 GB of float32 weights and AdamW state, a GPU's worth; parsed "
        "and validated in the default tier",
    ("README.md", "with Session(model, optimizer"):
        "a fragment of examples/hf_causal_lm.py, which tests/examples runs whole under chaos",
    ("docs/api.md", "from ftlm.train import Session"):
        "the call order around a user's model, optimizer and data (names the block leaves to "
        "the reader); examples/hf_causal_lm.py is that loop whole, run by tests/examples",
    ("docs/api.md", "for step in session:"):
        "the loop of the first block with StepDoomed caught (names it leaves to the reader); "
        "tests/train/test_doomed_step.py runs such a loop whole",
    ("docs/post-training.md", "python -m bench.lifecycle"):
        "the lifecycle benchmark: an hour and more of CPU per setting (`make lifecycle`); its "
        "stages are this page's own commands, which run here",
}


def not_runnable(command: DocCommand) -> str:
    """Why ``command`` cannot run here, or '' when it can."""
    for (doc, prefix), reason in NOT_RUNNABLE.items():
        if command.doc == doc and command.text.startswith(prefix):
            return reason
    return ""


# --- how a command is shrunk -----------------------------------------------------------------

SHRINK: tuple[tuple[tuple[str, ...], str, tuple[str, ...]], ...] = (
    # (the command's first words, a flag it must show ('' for any), what is appended)
    (("ftlm", "train"), "", ("--set", "train.steps=4", "--set", "train.batch_size=2")),
    (("ftlm", "launch", "local"), "", ("--set", "train.steps=6")),
    (("torchrun",), "", ("--set", "train.steps=4")),
    (("ftlm", "sft"), "", ("--set", "train.steps=4", "--set", "train.batch_size=4")),
    (("ftlm", "dpo"), "", ("--set", "train.steps=4")),
    (("ftlm", "grpo"), "", ("--set", "train.steps=2", "--set", "train.batch_size=2",
                            "--set", "post.group_size=2", "--set", "post.max_new_tokens=24")),
    # A 4-step model samples no correct answer: the fallback keeps the shrunk run from ending empty.
    (("ftlm", "pairs"), "", ("--set", "post.train_tasks=4", "--set", "post.max_new_tokens=24",
                             "--solution-fallback")),
    (("ftlm", "eval"), "", ("--n", "4", "--max-new-tokens", "24")),
    (("ftlm", "generate"), "--tasks", ("--tasks", "2")),
    (("ftlm", "generate"), "", ("--max-new-tokens", "24")),
    # A shrunk --n labels a few rows (packed 512 tokens each): all of them train, none held out.
    (("ftlm", "verifier", "train"), "", ("--n", "24", "--samples", "2", "--max-new-tokens", "24",
                                         "--set", "train.steps=4", "--set", "train.batch_size=2",
                                         "--set", "data.eval_samples=0",
                                         "--set", "train.eval_every=0")),
    (("ftlm", "verifier", "head"), "", ("--n", "4", "--samples", "4", "--max-new-tokens", "24")),
    (("ftlm", "tasks", "write"), "--n", ("--n", "40")),
    (("ftlm", "sim", "check"), "", ("--seeds", "3", "--steps", "30")),
    (("ftlm", "simulate"), "--sweep", ("--runs", "2")),
)


def with_flags(text: str, flags: list[str]) -> str:
    """``text`` with ``flags`` added to ftlm's own arguments: before a ``-- SCRIPT ...`` part,
    which belongs to the script."""
    if " -- " in text:
        own, script = text.split(" -- ", 1)
        return " ".join([own, *flags, "--", script])
    return " ".join([text, *flags])


def shrink_flags(argv: list[str]) -> list[str]:
    flags: list[str] = []
    for head, needs, extra in SHRINK:
        if tuple(argv[:len(head)]) == head and (not needs or needs in argv):
            flags.extend(extra)
    return flags


# --- default tier: parse and validate ------------------------------------------------------


def _ftlm_argv(argv: list[str]) -> list[str] | None:
    """The arguments of ``ftlm`` in ``argv`` (also behind ``torchrun ... -m ftlm.cli``)."""
    if argv and argv[0] == "ftlm":
        return argv[1:]
    if argv and argv[0] == "torchrun" and "ftlm.cli" in argv:
        return argv[argv.index("ftlm.cli") + 1:]
    return None


def test_commands_are_found_in_the_docs():
    assert any(c.doc == "README.md" for c in ALL_COMMANDS)
    assert any(c.python for c in ALL_COMMANDS)
    assert len([c for c in ALL_COMMANDS if _ftlm_argv(shlex.split(c.text) if not c.python
                                                      else []) is not None]) > 40


def test_each_not_runnable_entry_matches_a_command():
    stale = [key for key in NOT_RUNNABLE
             if not any(c.doc == key[0] and c.text.startswith(key[1]) for c in ALL_COMMANDS)]
    assert not stale, f"NOT_RUNNABLE entries that match no command of their doc: {stale}"


def test_every_ftlm_command_parses_and_its_config_loads(monkeypatch):
    from ftlm.cli import build_parser
    from ftlm.config import load_config
    from ftlm.errors import FtlmError

    monkeypatch.chdir(ROOT)  # the configs the docs name are the repository's configs/
    parser = build_parser()
    problems = []
    variables: dict[str, str] = {}
    doc = ""
    for command in ALL_COMMANDS:
        if command.doc != doc:
            doc, variables = command.doc, {}
        if command.python:
            continue
        if is_assignment(command):
            name, value = command.text.split("=", 1)
            variables[name] = " ".join(shlex.split(value)) if "$(" not in value else value
            continue
        argv = _ftlm_argv(argv_of(command, variables))
        if argv is None:
            continue
        # `ftlm launch local ... -- SCRIPT`: what follows `--` is the script's (as ftlm.cli splits it).
        argv = argv[:argv.index("--")] if "--" in argv else argv
        # As written, and as the slow tier runs it (its shrinking flags must be valid too).
        for extra in ([], shrink_flags(["ftlm", *argv])):
            try:
                args = parser.parse_args(argv + extra)
            except SystemExit:
                problems.append(f"{command} {' '.join(extra)}: does not parse (argparse's "
                                "message above)")
                continue
            if getattr(args, "overrides", None) is not None and getattr(args, "config", None):
                try:
                    load_config(args.config, args.overrides)
                except FtlmError as e:
                    problems.append(f"{command} {' '.join(extra)}: {e}")
    assert not problems, "\n".join(problems)


def test_every_python_block_compiles():
    for command in ALL_COMMANDS:
        if command.python:
            compile(command.text, str(command), "exec")


def test_python_blocks_that_need_no_server_run(tmp_path, monkeypatch):
    """A block that talks to no server (no URL in it) needs nothing the slow tier prepares."""
    monkeypatch.chdir(tmp_path)
    blocks = [c for c in ALL_COMMANDS if c.python and "://" not in c.text and not not_runnable(c)]
    assert blocks
    for command in blocks:
        exec(compile(command.text, str(command), "exec"), {"__name__": "__doc_block__"})


# --- slow tier: run them --------------------------------------------------------------------

SERVERS = (("ftlm", "serve"), ("ftlm", "coordinator"))
SERVER_DEFAULT_PORT = {("ftlm", "serve"): 8000, ("ftlm", "coordinator"): 29510}
COMMAND_TIMEOUT_S = 900.0
SERVER_READY_S = 180.0


def _environment() -> dict[str, str]:
    """A user's shell after ``source .venv/bin/activate``: this interpreter's bin directory first
    on PATH, no job variables inherited from whoever runs the tests."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTLM_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _port_of(argv: list[str], head: tuple[str, ...]) -> int:
    if "--port" in argv:
        return int(argv[argv.index("--port") + 1])
    return SERVER_DEFAULT_PORT[head]


def _listening(port: int) -> bool:
    with contextlib.closing(socket.socket()) as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


class _Server:
    """A server command in the background, its process group stopped by ``stop``."""

    def __init__(self, command: DocCommand, script: str, cwd: Path, port: int, log: Path):
        if _listening(port):
            pytest.fail(f"{command}: port {port} is taken by another process on this machine")
        self.command, self.port = command, port
        self.log = log.open("w")
        self.proc = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=_environment(),
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + SERVER_READY_S
        while not _listening(port):
            if self.proc.poll() is not None:
                self.stop()
                pytest.fail(f"{command}: exited {self.proc.returncode} before listening:\n"
                            f"{log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"{command}: not listening on port {port} after {SERVER_READY_S} s")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.log.close()


def run_doc(doc: str, workdir: Path) -> list[str]:
    """Run ``doc``'s commands in order in ``workdir``; return what was not run and why."""
    commands = [c for c in ALL_COMMANDS if c.doc == doc]
    assignments: list[str] = []
    variables: dict[str, str] = {}
    skipped: list[str] = []
    server: _Server | None = None
    logs = workdir / ".doc-logs"
    logs.mkdir(exist_ok=True)
    try:
        for n, command in enumerate(commands):
            reason = not_runnable(command)
            if reason:
                skipped.append(f"{command}: {reason}")
                continue
            log = logs / f"{n:03d}.log"
            if command.python:
                script = logs / f"{n:03d}.py"
                script.write_text(command.text)
                argv = [sys.executable, str(script)]
            elif is_assignment(command):
                assignments.append(command.text)
                name, value = command.text.split("=", 1)
                variables[name] = " ".join(shlex.split(value))
                continue
            else:
                words = argv_of(command, variables)
                text = with_flags(command.text, list(map(shlex.quote, shrink_flags(words))))
                head = next((h for h in SERVERS if tuple(words[:len(h)]) == h), None)
                if head is not None:
                    if server is not None:
                        server.stop()
                    server = _Server(command, "\n".join([*assignments, f"exec {text}"]),
                                     workdir, _port_of(words, head), log)
                    continue
                argv = ["bash", "-c", "\n".join([*assignments, text])]
            with log.open("w") as out:
                try:
                    done = subprocess.run(argv, cwd=workdir, env=_environment(), stdout=out,
                                          stderr=subprocess.STDOUT, timeout=COMMAND_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"{command}: still running after {COMMAND_TIMEOUT_S} s")
            if done.returncode != 0:
                pytest.fail(f"{command}: exit status {done.returncode}:\n"
                            f"{log.read_text()[-6000:]}")
    finally:
        if server is not None:
            server.stop()
    return skipped


def _doc_command(doc: str, prefix: str) -> DocCommand:
    return next(c for c in ALL_COMMANDS if c.doc == doc and c.text.startswith(prefix))


def _run_one(command: DocCommand, cwd: Path, extra: tuple[str, ...] = ()) -> None:
    text = " ".join([command.text, *extra])
    done = subprocess.run(["bash", "-c", text], cwd=cwd, env=_environment(), capture_output=True,
                          text=True, timeout=COMMAND_TIMEOUT_S)
    assert done.returncode == 0, f"preparing with {command}: {done.stdout[-3000:]}{done.stderr[-3000:]}"


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The working directory the docs' commands expect, built once:

    * ``configs/`` and ``deploy/``: the repository's own;
    * ``data/demo``: the demo corpus and tokenizer exactly as ``make demo`` (``ftlm demo``)
      builds them, which ``configs/*.toml`` read;
    * ``my_corpus/``: the demo corpus's text files, standing in for "your own data" (README);
    * ``path/to/hf-llama``, ``path/to/Llama-3.2-1B``: a random 2-layer ``transformers`` Llama,
      standing in for a downloaded Hugging Face folder (nothing is downloaded);
    * ``runs/tiny``: README's quick-tour pretraining, run as written (200 steps): the other pages
      start from it and name its final checkpoint, ``step-00000200``;
    * ``runs/sft``: docs/post-training.md's SFT command from it (shrunk as in ``SHRINK``), the
      model docs/inference.md serves;
    * ``runs/demo``: what ``make demo`` leaves (``ftlm demo``, for 20 s instead of 120 s:
      ``--seconds``), the run docs/goodput.md calibrates against.
    """
    transformers = pytest.importorskip("transformers")
    import torch

    from ftlm.data.demo import ensure_demo_data

    root = tmp_path_factory.mktemp("docs-env")
    for name in ("configs", "deploy"):
        shutil.copytree(ROOT / name, root / name)
    data = ensure_demo_data(root / "data" / "demo", seq_len=128, vocab_size=4096, progress=False)
    shutil.copytree(data / "corpus", root / "my_corpus")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config)
    for folder in ("path/to/hf-llama", "path/to/Llama-3.2-1B"):
        model.save_pretrained(root / folder)
    _run_one(_doc_command("README.md", "ftlm train configs/tiny.toml --set train.steps=200"), root)
    sft = _doc_command("docs/post-training.md", "ftlm sft configs/tiny.toml")
    _run_one(sft, root, tuple(shrink_flags(shlex.split(sft.text))))
    _run_one(DocCommand("tests/test_docs_commands.py", 0, "ftlm demo --seconds 20"), root)
    return root


RUNNABLE_DOCS = sorted({c.doc for c in ALL_COMMANDS if not not_runnable(c)
                        and not is_assignment(c)})


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("doc", RUNNABLE_DOCS)
def test_doc_commands_run_as_written(doc: str, prepared: Path, tmp_path: Path):
    workdir = tmp_path / "work"
    shutil.copytree(prepared, workdir, symlinks=True)
    skipped = run_doc(doc, workdir)
    # What was not run is listed with its reason in NOT_RUNNABLE; say so in the test's output.
    for line in skipped:
        print(f"not run: {line}")
