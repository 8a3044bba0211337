"""Benchmark: test-time scaling on held-out tasks: accuracy vs N and vs inference FLOPs.

For each seed, ``N_max`` samples per held-out task (``ftlm.tasks``, split ``test``) are drawn once
from the policy through the engine; the strategies then see the first ``N`` of them for every
``N`` in 1, 2, 4, ..., ``N_max`` (the usual nested subsampling):

* baselines: ``greedy`` (temperature 0, one sample: one run, seeds do not change it) and
  ``first sample`` (one sample at ``--temperature``),
* ``self-consistency`` (majority vote), ``best-of-N`` and ``weighted best-of-N`` scored by the
  policy's confidence and, with ``--verifier``, by the verifier model's score (the smallest
  per-line P(yes) of a line-by-line verifier, ``ftlm verifier train``; with ``--verifier-head``,
  the outcome verifier's P(correct), ``ftlm verifier head``),
* ``beam search`` with the process verifier (``ftlm.infer.search``: step = one reasoning line,
  ``--process-verifier``, a line verifier; by default ``--verifier`` when it has no head) for each
  N of ``--beam-ns``, run afresh,
* ``thinking budget`` for each budget of ``--thinking-budgets`` (its "N": reasoning tokens
  before ``</think>`` and the answer are forced; one sample at ``--temperature``),
* ``oracle`` (any of the N correct: pass@N, the ceiling of a perfect verifier).

Inference FLOPs per task (``ftlm.model.counts.forward_flops``): every pass through the policy
(prompt and completion of each sample, each re-prefilled partial of beam search, both passes of a
thinking budget) and every text a verifier reads, at 2 x matmul weights per token plus attention
to the context so far (KV cache). The verifiers' training compute (their runs' ``summary.json``,
every run on the ``init_from`` chain, plus the policy samples that labelled their data; or
``--verifier-train-flops``) is reported amortised over ``--amortise-queries`` queries. With
``--large-policy``, the larger model's greedy and sampled single-sample accuracy and FLOPs are
measured on the same tasks and seeds, and matched-FLOPs tables (with and without the amortised
verifier training) set each small-policy strategy, at the N whose FLOPs are nearest, against it.
Accuracy: the mean over seeds with its 95% t-interval over seeds, and a 95% bootstrap interval
over tasks (``bench.tts_report``). Plots go under ``bench/results/``.

``--json`` keeps the raw results (per seed, strategy and N: accuracy, mean FLOPs and each task's
outcome); ``--from-json A [--from-json B]`` writes the section from saved runs (e.g. the small
policy and the larger one measured by separate processes: ``--large-only``). ``--quick`` runs
random tiny models (a smoke test: accuracies are ~0) and writes nothing. ``make tts``
(``bench.tts_pipeline``) trains every model of the study and runs it.

    python -m bench.test_time_scaling --policy runs/tts/policy --verifier runs/tts/verifier \\
        --verifier-head runs/tts/head.json --process-verifier runs/tts/line-verifier \\
        [--large-policy runs/tts/policy-large] [--tasks 400] [--n-max 32] [--seeds 3] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bench.common import REPO_ROOT, publish, repo_relative
from bench.tts_report import THINKING, labelling, merge, section, training_runs
from ftlm.infer import Engine, SamplingParams
from ftlm.infer import strategies as st
from ftlm.infer.chat import chat_stop_ids, render_chat
from ftlm.infer.search import beam_search
from ftlm.model import ModelConfig, forward_flops, param_count
from ftlm.tasks import Task, check
from ftlm.tasks import generate as generate_tasks

SECTION = "test_time_scaling"
TASK_SEED = 0
"""Seed of the held-out task draw (the suite's test split)."""


def prompts_of(tok, tasks: list[Task], chat: bool) -> list[list[int]]:
    return [render_chat([{"role": "user", "content": t.prompt}], tok) if chat
            else tok.encode(t.prompt) for t in tasks]


def sample_pool(engine: Engine, tok, tasks: list[Task], n: int, params: SamplingParams,
                chat: bool) -> list[list[st.Candidate]]:
    return st.sample_candidates(engine, tok, prompts_of(tok, tasks, chat), n, params)


def policy_flops(cfg: ModelConfig, cand: st.Candidate) -> float:
    """What producing ``cand`` cost the policy: each of its passes (``Candidate.passes``)."""
    return sum(forward_flops(cfg, read, made) for read, made in cand.passes)


def read_flops(cfg: ModelConfig, verifier, prompt: str, text: str) -> float:
    """What the verifier's reading of ``text`` (one teacher-forced pass) costs."""
    return forward_flops(cfg, len(verifier.token_ids(prompt, text)))


def cell(results: list[tuple[bool, float]]) -> dict:
    """One strategy at one N for one seed: accuracy, mean FLOPs per task, each task's outcome."""
    return {"acc": sum(ok for ok, _ in results) / len(results),
            "flops": statistics.fmean(f for _, f in results),
            "correct": "".join("1" if ok else "0" for ok, _ in results)}


def first_sample(tasks, pools, cfg: ModelConfig) -> dict:
    """The cell of each task's first candidate."""
    return cell([(check(t, pool[0].text), policy_flops(cfg, pool[0]))
                 for t, pool in zip(tasks, pools)])


class CountingScorer:
    """The process verifier as beam search's scorer, counting the FLOPs of what it reads per
    prompt (its cost)."""

    def __init__(self, verifier, cfg: ModelConfig) -> None:
        self.verifier, self.cfg = verifier, cfg
        self.flops: defaultdict[str, float] = defaultdict(float)

    def __call__(self, pairs):
        for prompt, partial in pairs:
            self.flops[prompt] += read_flops(self.cfg, self.verifier, prompt, partial)
        return self.verifier.probabilities(pairs)


def evaluate(tasks, pools, ns, policy_cfg: ModelConfig, verifier=None,
             verifier_cfg: ModelConfig | None = None) -> dict[str, dict[int, dict]]:
    """``{strategy: {N: cell}}`` of the sampling strategies for one seed."""
    rows: dict[str, dict[int, list[tuple[bool, float]]]] = defaultdict(lambda: defaultdict(list))
    for task, pool in zip(tasks, pools):
        costs = [policy_flops(policy_cfg, c) for c in pool]
        rows["first sample"][1].append((check(task, pool[0].text), costs[0]))
        if verifier is not None:
            verifier.score_all(task.prompt, pool)  # one batched pass; the scorers read its memo
            reads = [read_flops(verifier_cfg, verifier, task.prompt, c.text) for c in pool]
        for n in ns:
            cands, cost = pool[:n], sum(costs[:n])
            picks = {"self-consistency": (st.self_consistency(cands), cost),
                     "best-of-N (confidence)": (st.best_of_n(cands, task.prompt, st.confidence),
                                                cost),
                     "weighted (confidence)": (st.weighted_best_of_n(cands, task.prompt,
                                                                     st.confidence), cost)}
            if verifier is not None:
                scored = cost + sum(reads[:n])
                picks["best-of-N (verifier)"] = (st.best_of_n(cands, task.prompt, verifier),
                                                 scored)
                picks["weighted (verifier)"] = (st.weighted_best_of_n(cands, task.prompt,
                                                                      verifier), scored)
            for name, (choice, c) in picks.items():
                rows[name][n].append((check(task, choice.text), c))
            rows["oracle (pass@N)"][n].append((any(check(task, c.text) for c in cands), cost))
    return {name: {n: cell(results) for n, results in per_n.items()}
            for name, per_n in rows.items()}


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


def evaluate_beam(engine, tok, tasks, chat, ns, width, params, policy_cfg: ModelConfig,
                  verifier, verifier_cfg: ModelConfig, max_steps) -> dict[str, dict[int, dict]]:
    """``{"beam search (process verifier, width W)": {N: cell}}`` for one seed."""
    out: dict[int, dict] = {}
    prompts = prompts_of(tok, tasks, chat)
    for n in ns:
        scorer = CountingScorer(verifier, verifier_cfg)
        found = beam_search(engine, tok, prompts, [t.prompt for t in tasks], scorer, n,
                            min(width, n), params, max_steps=max_steps)
        out[n] = cell([(check(t, r.choice.text),
                        sum(forward_flops(policy_cfg, read, made) for read, made in r.passes)
                        + scorer.flops[t.prompt]) for t, r in zip(tasks, found)])
    return {f"beam search (process verifier, width {width})": out} if out else {}


def evaluate_thinking(engine, tok, tasks, chat, budgets, params,
                      policy_cfg: ModelConfig) -> dict[str, dict[int, dict]]:
    """``{"thinking budget": {budget: cell}}`` for one seed: one sample per task each."""
    prompts = prompts_of(tok, tasks, chat)
    out = {}
    for budget in budgets:
        cands = st.thinking_budget(engine, tok, prompts, budget, params)
        out[budget] = cell([(check(t, c.text), policy_flops(policy_cfg, c))
                            for t, c in zip(tasks, cands)])
    return {THINKING: out} if out else {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.test_time_scaling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="", help="run directory of the (small) policy")
    p.add_argument("--verifier", default="", help="run directory of the verifier of best-of-N "
                                                  "(optional)")
    p.add_argument("--verifier-head", default="", metavar="JSON",
                   help="outcome head of --verifier (`ftlm verifier head`): the verifier scores "
                        "whole samples by it")
    p.add_argument("--process-verifier", default="", metavar="RUN_DIR",
                   help="line verifier (`ftlm verifier train`) that scores the partials of beam "
                        "search (default: --verifier when it has no --verifier-head; none: no "
                        "beam search rows)")
    p.add_argument("--wait-verifier", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to this long for the verifiers to finish training (they are "
                        "loaded after the policy's samples are drawn)")
    p.add_argument("--verifier-train-flops", type=float, default=None, metavar="FLOPS",
                   help="training compute of --verifier (default: from its run directory's "
                        "summary.json and its labelling record)")
    p.add_argument("--process-verifier-train-flops", type=float, default=None, metavar="FLOPS",
                   help="training compute of --process-verifier (default: as --verifier's)")
    p.add_argument("--amortise-queries", type=int, default=10_000, metavar="N",
                   help="queries the verifiers' training compute is amortised over (10,000)")
    p.add_argument("--large-policy", default="", help="run directory of a larger policy")
    p.add_argument("--large-only", action="store_true",
                   help="measure only --large-policy (merge with --from-json later)")
    p.add_argument("--tasks", type=int, default=400, help="held-out tasks (default 400)")
    p.add_argument("--families", default="add", help="task families (default add)")
    p.add_argument("--n-max", type=int, default=32, help="largest N, a power of 2 (default 32)")
    p.add_argument("--beam-ns", default="4,16",
                   help="N (partials per round) of the beam search rows, comma-separated "
                        "(default 4,16; empty: no beam search)")
    p.add_argument("--beam-width", type=int, default=4,
                   help="expansions per kept partial (default 4: N/4 kept)")
    p.add_argument("--beam-steps", type=int, default=12, help="most rounds (lines) of a search")
    p.add_argument("--thinking-budgets", default="16,32,64,96",
                   help="reasoning budgets (tokens) of the thinking-budget rows, comma-separated "
                        "(default 16,32,64,96; empty: none)")
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
    p.add_argument("--json", default="", help="also write the raw results here")
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
        return _quick(args)
    if args.amortise_queries < 1:
        p.error(f"--amortise-queries={args.amortise_queries} must be at least 1")
    if args.from_json:
        data = merge([json.loads(Path(path).read_text()) for path in args.from_json])
        if "per_seed" not in data:
            p.error("no --from-json file holds the small policy's results (per_seed)")
    else:
        if not args.policy and not (args.large_only and args.large_policy):
            p.error("--policy RUN_DIR is required (or --large-only --large-policy, or --quick)")
        if args.n_max < 1 or args.n_max & (args.n_max - 1):
            p.error(f"--n-max={args.n_max} must be a power of 2")
        if args.process_verifier and not args.beam_ns.strip():
            p.error("--process-verifier runs beam search: give --beam-ns")
        data = measure(args)
    if args.json:
        Path(args.json).write_text(json.dumps(data))
    if "per_seed" not in data:
        print(json.dumps(data.get("large")))
        return 0
    figure = (REPO_ROOT / "bench" / "results" if not args.no_write else
              Path(tempfile.mkdtemp())) / "test_time_scaling.png"
    saved = args.from_json or ([args.json] if args.json else [])
    alone = [flag for path in saved for flag in ("--from-json", repo_relative(path))]
    alone += ["--note-file", repo_relative(args.note_file)] if args.note_file else []
    return publish(SECTION, section(data, args.note, figure, alone), write=not args.no_write)


def _params(tok, args, seed: int, temperature: float | None = None) -> SamplingParams:
    return SamplingParams(max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature if temperature is None else temperature,
                          seed=seed * 100_003, stop_ids=() if args.no_chat else chat_stop_ids(tok))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _engine(loaded, args) -> Engine:
    tok = loaded.tokenizer
    return Engine(loaded.model, max_batch=args.max_batch, eos_id=tok.eos_id,
                  detokenize=tok.decode)


def _progress(what: str, started: float) -> None:
    print(f"{what} ({time.perf_counter() - started:.0f} s)", flush=True)


def measure(args) -> dict:
    """Sample, select and count for every seed; returns the JSON-able raw results (saved to
    ``--json`` after every step, so that an interrupted run keeps what it measured)."""
    from ftlm.config import load_config
    from ftlm.infer.load import load_run
    started = time.perf_counter()
    tasks = generate_tasks(args.families, "test", args.tasks, TASK_SEED)
    chat = not args.no_chat
    data: dict = {}

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(data))

    if not args.large_only:
        policy = load_run(args.policy, device="cpu", read_config=load_config)
        tok, pcfg = policy.tokenizer, policy.model.cfg
        ns = [2 ** i for i in range(int(math.log2(args.n_max)) + 1)]
        process = args.process_verifier or (args.verifier if not args.verifier_head else "")
        beam_ns = _ints(args.beam_ns) if process else []
        budgets = _ints(args.thinking_budgets)
        data["meta"] = meta = _meta(args, policy, beam_ns, budgets, process)
        engine = _engine(policy, args)
        data["greedy"] = first_sample(tasks, sample_pool(engine, tok, tasks, 1, _params(
            tok, args, 0, temperature=0.0), chat), pcfg)
        _progress(f"greedy: {data['greedy']['acc']:.3f}", started)
        verifier = judge = line = line_run = None
        data["per_seed"] = []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            params = _params(tok, args, seed)
            pools = sample_pool(engine, tok, tasks, args.n_max, params, chat)
            _progress(f"seed {seed}: {args.n_max} samples of {len(tasks)} tasks drawn", started)
            if args.verifier and verifier is None:  # loaded late: it may still be training
                verifier, judge = _load_verifier(args.verifier, args.verifier_head, args)
                meta["verifier_params"] = param_count(judge.model.cfg)
            result = evaluate(tasks, pools, ns, pcfg, verifier,
                              judge.model.cfg if judge is not None else None)
            if verifier is not None:  # the scores are memoised by evaluate: no new passes
                meta["verifier_auc"].append(verifier_auc(tasks, pools, verifier))
            _progress(f"seed {seed}: sampling strategies done, first sample "
                      f"{result['first sample'][1]['acc']:.3f}", started)
            result.update(evaluate_thinking(engine, tok, tasks, chat, budgets, params, pcfg))
            if budgets:
                _progress(f"seed {seed}: thinking budgets {budgets} done", started)
            if beam_ns:
                if line is None:
                    line, line_run = _load_verifier(process, "", args)
                    meta["process_verifier_params"] = param_count(line_run.model.cfg)
                result.update(evaluate_beam(engine, tok, tasks, chat, beam_ns, args.beam_width,
                                            params, pcfg, line, line_run.model.cfg,
                                            args.beam_steps))
                _progress(f"seed {seed}: beam search {beam_ns} done", started)
            data["per_seed"].append({name: {str(n): v for n, v in per_n.items()}
                                     for name, per_n in result.items()})
            meta["seeds"], meta["seconds"] = len(data["per_seed"]), time.perf_counter() - started
            save()
    if args.large_policy:
        t0 = time.perf_counter()
        big = load_run(args.large_policy, device="cpu", read_config=load_config)
        tok, cfg, engine = big.tokenizer, big.model.cfg, _engine(big, args)
        data["large"] = large = {
            "path": args.large_policy, "params": param_count(cfg), "per_seed": [],
            "training": training_runs(Path(args.large_policy)),
            "greedy": first_sample(tasks, sample_pool(engine, tok, tasks, 1, _params(
                tok, args, 0, temperature=0.0), chat), cfg)}
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            pools = sample_pool(engine, tok, tasks, 1, _params(tok, args, seed), chat)
            large["per_seed"].append(first_sample(tasks, pools, cfg))
            large["seconds"] = time.perf_counter() - t0
            save()
        _progress(f"larger policy: greedy {large['greedy']['acc']:.3f}, sampled "
                  f"{statistics.fmean(c['acc'] for c in large['per_seed']):.3f}", started)
    return data


def _load_verifier(path: str, head: str, args):
    """``(scorer, loaded run)``: the outcome verifier of ``head`` over the model of ``path``, or
    the line verifier of ``path``; waits up to ``--wait-verifier`` for its weights."""
    from ftlm.config import load_config
    from ftlm.infer.load import load_run
    from ftlm.infer.outcome import OutcomeVerifier, load_head
    from ftlm.infer.verifier import Verifier
    _wait_for(Path(path) / "model.safetensors", args.wait_verifier)
    run = load_run(path, device="cpu", read_config=load_config)
    scorer = (OutcomeVerifier(run.model, run.tokenizer, load_head(Path(head))) if head
              else Verifier(run.model, run.tokenizer))
    return scorer, run


def _wait_for(path: Path, seconds: float) -> None:
    """Return once ``path`` exists, or after ``seconds`` (the load then names what is missing)."""
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(min(10.0, max(0.0, deadline - time.monotonic())))


def _meta(args, policy, beam_ns: list[int], budgets: list[int], process: str) -> dict:
    """The settings of a run and the training records of its models (``bench.tts_report``
    prices the verifiers' labelling with the FLOPs per sample measured here)."""
    training = {}
    for which, path, head, flops in (
            ("verifier", args.verifier, args.verifier_head, args.verifier_train_flops),
            ("process verifier", process if beam_ns else "", "",
             args.process_verifier_train_flops)):
        if path:
            record = {"path": path, "flops": flops}
            if flops is None:
                record.update(runs=training_runs(Path(path)), **labelling(Path(path), head))
            training[which] = record
    return {"policy": args.policy, "policy_params": param_count(policy.model.cfg),
            "policy_training": training_runs(Path(args.policy)),
            "verifier": args.verifier, "verifier_head": args.verifier_head,
            "verifier_params": 0, "process_verifier": process if beam_ns else "",
            "process_verifier_params": 0, "verifier_training": training,
            "amortise_queries": args.amortise_queries, "verifier_auc": [],
            "tasks": args.tasks, "families": args.families, "seeds": 0,
            "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
            "n_max": args.n_max, "beam_ns": beam_ns, "beam_width": args.beam_width,
            "thinking_budgets": budgets, "flops": "forward_flops", "seconds": 0.0}


def _quick(args) -> int:
    """The whole measurement and report on random tiny models (accuracies ~0): a smoke test
    that writes nothing."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        policy = _random_run(root / "policy", dim=64, n_layers=2)
        line = _random_run(root / "verifier", dim=32, n_layers=1)
        large = _random_run(root / "large", dim=96, n_layers=2)
        quick = argparse.Namespace(**{**vars(args), **dict(
            policy=str(policy), verifier=str(line), verifier_head="", process_verifier="",
            verifier_train_flops=1e12, process_verifier_train_flops=None,
            large_policy=str(large), large_only=False, tasks=6, families="add,sort", n_max=4,
            beam_ns="2,4", beam_width=2, beam_steps=3, thinking_budgets="4,8", seeds=2,
            first_seed=0, temperature=1.0, max_new_tokens=12, max_batch=16, json="")})
        data = merge([json.loads(json.dumps(measure(quick)))])  # as --from-json would read it
        publish(SECTION, section(data, "", root / "scaling.png"), write=False)
    return 0


def _random_run(run_dir: Path, dim: int, n_layers: int) -> Path:
    """A run directory holding a randomly initialised model of the demo tokenizer's vocabulary
    (config.toml, model.safetensors, tokenizer.json): what ``load_run`` reads."""
    from safetensors.torch import save_model

    from ftlm.config import build_config, load_config, save_config
    from ftlm.data.tokenizer import train_tokenizer
    from ftlm.model import Transformer
    run_dir.mkdir(parents=True)
    corpus = run_dir / "corpus.txt"
    corpus.write_text("What is 12 + 30? <think>2+0=2</think> Answer: 42\n" * 50)
    tok = train_tokenizer([corpus], run_dir / "tokenizer.json", vocab_size=300)
    base = load_config(REPO_ROOT / "configs" / "tiny.toml").to_dict()
    base["run"].update(dir=str(run_dir), name=run_dir.name)
    base["model"].update(vocab_size=tok.vocab_size, dim=dim, n_layers=n_layers, n_heads=4,
                         n_kv_heads=2, ffn_dim=2 * dim, max_seq_len=256)
    config = build_config(base)
    save_config(config, run_dir / "config.toml")
    save_model(Transformer(config.model), str(run_dir / "model.safetensors"))
    return run_dir


if __name__ == "__main__":
    raise SystemExit(main())
