"""Benchmark: test-time scaling on held-out tasks: accuracy vs N and vs inference FLOPs.

For each seed, ``N_max`` samples per held-out task (``ftlm.tasks``, split ``test``) are drawn once
from the policy through the engine; the strategies then see the first ``N`` of them for every
``N`` in 1, 2, 4, ..., ``N_max`` (the usual nested subsampling):

* ``first sample`` (N = 1 whatever N is: the baseline), ``self-consistency`` (majority vote),
* ``best-of-N`` and ``weighted best-of-N`` scored by the policy's confidence and, with
  ``--verifier``, by the verifier model's score (the smallest per-line P(yes) of a line-by-line
  verifier, ``ftlm verifier train``; with ``--verifier-head``, the outcome verifier's
  P(correct), ``ftlm verifier head``),
* with ``--verifier``, ``beam search`` (``ftlm.infer.search``: step = one reasoning line, the
  verifier as the process scorer, ``--beam-width``) for each N of ``--beam-ns``, run afresh,
* ``oracle`` (any of the N correct: pass@N, the ceiling of a perfect verifier).

Inference FLOPs per task: ``2 x N_params`` per token through each model (policy: prompt and
completion of every sample, and for beam search every re-prefilled partial; verifier: every
verification prompt it reads), attention left out. With ``--large-policy``, the larger model's
single-sample accuracy and FLOPs are measured on the same tasks and seeds, and a matched-FLOPs
table sets each small-policy strategy, at the N whose FLOPs are nearest, against it. Accuracy is
the mean over seeds with a 95% t-interval (the tasks are the same for every seed: the interval
is the spread of sampling, not of the task draw). Plots go under ``bench/results/``.

``--json`` keeps the raw per-seed results; ``--from-json A [--from-json B]`` writes the section
from saved runs (e.g. the small policy and the larger one measured by separate processes:
``--large-only``). ``--quick`` runs random tiny models (a smoke test: accuracies are ~0) and
writes nothing.

    python -m bench.test_time_scaling --policy runs/sft-small --verifier runs/verifier \\
        [--large-policy runs/sft-base] [--tasks 200] [--n-max 64] [--seeds 3] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.common import REPO_ROOT, publish, section_header, t_interval, table
from ftlm.infer import Engine, SamplingParams
from ftlm.infer import strategies as st
from ftlm.infer.chat import chat_stop_ids, render_chat
from ftlm.infer.search import beam_search
from ftlm.model.counts import param_count
from ftlm.tasks import Task, check
from ftlm.tasks import generate as generate_tasks

SECTION = "test_time_scaling"
LARGE = "larger policy, 1 sample"


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval (0 for one value)."""
    mean, half = t_interval(values)
    return mean, 0.0 if len(values) < 2 else half


def prompts_of(tok, tasks: list[Task], chat: bool) -> list[list[int]]:
    return [render_chat([{"role": "user", "content": t.prompt}], tok) if chat
            else tok.encode(t.prompt) for t in tasks]


def sample_pool(engine: Engine, tok, tasks: list[Task], n: int, params: SamplingParams,
                chat: bool) -> tuple[list[list[st.Candidate]], list[int]]:
    prompts = prompts_of(tok, tasks, chat)
    return st.sample_candidates(engine, tok, prompts, n, params), [len(p) for p in prompts]


class CountingScorer:
    """The verifier as a process scorer, counting the tokens it reads per prompt (its cost)."""

    def __init__(self, verifier) -> None:
        self.verifier = verifier
        self.tokens: Counter[str] = Counter()

    def __call__(self, pairs):
        for prompt, partial in pairs:
            self.tokens[prompt] += len(self.verifier.token_ids(prompt, partial))
        return self.verifier.probabilities(pairs)


def verifier_tokens(verifier, prompt: str, cands) -> int:
    return sum(len(verifier.token_ids(prompt, c.text)) for c in cands)


