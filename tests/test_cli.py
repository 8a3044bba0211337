"""The ``ftlm`` command: help of every subcommand, one-line errors, train/report/prepare end to end.

Most tests call ``ftlm.cli.main`` in-process (fast); one runs the real entry point in a
subprocess to check the exit status and that errors come without a traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftlm.cli import main
from ftlm.data.loader import PackedDataset
from ftlm.data.tokenizer import Tokenizer

SUBCOMMANDS = [
    ["demo"], ["train"], ["coordinator"], ["launch"], ["launch", "local"], ["data"],
    ["data", "prepare"], ["tokenizer"], ["tokenizer", "train"], ["report"], ["run"],
]
CONFIG_COMMANDS = [["train"], ["coordinator"], ["launch", "local"]]
"""Commands that read a run config and so accept ``--set`` overrides."""

TINY_TOML = """
[model]
size = "tiny"
vocab_size = 1024
dim = 64
n_layers = 2
n_heads = 4
n_kv_heads = 2
ffn_dim = 128
max_seq_len = 64

[data]
seq_len = 64

[train]
steps = 50
batch_size = 4
threads = 1
warmup_steps = 2

[observe]
progress = false
"""


def _run(argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)`` with stdout/stderr captured; argparse's SystemExit becomes the code."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("words", SUBCOMMANDS, ids=" ".join)
def test_every_subcommand_has_help(words: list[str]) -> None:
    code, out, _ = _run(words + ["--help"])
    assert code == 0
    assert out.startswith(f"usage: ftlm {' '.join(words)}")
    if words in CONFIG_COMMANDS:
        assert "--set SECTION.KEY=VALUE" in out


def test_top_level_help_lists_the_commands() -> None:
    code, out, _ = _run(["--help"])
    assert code == 0
    for name in ("demo", "train", "coordinator", "launch", "data", "tokenizer", "report"):
        assert name in out


def test_missing_config_file_is_a_one_line_error(tmp_path: Path) -> None:
    missing = tmp_path / "absent.toml"
    code, out, err = _run(["train", str(missing)])
    assert code == 2
    assert err.startswith("ftlm: error:") and str(missing) in err
    assert err.count("\n") == 1 and out == ""


def test_bad_override_is_a_one_line_error(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY_TOML)
    code, _, err = _run(["train", str(cfg), "--set", "train.steps=abc"])
    assert code == 2
    assert err.startswith("ftlm: error:") and "train.steps='abc'" in err


def test_report_of_a_directory_without_a_run(tmp_path: Path) -> None:
    code, _, err = _run(["report", str(tmp_path)])
    assert code == 2
    assert err.startswith("ftlm: error:") and str(tmp_path / "summary.json") in err


@pytest.mark.parametrize("fault", ["StaleIncarnation", "TooManyFailures", "TransferError"])
def test_a_fault_exits_as_a_crash_to_be_restarted_not_as_bad_input(fault, tmp_path, monkeypatch):
    """A group declared hung during its start-up (a loaded machine) used to exit with status 2,
    which the launcher reads as "cannot start": it stopped the whole job instead of restarting."""
    import ftlm.cli
    from ftlm.ft import group, quorum, transport
    error = {"StaleIncarnation": quorum.StaleIncarnation, "TooManyFailures": group.TooManyFailures,
             "TransferError": transport.TransferError}[fault]

    def fails(args):
        raise error("replica g2:abc was replaced or declared hung; this process must exit")
    monkeypatch.setattr(ftlm.cli, "cmd_report", fails)
    code, _, err = _run(["report", str(tmp_path)])
    assert code == 1
    assert err.startswith("ftlm: error: replica g2:abc was replaced")


def test_a_group_retired_for_failing_its_steps_exits_with_its_own_status(tmp_path, monkeypatch):
    """The coordinator retired the group for failing every step it took part in (a bad link or
    device, ``quorum.Convicted``): status 3, which a launcher counts as retired, not as a crash,
    without reading the group's log; the error line stays for people."""
    import ftlm.cli
    from ftlm.errors import EXIT_RETIRED
    from ftlm.ft.quorum import Convicted

    def fails(args):
        raise Convicted("replica g2:abc was retired: its link fails the steps it takes part in; "
                        "this process must exit")
    monkeypatch.setattr(ftlm.cli, "cmd_report", fails)
    code, _, err = _run(["report", str(tmp_path)])
    assert code == EXIT_RETIRED == 3
    assert err.startswith("ftlm: error: replica g2:abc was retired")


