"""``make tts``: build every model of the test-time-scaling study, run it, write its section.

The models live under ``--workdir`` (default ``runs/tts``, from the repository root). Each is
taken back when an earlier run left it there finished with the same settings (``summary.json``
and ``model.safetensors``, the same ``[model]``, ``[train]`` and ``[post]``, every step
committed; training is deterministic, so a rerun makes the same models), trained again when that
run stopped early, and refused when its settings differ (remove it, or use another
``--workdir``):

1. ``policy``: the lifecycle's SFT recipe (``bench.lifecycle.FULL``: its tasks, learning rate,
   batch and sequence length, seed 0) at ``configs/tiny.toml``'s shape, trained from scratch for
   ``SFT_STEPS`` steps (``SIZES``).
2. ``policy-large``: the same at ``LARGE_SHAPE`` (about four times the policy's parameters) for
   ``LARGE_SFT_STEPS`` steps at ``LARGE_SFT_LR``.
3. ``verifier``: the same at ``VERIFIER_SHAPE`` (smaller than the policy), and its outcome head
   ``head.json`` (``ftlm verifier head``: policy samples of train tasks).
4. ``line-verifier``: ``ftlm verifier train`` from the verifier model on line labels of the
   policy's samples: the process verifier of beam search.
5. the study: ``bench.test_time_scaling`` with every strategy, the larger policy and the
   verifiers' training amortised; raw results to ``bench/results/test_time_scaling/study.json``,
   the models' recipe to ``models.md`` beside it, the section to BENCHMARKS.md.

``--quick`` runs the same steps at smoke sizes in a temporary folder (unless ``--workdir``)
and writes nothing outside it. It does not tune anything: the settings are the lifecycle's and
``STUDY``'s.

    python -m bench.tts_pipeline [--quick] [--workdir runs/tts] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO_ROOT, ensure_demo
from bench.lifecycle import FULL, QUICK, _config, _post_sections, _train, reusable

SFT_STEPS = 1000
"""SFT steps of the policy and the verifier model, chosen on validation tasks (200 train-split
additions of seed 999, 2026-12-05) for a policy whose one sample at temperature 0.8 lands in
20-50%: at 1000 steps 0.30 (greedy 0.59, any of 8 samples 0.70); at the lifecycle's 800, 0.135
greedy; at 1600, 0.975 greedy (no room left for choosing among samples)."""
LARGE_SFT_STEPS = 1600
LARGE_SFT_LR = 1.5e-3
"""The larger policy's SFT steps and learning rate: the policy's rate scaled by its width ratio
(128 / 256), which it needed: at 3e-3 it learned more slowly per step than the policy (0.33 of the
validation additions after 1600 steps); at 1.5e-3 faster. More steps than the policy, so that
the single sample it is measured by is a competent one; its training compute is reported
beside the policy's."""
SIZES = {**FULL, "sft_steps": SFT_STEPS}
"""The study's sizes: the lifecycle's (``FULL``) with ``SFT_STEPS``."""
LARGE_SIZES = {**SIZES, "sft_steps": LARGE_SFT_STEPS, "sft_lr": LARGE_SFT_LR}
LARGE_SHAPE = {"dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 1024}
"""The larger policy: 4.98M parameters at the demo vocabulary, 3.80 times the tiny policy's: its
four layers, twice as wide. Six layers at width 256 (5.18M, the earlier study's) learned far more
slowly at 3e-3: 0.085 of the validation additions after 1600 steps, none after 800, from scratch
or from a pretraining."""
VERIFIER_SHAPE = {"dim": 96, "n_layers": 3, "ffn_dim": 256}
"""The verifier model: 0.70M parameters, about half the policy's."""
STUDY = {"families": "add", "tasks": 400, "seeds": 3, "n_max": 32, "beam_ns": "4,16",
         "thinking_budgets": "16,32,64,96", "max_new_tokens": 96, "amortise_queries": 10_000,
         "outcome_head": True, "head_tasks": 100, "head_samples": 16, "line_tasks": 500,
         "line_samples": 8, "line_steps": 400, "line_seq_len": 512}
"""The study and the verifiers' data: add, the family the lifecycle scores, 400 held-out tasks,
3 seeds. (mod is no test of choosing: the policy's 0.20 there is what a remainder guessed at
random in 0..m-1 scores, 0.19 over m = 2..12.) The head's and the line verifier's data as in
docs/inference.md."""
QUICK_STUDY = {**STUDY, "tasks": 8, "seeds": 2, "n_max": 4, "beam_ns": "2,4",
               "thinking_budgets": "8,16", "max_new_tokens": 32, "outcome_head": False,
               "line_tasks": 6, "line_samples": 2, "line_steps": 4}
"""Smoke sizes. No outcome head: a head needs right samples, and a policy of a few SFT steps
answers none; best-of-N runs on the line verifier instead."""
RESULTS = REPO_ROOT / "bench" / "results" / "test_time_scaling"


def step(text: str) -> None:
    print(f"\n== tts: {text}", flush=True)


def sft_config(run_dir: Path, sizes: dict, init_from: Path | None, model: dict | None = None):
    """The lifecycle's SFT of seed 0 (``bench.lifecycle.run_lifecycle``'s SFT sections) with
    ``sizes``, at the shape ``model`` over configs/tiny.toml's; from scratch when ``init_from``
    is None."""
    sections = _post_sections(sizes, sizes["sft_lr"], sizes["sft_steps"], init_from or Path(),
                              task_seed=0)
    sections["data"]["seq_len"] = sizes["sft_seq_len"]
    sections["train"]["batch_size"] = sizes["sft_batch"]
    sections["train"]["init_from"] = str(init_from) if init_from else ""
    sections["post"]["families"] = sizes.get("sft_families", sizes["families"])
    return _config(run_dir, 0, model=model or {}, observe={"log_every": 50}, **sections)


def train(kind: str, config) -> Path:
    """Train ``config`` (``sft``) unless its run is already there; its weights."""
    run_dir = config.run.path
    if not reusable(run_dir, config):
        print(f"training {run_dir}: {kind}, {config.train.steps} steps", flush=True)
        done = _train(kind, config)
        print(f"{run_dir}: {done['steps']} steps in {done['seconds']:.0f} s, final loss "
              f"{done['final_loss']:.3f}", flush=True)
    return run_dir / "model.safetensors"


def ftlm(args: list[str]) -> None:
    """Run an ``ftlm`` command in this process, as its shell form shows; stop on failure."""
    from ftlm.cli import main
    print("$ ftlm " + shlex.join(args), flush=True)
    if main(args) != 0:
        raise SystemExit(f"ftlm {args[0]} {args[1]} failed (its error is above)")


def outcome_head(out: Path, verifier: Path, policy: Path, study: dict) -> None:
    """Fit the outcome head unless ``out`` holds one of the same models and data."""
    info = {"model": str(verifier), "policy": str(policy), "families": study["families"],
            "tasks": study["head_tasks"], "samples": study["head_tasks"] * study["head_samples"]}
    if out.is_file():
        saved = json.loads(out.read_text()).get("info", {})
        if all(saved.get(k) == v for k, v in info.items()):
            print(f"reusing {out}", flush=True)
            return
    ftlm(["verifier", "head", str(verifier), "--policy", str(policy), "--families",
          study["families"], "--n", str(study["head_tasks"]), "--samples",
          str(study["head_samples"]), "--seed", "1", "--out", str(out)])


def line_verifier(run_dir: Path, init_from: Path, policy: Path, study: dict) -> None:
    """``ftlm verifier train`` from the verifier model, unless its run is already there."""
    from ftlm.config import load_config
    overrides = [f"run.dir={run_dir}", f"train.init_from={init_from}",
                 f"train.steps={study['line_steps']}", f"data.seq_len={study['line_seq_len']}",
                 "data.eval_samples=0", "train.eval_every=0", "observe.progress=false",
                 "observe.log_every=50"] + [f"model.{k}={v}" for k, v in VERIFIER_SHAPE.items()]
    tiny = REPO_ROOT / "configs" / "tiny.toml"
    config = load_config(tiny, overrides + [f"post.data={run_dir / 'verifier_data.jsonl'}"])
    if reusable(run_dir, config):
        return
    ftlm(["verifier", "train", str(tiny), "--policy", str(policy), "--families",
          study["families"], "--n", str(study["line_tasks"]), "--samples",
          str(study["line_samples"])] + [a for o in overrides for a in ("--set", o)])


def run(root: Path, sizes: dict, large_sizes: dict, study: dict, write: bool) -> int:
    """Every step of the module docstring under ``root``; the study's exit status."""
    from bench import test_time_scaling
    from ftlm.observe.logs import configure_logging
    configure_logging()  # the trainers' step lines (every 50 steps) go to stderr
    ensure_demo()
    started = time.perf_counter()
    step(f"1/5 the policy (the lifecycle's SFT recipe, seed 0, {sizes['sft_steps']} steps, "
         "from scratch)")
    policy = train("sft", sft_config(root / "policy", sizes, None)).parent
    step(f"2/5 the larger policy ({LARGE_SHAPE})")
    large = train("sft", sft_config(root / "policy-large", large_sizes, None,
                                    LARGE_SHAPE)).parent
    step(f"3/5 the verifier model ({VERIFIER_SHAPE}, the same SFT) and its outcome head")
    verifier = train("sft", sft_config(root / "verifier", sizes, None, VERIFIER_SHAPE)).parent
    if study["outcome_head"]:
        outcome_head(root / "head.json", verifier, policy, study)
    step("4/5 the line verifier (process verifier of beam search)")
    line = root / "line-verifier"
    line_verifier(line, verifier / "model.safetensors", policy, study)
    print(f"models ready ({time.perf_counter() - started:.0f} s)", flush=True)
    step("5/5 the study")
    results = RESULTS if write else root
    results.mkdir(parents=True, exist_ok=True)
    note = results / "models.md"
    note.write_text(models_note(root, sizes, large_sizes, study))
    scorer = (["--verifier", str(verifier), "--verifier-head", str(root / "head.json")]
              if study["outcome_head"] else ["--verifier", str(line)])
    argv = ["--policy", str(policy), *scorer, "--process-verifier", str(line),
            "--large-policy", str(large), "--families", study["families"], "--tasks",
            str(study["tasks"]), "--seeds", str(study["seeds"]), "--n-max", str(study["n_max"]),
            "--beam-ns", study["beam_ns"], "--thinking-budgets", study["thinking_budgets"],
            "--max-new-tokens", str(study["max_new_tokens"]), "--amortise-queries",
            str(study["amortise_queries"]), "--json", str(results / "study.json"),
            "--note-file", str(note)] + ([] if write else ["--no-write"])
    print("$ python -m bench.test_time_scaling " + shlex.join(argv), flush=True)
    return test_time_scaling.main(argv)


def models_note(root: Path, sizes: dict, large_sizes: dict, study: dict) -> str:
    """How the study's models were made (written under its tables)."""
    return (f"The models (`make tts`, `python -m bench.tts_pipeline`, into `{root}`; training is "
            "deterministic):\n\n"
            f"* Policy `{root}/policy`: the lifecycle's SFT recipe (`bench.lifecycle`), from "
            f"scratch at `configs/tiny.toml`'s shape: {sizes['sft_steps']} steps on "
            f"{sizes['train_tasks']:,} {sizes['sft_families']} tasks (lr {sizes['sft_lr']}, "
            f"batch {sizes['sft_batch']}, sequence {sizes['sft_seq_len']}, seed 0); no "
            "pretraining (the earlier study's 200 steps on the demo corpus did not help the "
            "larger policy learn the tasks).\n"
            f"* Larger policy `{root}/policy-large`: the same for {large_sizes['sft_steps']} "
            f"steps at lr {large_sizes['sft_lr']} and "
            + ", ".join(f"model.{k}={v}" for k, v in LARGE_SHAPE.items()) + ".\n"
            f"* Verifier `{root}/verifier`: the same at "
            + ", ".join(f"model.{k}={v}" for k, v in VERIFIER_SHAPE.items())
            + f"; its outcome head `{root}/head.json`: `ftlm verifier head` on "
              f"{study['head_tasks']} train tasks x {study['head_samples']} policy samples.\n"
            f"* Process verifier `{root}/line-verifier`: `ftlm verifier train` from the "
            f"verifier model, {study['line_steps']} steps on the line labels of "
            f"{study['line_tasks']} train tasks x {study['line_samples']} policy samples "
            f"(sequence {study['line_seq_len']}).")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tts_pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke-test sizes in a temporary folder; writes nothing outside it")
    p.add_argument("--workdir", default="", help="the models' folder (default runs/tts; with "
                                                 "--quick: a temporary folder)")
    p.add_argument("--no-write", action="store_true",
                   help="leave BENCHMARKS.md and bench/results alone (results in --workdir)")
    args = p.parse_args(argv)
    sizes, large, study = (QUICK, QUICK, QUICK_STUDY) if args.quick else (SIZES, LARGE_SIZES,
                                                                          STUDY)
    write = not (args.quick or args.no_write)
    if args.workdir or not args.quick:
        return run(Path(args.workdir or "runs/tts"), sizes, large, study, write)
    with tempfile.TemporaryDirectory(prefix="ftlm-tts-") as tmp:
        return run(Path(tmp), sizes, large, study, write)


if __name__ == "__main__":
    sys.exit(main())