def evaluate(tasks, pools, prompt_lens, ns, policy_params, verifier, verifier_params):
    """{strategy: {N: (accuracy, flops per task)}} for one seed (sampling strategies)."""
    out: dict[str, dict[int, tuple[float, float]]] = {}
    flop = 2.0 * policy_params
    for n in ns:
        rows: dict[str, list[tuple[bool, float]]] = {}
        for task, pool, plen in zip(tasks, pools, prompt_lens):
            cands = pool[:n]
            cost = flop * sum(plen + len(c.tokens) for c in cands)
            picks = {"first sample": (cands[0], flop * (plen + len(cands[0].tokens))),
                     "self-consistency": (st.self_consistency(cands), cost),
                     "best-of-N (confidence)": (st.best_of_n(cands, task.prompt, st.confidence), cost),
                     "weighted (confidence)": (st.weighted_best_of_n(cands, task.prompt,
                                                                     st.confidence), cost)}
            if verifier is not None:
                verifier.score_all(task.prompt, cands)
                vcost = cost + 2.0 * verifier_params * verifier_tokens(verifier, task.prompt, cands)
                picks["best-of-N (verifier)"] = (st.best_of_n(cands, task.prompt, verifier), vcost)
                picks["weighted (verifier)"] = (st.weighted_best_of_n(cands, task.prompt,
                                                                      verifier), vcost)
            for name, (choice, c) in picks.items():
                rows.setdefault(name, []).append((check(task, choice.text), c))
            rows.setdefault("oracle (pass@N)", []).append(
                (any(check(task, c.text) for c in cands), cost))
        for name, results in rows.items():
            out.setdefault(name, {})[n] = (sum(ok for ok, _ in results) / len(results),
                                           statistics.fmean(c for _, c in results))
    return out


def _auc(right: list[float], wrong: list[float]) -> float:
    wins = sum((a > b) + 0.5 * (a == b) for a in right for b in wrong)
    return wins / (len(right) * len(wrong)) if right and wrong else float("nan")


def verifier_auc(tasks, pools, verifier) -> tuple[float, float, float]:
    """How well the verifier's score separates correct from wrong samples (0.5: not at all):
    pooled over all tasks, and within a task (the mean over tasks with both kinds), which is
    what picking among one task's samples needs; and the median spread (max - min) of the scores
    of one task's samples. A spread near 0 is a verifier that answers the same for every sample
    of a task (the outcome-labelled verifier's was ~1e-4: its within-task AUC was tie noise)."""
    right, wrong, within, spread = [], [], [], []
    for task, pool in zip(tasks, pools):
        scored = [(check(task, c.text), verifier(task.prompt, c)) for c in pool]
        r = [p for ok, p in scored if ok]
        w = [p for ok, p in scored if not ok]
        right += r
        wrong += w
        spread.append(max(p for _, p in scored) - min(p for _, p in scored))
        if r and w:
            within.append(_auc(r, w))
    return (_auc(right, wrong), statistics.fmean(within) if within else float("nan"),
            statistics.median(spread))


def evaluate_beam(engine, tok, tasks, chat, ns, width, params, policy_params, verifier,
                  verifier_params, max_steps):
    """{"beam search (verifier)": {N: (accuracy, flops per task)}} for one seed."""
    out: dict[int, tuple[float, float]] = {}
    prompts = prompts_of(tok, tasks, chat)
    for n in ns:
        scorer = CountingScorer(verifier)
        found = beam_search(engine, tok, prompts, [t.prompt for t in tasks], scorer, n,
                            min(width, n), params, max_steps=max_steps)
        acc = statistics.fmean(check(t, r.choice.text) for t, r in zip(tasks, found))
        flops = statistics.fmean(2.0 * policy_params * r.policy_tokens
                                 + 2.0 * verifier_params * scorer.tokens[t.prompt]
                                 for t, r in zip(tasks, found))
        out[n] = (acc, flops)
    return {f"beam search (verifier, width {width})": out} if out else {}