def test_entry_point_exit_status_and_no_traceback(tmp_path: Path) -> None:
    missing = tmp_path / "absent.toml"
    env = {k: v for k, v in os.environ.items() if k != "FTLM_COORDINATOR"}
    proc = subprocess.run([sys.executable, "-m", "ftlm.cli", "train", str(missing)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert proc.stderr.startswith("ftlm: error:") and str(missing) in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def cli_run(demo_data: Path, tmp_path_factory) -> tuple[Path, str]:
    """(run dir, stdout) of ``ftlm train CONFIG --set train.steps=5 --set run.dir=...``."""
    root = tmp_path_factory.mktemp("cli")
    cfg = root / "tiny.toml"
    cfg.write_text(TINY_TOML)
    run_dir = root / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("FTLM_COORDINATOR", raising=False)
        code, out, err = _run(["train", str(cfg), "--set", "train.steps=5",
                               "--set", f"run.dir={run_dir}", "--set", f"data.dir={demo_data}"])
    assert code == 0, err
    return run_dir, out


def test_train_writes_summary_and_report_and_prints_the_headline(cli_run) -> None:
    run_dir, out = cli_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_committed"] == 5  # the --set beat the file's steps = 50
    assert summary["replicas_identical"] is True
    assert summary["config"]["run"]["dir"] == str(run_dir)
    assert (run_dir / "report.md").is_file() and (run_dir / "config.toml").is_file()
    assert "5 steps committed" in out


def test_report_rewrites_the_report_and_prints_the_headline(cli_run) -> None:
    run_dir, _ = cli_run
    (run_dir / "report.md").unlink()
    code, out, _ = _run(["report", str(run_dir)])
    assert code == 0
    assert "5 steps committed (0 failed)" in out
    assert "replicas identical: single group" in out
    assert f"report written to {run_dir / 'report.md'}" in out
    assert (run_dir / "report.md").is_file()


def test_tokenizer_train_then_data_prepare(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = "the quick brown fox jumps over the lazy dog while seven wizards quietly hex".split()
    for i in range(6):
        text = "\n".join(" ".join(words[(i + j + k) % len(words)] for k in range(9))
                         for j in range(60))
        (corpus / f"doc{i}.txt").write_text(text, encoding="utf-8")
    tok_path = tmp_path / "tok" / "tokenizer.json"
    tok_path.parent.mkdir()

    code, out, err = _run(["tokenizer", "train", str(corpus), "--out", str(tok_path),
                           "--vocab-size", "300"])
    assert code == 0, err
    tok = Tokenizer.load(tok_path)
    assert 256 < tok.vocab_size <= 300
    assert str(tok_path) in out

    data_dir = tmp_path / "prepared"
    code, out, err = _run(["data", "prepare", str(corpus), "--out", str(data_dir),
                           "--tokenizer", str(tok_path), "--seq-len", "16", "--workers", "1"])
    assert code == 0, err
    manifest = json.loads((data_dir / "manifest.json").read_text())
    assert manifest["seq_len"] == 16 and manifest["num_samples"] > 0
    assert manifest["tokenizer_fingerprint"] == tok.fingerprint
    assert f"{manifest['num_samples']} samples of 16 tokens" in out
    dataset = PackedDataset(data_dir, 16, tok.fingerprint)
    assert len(dataset) == manifest["num_samples"]


def test_data_prepare_of_missing_input_is_a_one_line_error(tmp_path: Path,
                                                           demo_data: Path) -> None:
    code, _, err = _run(["data", "prepare", str(tmp_path / "nothing"), "--out",
                         str(tmp_path / "out"), "--tokenizer", str(demo_data / "tokenizer.json")])
    assert code == 2
    assert err.startswith("ftlm: error:") and str(tmp_path / "nothing") in err


# --- bad input from outside: one-line errors, never a traceback -----------------------------

def _one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    """Exit status 2 and one error line; only a progress bar (data prepare) may come before it."""
    assert code == 2, (out, err)
    before, _, line = err.rstrip("\n").rpartition("\n")
    assert line.startswith("ftlm: error:") and "ftlm: error:" not in before, err
    assert before.replace("\r", "\n").strip() == "" or " doc" in before or "doc/s" in before, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("override, needle", [
    ("train.lr=inf", "train.lr=inf must be a finite number > 0"),
    ("train.eps=nan", "train.eps=nan must be a finite number > 0"),
    ("train.beta1=-0.5", "train.beta1=-0.5 must be a finite number in [0, 1)"),
    ("model.norm_eps=inf", "model.norm_eps=inf must be a finite positive number"),
    ("ft.allreduce_timeout=inf", "ft.allreduce_timeout=inf must be a finite number of seconds"),
])
def test_non_finite_overrides_are_one_line_errors(tmp_path: Path, override: str,
                                                  needle: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY_TOML)
    _one_line_error(*_run(["train", str(cfg), "--set", override]), needle)


def test_non_utf8_config_file_is_a_one_line_error(tmp_path: Path) -> None:
    cfg = tmp_path / "latin1.toml"
    cfg.write_bytes(TINY_TOML.encode() + "# r\xe9sum\xe9\n".encode("latin-1"))
    line = TINY_TOML.count("\n") + 1
    _one_line_error(*_run(["train", str(cfg)]), str(cfg), "UTF-8", f"0xe9 on line {line}")


def test_missing_data_folder_is_named_as_such(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY_TOML)
    missing = tmp_path / "nonexistent"
    code, out, err = _run(["train", str(cfg), "--set", f"data.dir={missing}",
                           "--set", f"run.dir={tmp_path / 'run'}"])
    _one_line_error(code, out, err, f"data folder {missing} (data.dir) does not exist",
                    "ftlm data prepare")
    assert "tokenizer" not in err.lower().replace("--tokenizer tokenizer", "")


def test_manifest_pointing_outside_the_data_folder_is_refused(tmp_path: Path,
                                                             demo_data: Path) -> None:
    import shutil

    data = tmp_path / "data"
    shutil.copytree(demo_data, data, ignore=shutil.ignore_patterns("corpus"))
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["shards"][0]["file"] = "../../etc/passwd"
    (data / "manifest.json").write_text(json.dumps(manifest))
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY_TOML)
    code, out, err = _run(["train", str(cfg), "--set", f"data.dir={data}",
                           "--set", f"run.dir={tmp_path / 'run'}"])
    _one_line_error(code, out, err, "shards[0].file='../../etc/passwd'",
                    "relative path inside the data folder")


def _latin1_and_surrogate_inputs(root: Path) -> list[tuple[Path, str]]:
    latin1 = root / "latin1.jsonl"
    latin1.write_bytes(b'{"text": "one"}\n{"text": "caf\xe9"}\n')
    surrogate = root / "surrogate.jsonl"
    surrogate.write_text('{"text": "lone \\ud83d here"}\n', encoding="utf-8")
    return [(latin1, "latin1.jsonl:2: not valid UTF-8"),
            (surrogate, "surrogate.jsonl:1: field 'text' holds a lone surrogate")]


def test_data_prepare_of_malformed_jsonl_is_a_one_line_error(tmp_path: Path,
                                                            demo_data: Path) -> None:
    for path, needle in _latin1_and_surrogate_inputs(tmp_path):
        out = tmp_path / f"out-{path.stem}"
        _one_line_error(*_run(["data", "prepare", str(path), "--out", str(out), "--tokenizer",
                               str(demo_data / "tokenizer.json")]), needle, "UTF-8")
        assert not out.exists()


def test_tokenizer_train_on_malformed_jsonl_is_a_one_line_error(tmp_path: Path) -> None:
    for path, needle in _latin1_and_surrogate_inputs(tmp_path):
        out = tmp_path / f"tok-{path.stem}.json"
        _one_line_error(*_run(["tokenizer", "train", str(path), "--out", str(out),
                               "--vocab-size", "300"]), needle)
        assert not out.exists()


def test_data_prepare_of_an_empty_folder_creates_nothing(tmp_path: Path, demo_data: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    code, stdout, err = _run(["data", "prepare", str(empty), "--out", str(out), "--tokenizer",
                              str(demo_data / "tokenizer.json")])
    _one_line_error(code, stdout, err, f"no .txt files found in {empty}")
    assert not out.exists()


def test_entry_point_prints_malformed_jsonl_without_a_traceback(tmp_path: Path,
                                                               demo_data: Path) -> None:
    path, needle = _latin1_and_surrogate_inputs(tmp_path)[0]
    proc = subprocess.run([sys.executable, "-m", "ftlm.cli", "data", "prepare", str(path),
                           "--out", str(tmp_path / "out"), "--tokenizer",
                           str(demo_data / "tokenizer.json")],
                          capture_output=True, text=True, timeout=120)
    _one_line_error(proc.returncode, proc.stdout, proc.stderr, needle)


def test_resumed_run_reports_ett_of_at_most_one(tmp_path: Path, demo_data: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY_TOML)
    run_dir = tmp_path / "run"
    common = ["--set", f"run.dir={run_dir}", "--set", f"data.dir={demo_data}",
              "--set", "checkpoint.every=2", "--set", "checkpoint.async_save=false"]
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("FTLM_COORDINATOR", raising=False)
        code, _, err = _run(["train", str(cfg), "--set", "train.steps=4", *common])
        assert code == 0, err
        first = json.loads((run_dir / "summary.json").read_text())
        code, _, err = _run(["train", str(cfg), "--set", "train.steps=8", *common])
        assert code == 0, err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_committed"] == 8
    assert 0 < summary["ett"] <= 1.0, summary
    # The resumed run's wall time covers both incarnations, not only the second.
    assert summary["wall_seconds"] >= first["wall_seconds"]
    again = summary["tokens_committed"] / (summary["wall_seconds"]
                                           * summary["steady_tokens_per_second"])
    assert summary["ett"] == pytest.approx(again, rel=2e-3)


def test_coordinator_command_serves_with_the_token_and_appends_its_events(tmp_path: Path) -> None:
    """``ftlm coordinator CONFIG --events PATH``: what ``launch local`` runs as its own process."""
    import signal
    import time
    import urllib.error
    import urllib.request

    cfg = tmp_path / "c.toml"
    cfg.write_text("[ft]\nheartbeat_interval = 0.05\nheartbeat_timeout = 0.5\n"
                   "allreduce_timeout = 1.0\nquorum_timeout = 5.0\ngive_up_seconds = 10.0\n")
    events = tmp_path / "events.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "ftlm.cli", "coordinator", str(cfg), "--port", "0",
                             "--events", str(events)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "FTLM_TOKEN": "s3cret"})
    try:
        line = proc.stdout.readline()  # "ftlm coordinator listening on http://127.0.0.1:PORT ..."
        url = line.split(" on ")[1].split()[0]

        def call(path: str, body: dict | None = None, token: str = "s3cret") -> tuple[int, dict]:
            req = urllib.request.Request(url + path, data=json.dumps(body).encode() if body else None,
                                         headers={"Authorization": f"Bearer {token}",
                                                  "Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return resp.status, json.loads(resp.read())
            except urllib.error.HTTPError as e:
                return e.code, {}

        assert call("/status", token="wrong")[0] == 401
        assert call("/v1/heartbeat", {"group": "g0", "incarnation": "a1", "step": 0,
                                      "quorum_id": -1})[0] == 200
        code, status = call("/status")
        assert code == 200 and [m["replica_id"] for m in status["members"]] == ["g0:a1"]
        # g0 stops heartbeating: the coordinator declares it dead, in the run's event log.
        deadline = time.monotonic() + 30
        dead: list[dict] = []
        while not dead and time.monotonic() < deadline:
            time.sleep(0.1)
            if events.is_file():
                dead = [json.loads(x) for x in events.read_text().splitlines()
                        if '"member_dead"' in x]
        assert dead and dead[0]["group"] == "coordinator" and dead[0]["target"] == "g0"
        assert dead[0]["replica_id"] == "g0:a1"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("world", ["1", "2"])
def test_a_sigterm_during_set_up_ends_a_lone_rank_and_is_noted_by_a_rank_of_a_group(world, monkeypatch):
    """A group of one rank exits at once (status 0: it has not joined). A rank of a larger group
    must not leave its peers waiting in the set-up's collectives: it notes the request, which the
    trainer takes over (``test_trainer``: it stops at its first step)."""
    import signal

    from ftlm.cli import _exit_on_sigterm_during_setup
    monkeypatch.setenv("WORLD_SIZE", world)
    exits: list[int] = []
    monkeypatch.setattr("ftlm.cli.os._exit", exits.append)
    before = signal.getsignal(signal.SIGTERM)
    try:
        _exit_on_sigterm_during_setup()
        handler = signal.getsignal(signal.SIGTERM)
        assert handler.requested is False
        handler(signal.SIGTERM, None)
        assert (exits, handler.requested) == (([0], False) if world == "1" else ([], True))
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_relaunched_train_continues_its_record_without_a_gap_across_the_pause(
        demo_data: Path, tmp_path: Path, monkeypatch) -> None:
    """The last step is always saved: a second ``ftlm train`` with more steps resumes there and
    continues the record. Each run marks its start (``run_start``), so the time between the two
    is neither a gap between commits nor a stall."""
    import time
    monkeypatch.delenv("FTLM_COORDINATOR", raising=False)
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_TOML)
    run_dir = tmp_path / "run"
    for steps in (3, 6):
        code, _, err = _run(["train", str(cfg), "--set", f"train.steps={steps}",
                             "--set", f"run.dir={run_dir}", "--set", f"data.dir={demo_data}"])
        assert code == 0, err
        if steps == 3:
            time.sleep(3.0)  # the pause between the two runs
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    starts = [e for e in events if e["kind"] == "run_start"]
    assert [s["resume_from"] for s in starts] == [None, 3]
    assert sorted(e["step"] for e in events if e["kind"] == "commit") == list(range(6))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["data"]["duplicates"] == 0 and summary["data"]["gaps"] == 0
    commits = {e["step"]: e["ts"] for e in events if e["kind"] == "commit"}
    across = commits[3] - commits[2]  # the pause, a process start-up and a checkpoint load
    assert across >= 3.0
    assert summary["timeline"]["max_commit_gap_seconds"] < across, summary["timeline"]


# -- ftlm run SCRIPT: a user's own training loop -----------------------------------------------

def _script(tmp_path: Path, body: str, name: str = "my_train.py") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def test_run_executes_the_script_as_main_with_its_arguments_and_its_folder_on_the_path(
        tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the command sets both, as python does
    monkeypatch.setattr(sys, "path", list(sys.path))
    _script(tmp_path, "WHERE = 'next to the script'\n", name="my_helpers.py")
    seen = tmp_path / "seen.json"
    script = _script(tmp_path, f"""
import json, sys
import my_helpers
json.dump({{"name": __name__, "argv": sys.argv, "helper": my_helpers.WHERE}}, open({str(seen)!r}, "w"))
""")
    code, _, err = _run(["run", str(script), "--lr", "3e-3", "--", "x"])
    assert code == 0, err
    assert json.loads(seen.read_text()) == {
        "name": "__main__", "argv": [str(script), "--lr", "3e-3", "--", "x"],
        "helper": "next to the script"}


@pytest.mark.parametrize("body, status, line", [
    ("pass", 0, ""),
    ("import sys; sys.exit(5)", 5, ""),
    ("import sys; sys.exit('no GPU here')", 1, "no GPU here"),
    ("from ftlm.errors import ConfigError; raise ConfigError('train.steps=0 must be >= 1')", 2,
     "ftlm: error: train.steps=0 must be >= 1"),
    ("from ftlm.errors import FaultError; raise FaultError('no quorum within 30 s')", 1,
     "ftlm: error: no quorum within 30 s"),
], ids=["ends", "sys.exit(5)", "sys.exit(message)", "bad input", "fault"])
def test_run_exits_with_the_scripts_status_and_ftlm_errors_as_every_command_does(
        tmp_path, monkeypatch, body, status, line):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    code, _, err = _run(["run", str(_script(tmp_path, body + "\n"))])
    assert code == status
    assert err.strip().splitlines()[-1:] == ([line] if line else []), err


def test_run_of_a_missing_script_is_a_one_line_error(tmp_path):
    code, _, err = _run(["run", str(tmp_path / "nope.py"), "--lr", "1"])
    assert code == 2
    assert err.strip() == (f"ftlm: error: script {tmp_path / 'nope.py'} does not exist or is not a "
                           "file; give the path of a Python training script, e.g. ftlm run my_train.py")


@pytest.mark.parametrize("in_job", [False, True], ids=["alone", "group process"])
def test_run_as_a_group_process_beacons_from_the_start_and_exits_without_the_teardown(
        tmp_path, in_job):
    """What the launcher counts on from ``ftlm run``: the start-up beacon beats while the script
    runs (the watchdog reads it), and under a coordinator the process ends without the
    interpreter's teardown once the script returned (``cli._exit``), with the script's status."""
    beacon = tmp_path / "g0.r0.beacon"
    script = _script(tmp_path, f"""
import atexit, pathlib, sys, time
atexit.register(print, "interpreter teardown", flush=True)
beacon = pathlib.Path({str(beacon)!r})
def phase():
    try:
        return beacon.read_text().strip()
    except OSError:  # not written yet, or being replaced
        return ""
deadline = time.monotonic() + 30  # the beacon is rewritten every 0.5 s
while not phase().startswith("running") and time.monotonic() < deadline:
    time.sleep(0.05)
print("beacon:", phase(), flush=True)
sys.exit(7)
""")
    env = {k: v for k, v in os.environ.items() if k != "FTLM_COORDINATOR"}
    env["FTLM_STARTUP_BEACON"] = str(beacon)
    if in_job:  # never contacted: only its presence matters to the process's exit
        env["FTLM_COORDINATOR"] = "http://127.0.0.1:9"
    proc = subprocess.run([sys.executable, "-m", "ftlm.cli", "run", str(script)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 7, proc.stderr
    assert "beacon: running my_train.py" in proc.stdout
    assert ("interpreter teardown" in proc.stdout) is not in_job, proc.stdout


class _Launcher:
    """Stands in for ``LocalLauncher``: records what ``launch local`` passed it."""

    seen: dict = {}

    def __init__(self, config, **kwargs):
        _Launcher.seen = {"config": config, **kwargs}

    def run(self) -> dict:
        return {"problems": []}


def test_launch_local_passes_the_script_and_its_arguments_after_the_double_dash(tmp_path, monkeypatch):
    monkeypatch.setattr("ftlm.launch.local.LocalLauncher", _Launcher)
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_TOML)
    code, _, err = _run(["launch", "local", str(cfg), "--groups", "3", "--set", "train.steps=7",
                         "--", "my_train.py", "--lr", "1", "--", "--groups", "9"])
    assert code == 0, err
    seen = _Launcher.seen
    assert (seen["groups"], seen["config"].train.steps) == (3, 7)
    assert (seen["script"], seen["script_args"]) == ("my_train.py", ["--lr", "1", "--", "--groups", "9"])
    # No CONFIG with a script: the defaults apply (the script's Session reads them).
    code, _, err = _run(["launch", "local", "--groups", "1", "--", "my_train.py"])
    assert code == 0, err
    assert (_Launcher.seen["script"], _Launcher.seen["script_args"]) == ("my_train.py", [])
    # No script: every rank runs ftlm train CONFIG, as before.
    code, _, err = _run(["launch", "local", str(cfg)])
    assert code == 0, err
    assert (_Launcher.seen["script"], _Launcher.seen["script_args"]) == (None, [])


def test_launch_local_without_config_or_script_or_with_nothing_after_the_dashes_is_refused(
        tmp_path, monkeypatch):
    monkeypatch.setattr("ftlm.launch.local.LocalLauncher", _Launcher)
    _Launcher.seen = {}
    code, _, err = _run(["launch", "local", "--groups", "2"])
    assert code == 2
    assert err.strip() == ("ftlm: error: ftlm launch local needs a CONFIG (e.g. configs/tiny.toml), "
                           "a script after -- (e.g. -- my_train.py), or both")
    code, _, err = _run(["launch", "local", "--groups", "2", "--"])
    assert code == 2
    assert "nothing after --; give the script to run" in err
    assert _Launcher.seen == {}


def test_launch_local_help_documents_the_script_and_its_environment():
    code, out, _ = _run(["launch", "local", "--help"])
    assert code == 0
    assert out.startswith("usage: ftlm launch local [CONFIG] [options] [-- SCRIPT [ARGS ...]]")
    for word in ("ftlm run SCRIPT ARGS", "FTLM_CONFIG", "FTLM_RUN_DIR", "FTLM_RESULT", "events.jsonl"):
        assert word in out

