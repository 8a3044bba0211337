"""Benchmark: test-time scaling on held-out tasks: accuracy vs N and vs inference FLOPs.

For each seed, ``N_max`` samples per held-out task (``ftlm.tasks``, split ``test``) are drawn once
from the policy through the engine; the strategies then see the first ``N`` of them for every
``N`` in 1, 2, 4, ..., ``N_max`` (the usual nested subsampling):

* ``first sample`` (N = 1 whatever N is: the baseline), ``self-consistency`` (majority vote),
* ``best-of-N`` and ``weighted best-of-N`` scored by the policy's confidence and, with
  ``--verifier``, by the verifier model's P(yes),
* ``oracle`` (any of the N correct: pass@N, the ceiling of a perfect verifier).

Inference FLOPs per task: ``2 x N_params`` per token through each model (policy: prompt and
completion of every sample; verifier: every verification prompt), attention left out. With
``--large-policy``, the larger model's single-sample accuracy and FLOPs are reported next to the
small policy's strategies at the nearest FLOPs (the matched-FLOPs claim). Accuracy is the mean
over seeds with a 95% t-interval. Plots go next to BENCHMARKS.md under ``bench/results/``.

``--quick`` runs random tiny models (a smoke test of the pipeline: accuracies are ~0) and
writes nothing.

    python -m bench.test_time_scaling --policy runs/sft-small --verifier runs/verifier \\
        [--large-policy runs/sft-base] [--tasks 200] [--n-max 64] [--seeds 3] [--no-write]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

from bench.common import REPO_ROOT, section_header, table, write_section
from ftlm.infer import Engine, SamplingParams
from ftlm.infer import strategies as st
from ftlm.infer.chat import chat_stop_ids, render_chat
from ftlm.infer.verifier import verification_messages
from ftlm.model.counts import param_count
from ftlm.tasks import Task, check
from ftlm.tasks import generate as generate_tasks

SECTION = "test_time_scaling"
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 9: 2.262}


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval (0 for one value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    t = T95.get(len(values) - 1, 1.96)
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))


def sample_pool(engine: Engine, tok, tasks: list[Task], n: int, params: SamplingParams,
                chat: bool) -> tuple[list[list[st.Candidate]], list[int]]:
    prompts = [render_chat([{"role": "user", "content": t.prompt}], tok) if chat
               else tok.encode(t.prompt) for t in tasks]
    return st.sample_candidates(engine, tok, prompts, n, params), [len(p) for p in prompts]


def evaluate(tasks, pools, prompt_lens, ns, policy_params, verifier, verifier_params):
    """{strategy: {N: (accuracy, flops per task)}} for one seed."""
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
                vcost = cost + 2.0 * verifier_params * sum(
                    len(render_chat(verification_messages(task.prompt, c.text), verifier.tokenizer))
                    for c in cands)
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
        by_flops.scatter([large[1]], [large[0]], marker="*", s=150, color="black",
                         label="larger policy, 1 sample", zorder=5)
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
    p.add_argument("--large-policy", default="", help="run directory of a larger policy")
    p.add_argument("--tasks", type=int, default=200, help="held-out tasks (default 200)")
    p.add_argument("--families", default="add,mod,sort,count", help="task families")
    p.add_argument("--n-max", type=int, default=64, help="largest N, a power of 2 (default 64)")
    p.add_argument("--seeds", type=int, default=3, help="seeds (default 3)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--no-chat", action="store_true", help="prompt without the chat template")
    p.add_argument("--quick", action="store_true", help="random tiny models, prints only")
    p.add_argument("--note", default="", help="a line on how the models were trained (written "
                                               "under the table)")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    from ftlm.infer.load import load_run
    from ftlm.infer.verifier import Verifier
    if args.quick:
        return _quick()
    if not args.policy:
        p.error("--policy RUN_DIR is required (or --quick)")
    if args.n_max < 1 or args.n_max & (args.n_max - 1):
        p.error(f"--n-max={args.n_max} must be a power of 2")
    started = time.perf_counter()
    policy = load_run(args.policy)
    tok = policy.tokenizer
    verifier = None
    vparams = 0
    if args.verifier:
        judge = load_run(args.verifier)
        verifier, vparams = Verifier(judge.model, judge.tokenizer), param_count(judge.model.cfg)
    tasks = generate_tasks(args.families, "test", args.tasks, 0)
    ns = [2 ** i for i in range(int(math.log2(args.n_max)) + 1)]
    chat = not args.no_chat
    per_seed = []
    for seed in range(args.seeds):
        engine = Engine(policy.model, max_batch=args.max_batch, eos_id=tok.eos_id,
                        detokenize=tok.decode)
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                seed=seed * 100_003, stop_ids=chat_stop_ids(tok) if chat else ())
        pools, plens = sample_pool(engine, tok, tasks, args.n_max, params, chat)
        per_seed.append(evaluate(tasks, pools, plens, ns, param_count(policy.model.cfg),
                                 verifier, vparams))
        print(f"seed {seed} done", flush=True)
    results = {name: {n: (*interval([s[name][n][0] for s in per_seed]),
                          statistics.fmean(s[name][n][1] for s in per_seed)) for n in ns}
               for name in per_seed[0]}
    large = None
    if args.large_policy:
        big = load_run(args.large_policy)
        accs, cost = [], []
        for seed in range(args.seeds):
            engine = Engine(big.model, max_batch=args.max_batch, eos_id=big.tokenizer.eos_id,
                            detokenize=big.tokenizer.decode)
            params = SamplingParams(max_new_tokens=args.max_new_tokens,
                                    temperature=args.temperature, seed=seed * 100_003,
                                    stop_ids=chat_stop_ids(big.tokenizer) if chat else ())
            pools, plens = sample_pool(engine, big.tokenizer, tasks, 1, params, chat)
            r = evaluate(tasks, pools, plens, [1], param_count(big.model.cfg), None, 0)
            accs.append(r["first sample"][1][0])
            cost.append(r["first sample"][1][1])
        large = (statistics.fmean(accs), statistics.fmean(cost), interval(accs)[1])
    figure = plot(results, REPO_ROOT / "bench" / "results" / "test_time_scaling.png",
                  large[:2] if large else None)
    rows = [[name, n, f"{acc:.3f} ± {half:.3f}", f"{flops:.3g}"]
            for name, per_n in results.items() for n, (acc, half, flops) in sorted(per_n.items())]
    body = (section_header("Test-time scaling: accuracy vs N and vs inference FLOPs",
                           "bench.test_time_scaling", [])
            + f"* Policy: `{args.policy}` ({param_count(policy.model.cfg) / 1e6:.2f}M)"
            + (f"; verifier `{args.verifier}` ({vparams / 1e6:.2f}M)" if verifier else "")
            + f"; {args.tasks} held-out tasks ({args.families}), {args.seeds} seeds, temperature "
              f"{args.temperature}, up to {args.max_new_tokens} new tokens. Took "
              f"{time.perf_counter() - started:.0f} s. Plot: `bench/results/{figure.name}`\n\n"
            + table(["strategy", "N", "accuracy (95% CI)", "FLOPs per task"], rows))
    if large:
        body += (f"\n\nLarger policy `{args.large_policy}`, one sample: accuracy "
                 f"{large[0]:.3f} ± {large[2]:.3f} at {large[1]:.3g} FLOPs per task.")
    if args.note:
        body += "\n\n" + args.note
    print(body)
    if not args.no_write:
        write_section(SECTION, body)
    return 0


def _quick() -> int:
    """The whole pipeline on random tiny models (accuracies ~0): a smoke test."""
    import tempfile

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
    result = evaluate(tasks, pools, plens, [1, 2, 4], param_count(cfg), Verifier(model, tok),
                      param_count(cfg))
    for name, per_n in result.items():
        print(name, {n: f"{a:.2f} @ {f:.3g} FLOPs" for n, (a, f) in per_n.items()})
    with tempfile.TemporaryDirectory() as tmp:
        shaped = {name: {n: (a, 0.0, f) for n, (a, f) in per_n.items()}
                  for name, per_n in result.items()}
        print("plot:", plot(shaped, Path(tmp) / "scaling.png", (0.0, 1e7)).stat().st_size, "bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