def summarise(per_seed: list[dict]) -> dict:
    """{strategy: {N: (mean accuracy, CI half-width, mean FLOPs)}} over seeds."""
    names = list(dict.fromkeys(name for s in per_seed for name in s))
    out = {}
    for name in names:
        ns = sorted({n for s in per_seed for n in s.get(name, {})})
        out[name] = {n: (*interval([s[name][n][0] for s in per_seed if n in s.get(name, {})]),
                         statistics.fmean(s[name][n][1] for s in per_seed
                                          if n in s.get(name, {}))) for n in ns}
    return out


def matched(results: dict, large: dict) -> list[list]:
    """Each small-policy strategy at the N whose FLOPs are nearest the larger policy's."""
    target = statistics.fmean(large["flops"])
    big, half = interval(large["accs"])
    rows = []
    for name, per_n in results.items():
        if name == "first sample":
            continue
        n = min(per_n, key=lambda k: abs(math.log(per_n[k][2] / target)))
        acc, h, flops = per_n[n]
        rows.append([name, n, f"{flops:.3g}", f"{flops / target:.2f}", f"{acc:.3f} ± {h:.3f}",
                     f"{acc - big:+.3f}"])
    rows.append([LARGE, 1, f"{target:.3g}", "1.00", f"{big:.3f} ± {half:.3f}", ""])
    return rows


def plot(results: dict, path: Path, large: tuple[float, float] | None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (by_n, by_flops) = plt.subplots(1, 2, figsize=(11, 4))
    for name, per_n in results.items():
        ns = sorted(per_n)
        acc = [per_n[n][0] for n in ns]
        err = [per_n[n][1] for n in ns]
        flops = [per_n[n][2] for n in ns]
        by_n.errorbar(ns, acc, yerr=err, marker="o", label=name, capsize=2)
        by_flops.errorbar(flops, acc, yerr=err, marker="o", label=name, capsize=2)
    if large is not None:
        for ax, x in ((by_n, 1), (by_flops, large[1])):
            ax.scatter([x], [large[0]], marker="*", s=150, color="black", label=LARGE, zorder=5)
    for ax, label in ((by_n, "samples per task N"), (by_flops, "inference FLOPs per task")):
        ax.set_xscale("log", base=2 if ax is by_n else 10)
        ax.set_xlabel(label)
        ax.set_ylabel("held-out accuracy")
        ax.grid(alpha=0.3)
    by_flops.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.test_time_scaling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="", help="run directory of the (small) policy")
    p.add_argument("--verifier", default="", help="run directory of the verifier (optional)")
    p.add_argument("--verifier-head", default="", metavar="JSON",
                   help="outcome head of --verifier (`ftlm verifier head`): the verifier scores "
                        "whole samples by it (no beam search rows)")
    p.add_argument("--wait-verifier", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to this long for --verifier to finish training (it is loaded "
                        "after the policy's samples are drawn)")
    p.add_argument("--large-policy", default="", help="run directory of a larger policy")
    p.add_argument("--large-only", action="store_true",
                   help="measure only --large-policy (merge with --from-json later)")
    p.add_argument("--tasks", type=int, default=200, help="held-out tasks (default 200)")
    p.add_argument("--families", default="add,mod,sort,count", help="task families")
    p.add_argument("--n-max", type=int, default=64, help="largest N, a power of 2 (default 64)")
    p.add_argument("--beam-ns", default="4,16",
                   help="N (partials per round) of the beam search rows, comma-separated "
                        "(default 4,16; empty: no beam search)")
    p.add_argument("--beam-width", type=int, default=4,
                   help="expansions per kept partial (default 4: N/4 kept)")
    p.add_argument("--beam-steps", type=int, default=12, help="most rounds (lines) of a search")
    p.add_argument("--seeds", type=int, default=3, help="seeds (default 3)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="first seed (to measure seeds in parallel processes; merge with "
                        "--from-json)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--no-chat", action="store_true", help="prompt without the chat template")
    p.add_argument("--quick", action="store_true", help="random tiny models, prints only")
    p.add_argument("--json", default="", help="also write the raw per-seed results here")
    p.add_argument("--from-json", action="append", default=[], metavar="PATH",
                   help="format saved --json results (repeatable: later files add to earlier)")
    p.add_argument("--note", default="", help="a line on how the models were trained (written "
                                               "under the table)")
    p.add_argument("--note-file", default="", help="read the note from this file (Markdown)")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    if args.note_file:
        args.note = Path(args.note_file).read_text().strip()
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        return _quick()
    if args.from_json:
        data: dict = {}
        for path in args.from_json:
            saved = json.loads(Path(path).read_text())
            if "per_seed" in saved:  # seeds measured by separate processes add up
                if "meta" in data:
                    saved["meta"]["seeds"] += data["meta"]["seeds"]
                    saved["meta"]["verifier_auc"] = (data["meta"].get("verifier_auc", [])
                                                     + saved["meta"].get("verifier_auc", []))
                    saved["meta"]["seconds"] = max(saved["meta"]["seconds"],
                                                   data["meta"]["seconds"])
                data["per_seed"] = data.get("per_seed", []) + saved["per_seed"]
                data["meta"] = saved["meta"]
            if "large" in saved:
                if "large" in data:
                    for key in ("accs", "flops"):
                        saved["large"][key] = data["large"][key] + saved["large"][key]
                    saved["large"]["seconds"] = max(saved["large"]["seconds"],
                                                    data["large"]["seconds"])
                data["large"] = saved["large"]
        if "per_seed" not in data:
            p.error("no --from-json file holds the small policy's results (per_seed)")
    else:
        if not args.policy and not (args.large_only and args.large_policy):
            p.error("--policy RUN_DIR is required (or --large-only --large-policy, or --quick)")
        if args.n_max < 1 or args.n_max & (args.n_max - 1):
            p.error(f"--n-max={args.n_max} must be a power of 2")
        data = measure(args)
    if args.json:
        Path(args.json).write_text(json.dumps(data))
    if "per_seed" not in data:
        print(json.dumps(data.get("large")))
        return 0
    figure = (REPO_ROOT / "bench" / "results" if not args.no_write else
              Path(tempfile.mkdtemp())) / "test_time_scaling.png"
    body = report(data, args.note, figure)
    return publish(SECTION, body, write=not args.no_write)


def _params(tok, args, seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          seed=seed * 100_003, stop_ids=() if args.no_chat else chat_stop_ids(tok))


def measure(args) -> dict:
    """Sample, select and count for every seed; returns the JSON-able raw results."""
    from ftlm.config import load_config
    from ftlm.infer.load import load_run
    from ftlm.infer.outcome import OutcomeVerifier, load_head
    from ftlm.infer.verifier import Verifier
    started = time.perf_counter()
    tasks = generate_tasks(args.families, "test", args.tasks, 0)
    chat = not args.no_chat
    data: dict = {}
    if not args.large_only:
        policy = load_run(args.policy, device="cpu", read_config=load_config)
        tok, pparams = policy.tokenizer, param_count(policy.model.cfg)
        verifier, vparams = None, 0
        ns = [2 ** i for i in range(int(math.log2(args.n_max)) + 1)]
        # Beam search scores partial solutions line by line: the line verifier's job, not a head's.
        beam_ns = ([int(x) for x in args.beam_ns.split(",") if x.strip()]
                   if args.verifier and not args.verifier_head else [])
        per_seed, aucs = [], []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            engine = Engine(policy.model, max_batch=args.max_batch, eos_id=tok.eos_id,
                            detokenize=tok.decode)
            pools, plens = sample_pool(engine, tok, tasks, args.n_max, _params(tok, args, seed),
                                       chat)
            if args.verifier and verifier is None:  # loaded late: it may still be training
                _wait_for(Path(args.verifier) / "model.safetensors", args.wait_verifier)
                judge = load_run(args.verifier, device="cpu", read_config=load_config)
                verifier = (OutcomeVerifier(judge.model, judge.tokenizer,
                                            load_head(Path(args.verifier_head)))
                            if args.verifier_head else Verifier(judge.model, judge.tokenizer))
                vparams = param_count(judge.model.cfg)
            result = evaluate(tasks, pools, plens, ns, pparams, verifier, vparams)
            if verifier is not None:  # the scores are memoised by evaluate: no new passes
                aucs.append(verifier_auc(tasks, pools, verifier))
            print(f"seed {seed}: sampling strategies done ({time.perf_counter() - started:.0f} s)",
                  flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({"per_seed": per_seed + [
                    {name: {str(n): v for n, v in per_n.items()} for name, per_n in result.items()}],
                    "meta": _meta(args, pparams, vparams, [], len(per_seed) + 1, started)}))
            if beam_ns:
                result.update(evaluate_beam(engine, tok, tasks, chat, beam_ns, args.beam_width,
                                            _params(tok, args, seed), pparams, verifier, vparams,
                                            args.beam_steps))
                print(f"seed {seed}: beam search done ({time.perf_counter() - started:.0f} s)",
                      flush=True)
            per_seed.append({name: {str(n): v for n, v in per_n.items()}
                             for name, per_n in result.items()})
            if args.json:  # what is measured so far survives an interrupted run
                Path(args.json).write_text(json.dumps({"per_seed": per_seed, "meta": _meta(
                    args, pparams, vparams, beam_ns, len(per_seed), started)}))
        data["per_seed"] = per_seed
        data["meta"] = _meta(args, pparams, vparams, beam_ns, args.seeds, started)
        data["meta"]["verifier_auc"] = aucs
    if args.large_policy:
        t0 = time.perf_counter()
        big = load_run(args.large_policy, device="cpu", read_config=load_config)
        accs, cost = [], []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            engine = Engine(big.model, max_batch=args.max_batch, eos_id=big.tokenizer.eos_id,
                            detokenize=big.tokenizer.decode)
            pools, plens = sample_pool(engine, big.tokenizer, tasks, 1,
                                       _params(big.tokenizer, args, seed), chat)
            r = evaluate(tasks, pools, plens, [1], param_count(big.model.cfg), None, 0)
            accs.append(r["first sample"][1][0])
            cost.append(r["first sample"][1][1])
        data["large"] = {"path": args.large_policy, "params": param_count(big.model.cfg),
                         "accs": accs, "flops": cost, "seconds": time.perf_counter() - t0}
    return data


def _wait_for(path: Path, seconds: float) -> None:
    """Return once ``path`` exists, or after ``seconds`` (the load then names what is missing)."""
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(min(10.0, max(0.0, deadline - time.monotonic())))


def _meta(args, pparams: int, vparams: int, beam_ns: list[int], seeds: int,
          started: float) -> dict:
    return {"policy": args.policy, "policy_params": pparams, "verifier": args.verifier,
            "verifier_head": args.verifier_head,
            "verifier_params": vparams, "tasks": args.tasks, "families": args.families,
            "seeds": seeds, "temperature": args.temperature,
            "max_new_tokens": args.max_new_tokens, "n_max": args.n_max, "beam_ns": beam_ns,
            "beam_width": args.beam_width, "seconds": time.perf_counter() - started}


def report(data: dict, note: str, figure: Path) -> str:
    """The BENCHMARKS.md section of saved raw results (its plot written to ``figure``)."""
    meta, large = data["meta"], data.get("large")
    per_seed = [{name: {int(n): tuple(v) for n, v in per_n.items()} for name, per_n in s.items()}
                for s in data["per_seed"]]
    results = summarise(per_seed)
    figure = plot(results, figure,
                  (interval(large["accs"])[0], statistics.fmean(large["flops"])) if large else None)
    # One row per strategy, one column per N: a strategy's scaling reads along its row.
    ns = sorted({n for per_n in results.values() for n in per_n})
    rows = [[name] + [f"{per_n[n][0]:.3f} ± {per_n[n][1]:.3f} at {per_n[n][2]:.2g}"
                      if n in per_n else "" for n in ns]
            for name, per_n in results.items()]
    seconds = meta["seconds"] + (large["seconds"] if large else 0.0)
    body = (section_header("Test-time scaling: accuracy vs N and vs inference FLOPs",
                           "bench.test_time_scaling", [])
            + f"* Policy: `{meta['policy']}` ({meta['policy_params'] / 1e6:.2f}M)"
            + (f"; verifier `{meta['verifier']}` ({meta['verifier_params'] / 1e6:.2f}M)"
               + (f" with the outcome head `{meta['verifier_head']}`"
                  if meta.get("verifier_head") else "")
               if meta["verifier"] else "")
            + (f"; larger policy `{large['path']}` ({large['params'] / 1e6:.2f}M)" if large else "")
            + f"; {meta['tasks']} held-out tasks ({meta['families']}), {meta['seeds']} seeds, "
              f"temperature {meta['temperature']}, up to {meta['max_new_tokens']} new tokens. "
              f"Took {seconds:.0f} s. Plot: `bench/results/{figure.name}`\n"
            + (f"* Verifier AUC, its score of the correct vs the wrong samples of the held-out "
               f"tasks (0.5: chance), per seed, pooled / within a task / median spread of one "
               f"task's scores: "
               f"{'; '.join(' / '.join(f'{x:.3f}' for x in auc) for auc in meta['verifier_auc'])}\n"
               if meta.get("verifier_auc") else "")
            + "\nEach cell: accuracy (95% CI) at the inference FLOPs per task of N samples.\n\n"
            + table(["strategy"] + [f"N = {n}" for n in ns], rows))
    if large:
        big, half = interval(large["accs"])
        body += (f"\n\nMatched inference FLOPs: the larger policy `{large['path']}` with one "
                 f"sample ({big:.3f} ± {half:.3f} at {statistics.fmean(large['flops']):.3g} "
                 "FLOPs per task) against each strategy of the small policy at the N whose "
                 "FLOPs per task are nearest:\n\n"
                 + table(["strategy", "N", "FLOPs per task", "FLOPs / larger's",
                          "accuracy (95% CI)", "minus larger"], matched(results, large)))
    if note:
        body += "\n\n" + note
    return body


def _quick() -> int:
    """The whole pipeline on random tiny models (accuracies ~0): a smoke test."""
    from ftlm.data.tokenizer import train_tokenizer
    from ftlm.infer.verifier import Verifier
    from ftlm.model import ModelConfig, Transformer
    with tempfile.TemporaryDirectory() as tmp:
        text = "What is 12 + 30? <think>2+0=2</think> Answer: 42\n" * 50
        (Path(tmp) / "c.txt").write_text(text)
        tok = train_tokenizer([Path(tmp) / "c.txt"], Path(tmp) / "tok.json", vocab_size=300)
    cfg = ModelConfig(size="tiny", vocab_size=tok.vocab_size, dim=64, n_layers=2, n_heads=4,
                      n_kv_heads=2, ffn_dim=128, max_seq_len=256)
    model = Transformer(cfg)
    tasks = generate_tasks(["add", "sort"], "test", 6, 0)
    engine = Engine(model, max_batch=16, eos_id=tok.eos_id, detokenize=tok.decode)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=0,
                            stop_ids=chat_stop_ids(tok))
    pools, plens = sample_pool(engine, tok, tasks, 4, params, chat=True)
    verifier = Verifier(model, tok)
    result = evaluate(tasks, pools, plens, [1, 2, 4], param_count(cfg), verifier,
                      param_count(cfg))
    result.update(evaluate_beam(engine, tok, tasks, True, [2, 4], 2, params, param_count(cfg),
                                verifier, param_count(cfg), 3))
    for name, per_n in result.items():
        print(name, {n: f"{a:.2f} @ {f:.3g} FLOPs" for n, (a, f) in per_n.items()})
    with tempfile.TemporaryDirectory() as tmp:
        shaped = summarise([result])
        large = {"accs": [0.0], "flops": [1e7]}
        print("matched:", matched(shaped, large)[:2])
        print("plot:", plot(shaped, Path(tmp) / "scaling.png", (0.0, 1e7)).stat().st_size, "bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
