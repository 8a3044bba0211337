"""``ftlm generate``, ``ftlm serve`` and ``ftlm verifier``: the command lines of the inference
engine, its server and the verifier.

Not responsible for: generation (``ftlm.infer.engine``), strategies (``ftlm.infer.strategies``),
HTTP (``ftlm.serve``) or training the verifier (``ftlm.post.run``); this module parses arguments,
loads the model, composes those and prints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# As ftlm.infer.strategies names them (a test keeps the two equal); here so that registering the
# commands does not import torch.
STRATEGIES = ("sample", "self-consistency", "best-of-n", "weighted-best-of-n", "beam-search")
SCORERS = ("confidence", "has-answer")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="run directory of a finished `ftlm train` (config.toml and "
                                 "model.safetensors), or its model.safetensors")
    p.add_argument("--tokenizer", default="", help="tokenizer.json (default: the run's)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 or auto (default)")
    p.add_argument("--dtype", default="auto",
                   help="float32, bfloat16, float16 or auto (bfloat16 on CUDA, else float32)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="sequences decoded together, the KV-cache slots (default 8)")
    p.add_argument("--compile", action="store_true",
                   help="compile the decode step with torch.compile (slow start, faster decode)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per completion (128)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=0, help="keep exactly k tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p filter (0: off)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="seed (sample i of a prompt uses seed+i)")


def _load_run(path: str | Path, **kwargs):
    """A finished run's model (``ftlm.infer.load.load_run``), its config.toml read by the
    composition root (``ftlm.config``)."""
    from ftlm.config import load_config
    from ftlm.infer.load import load_run
    return load_run(path, read_config=load_config, **kwargs)


def _load(args: argparse.Namespace):
    from ftlm.errors import ConfigError
    from ftlm.infer.engine import Engine
    loaded = _load_run(args.model, tokenizer=args.tokenizer or None, device=args.device,
                       dtype=args.dtype)
    if loaded.tokenizer is None:
        raise ConfigError(f"no tokenizer found for {args.model}: pass --tokenizer tokenizer.json")
    tok = loaded.tokenizer
    engine = Engine(loaded.model, max_batch=args.max_batch, eos_id=tok.eos_id,
                    detokenize=tok.decode, compile=args.compile)
    return loaded, engine


def cmd_generate(args: argparse.Namespace) -> int:
    from ftlm.errors import ConfigError
    from ftlm.infer import strategies as st
    from ftlm.infer.chat import chat_stop_ids, render_chat
    from ftlm.infer.sampling import SamplingParams
    texts: list[str] = list(args.prompt)
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise ConfigError(f"--prompts-file {path} does not exist")
        texts += [line for line in path.read_text().splitlines() if line.strip()]
    tasks = []
    if args.tasks:
        from ftlm.tasks import generate as generate_tasks
        tasks = generate_tasks(args.families, args.split, args.tasks, args.seed)
        texts += [t.prompt for t in tasks]
    if not texts:
        raise ConfigError("nothing to generate from: give --prompt TEXT, --prompts-file or --tasks N")
    if args.n < 1:
        raise ConfigError(f"-n={args.n} must be at least 1")
    if args.strategy != "sample" and args.scorer not in (*st.SCORERS, "oracle", "verifier"):
        raise ConfigError(f"--scorer={args.scorer!r}; valid: {', '.join(st.SCORERS)}, oracle, "
                          "verifier")
    if args.scorer == "verifier" and not args.verifier:
        raise ConfigError("--scorer verifier needs --verifier RUN_DIR (a model trained with "
                          "`ftlm sft` on `ftlm verifier data`)")
    if args.thinking_budget and args.n > 1:
        raise ConfigError("--thinking-budget runs one sample per prompt; drop -n")
    if args.scorer == "oracle" and not tasks:
        raise ConfigError("--scorer oracle checks answers of --tasks only")
    if args.strategy == "beam-search":
        if not args.verifier:
            raise ConfigError("--strategy beam-search needs --verifier RUN_DIR (the process "
                              "scorer; `ftlm verifier train`)")
        if args.thinking_budget:
            raise ConfigError("--strategy beam-search and --thinking-budget do not combine")
        width = args.beam_width or min(4, args.n)
        if args.n % width:
            raise ConfigError(f"--beam-width={width} must divide -n={args.n}")
    loaded, engine = _load(args)
    tok = loaded.tokenizer
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            stop=tuple(args.stop), seed=args.seed,
                            stop_ids=chat_stop_ids(tok) if args.chat else ())
    if args.chat:
        prompts = [render_chat([{"role": "user", "content": t}], tok) for t in texts]
    else:
        prompts = [[tok.bos_id] + tok.encode(t) if args.bos else tok.encode(t) for t in texts]
    for p in prompts:
        engine.check_prompt(p)
    searched = None
    if args.strategy == "beam-search":
        from ftlm.infer.search import beam_search
        judge = _verifier(args.verifier, args.device, args.dtype)
        searched = beam_search(engine, tok, prompts, texts, judge.probabilities, args.n,
                               args.beam_width or min(4, args.n), params)
        cands = [r.choice.candidates for r in searched]
    elif args.thinking_budget:
        cands = [[c] for c in st.thinking_budget(engine, tok, prompts, args.thinking_budget,
                                                params)]
    else:
        cands = st.sample_candidates(engine, tok, prompts, args.n, params)
    if searched is not None:
        scorer = st.confidence  # unused: the search has picked
    elif args.scorer == "verifier":
        scorer = _verifier(args.verifier, args.device, args.dtype, args.verifier_head)
        for text, row in zip(texts, cands):
            scorer.score_all(text, row)  # batched; best_of_n then reads the memo
    elif args.scorer == "oracle":
        scorer = st.task_checker({t.prompt: t for t in tasks})
    else:
        scorer = st.SCORERS.get(args.scorer, st.confidence)
    correct = 0
    for i, (text, row) in enumerate(zip(texts, cands)):
        if searched is not None:
            choice = searched[i].choice
        elif args.strategy == "self-consistency":
            choice = st.self_consistency(row)
        elif args.strategy == "best-of-n":
            choice = st.best_of_n(row, text, scorer)
        elif args.strategy == "weighted-best-of-n":
            choice = st.weighted_best_of_n(row, text, scorer)
        else:
            choice = st.Choice(row[0].text, row[0].answer, row)
        ok = None
        if i >= len(texts) - len(tasks) and tasks:
            from ftlm.tasks import check
            ok = check(tasks[i - (len(texts) - len(tasks))], choice.text)
            correct += bool(ok)
        if args.json:
            record = {"prompt": text, "completion": choice.text, "answer": choice.answer,
                      "tokens_generated": choice.tokens_generated}
            if args.n > 1 or args.strategy != "sample":
                record["samples"] = [c.text for c in row]
                record["votes"] = choice.votes
            if ok is not None:
                record["correct"] = ok
            print(json.dumps(record), flush=True)
        else:
            if len(texts) > 1:
                print(f"--- prompt {i}")
            print(choice.text if args.chat else text + choice.text, flush=True)
    if tasks:
        print(f"accuracy {correct}/{len(tasks)} = {correct / len(tasks):.3f} ({args.strategy}, "
              f"n={args.n})", file=sys.stderr)
    return 0


def cmd_verifier_data(args: argparse.Namespace) -> int:
    from ftlm.errors import ConfigError
    from ftlm.tasks import generate as generate_tasks
    if args.n < 1:
        raise ConfigError(f"--n={args.n} must be at least 1")
    if args.policy:
        if args.split != "train":
            raise ConfigError(f"--split={args.split}: labels from --policy samples come from the "
                              "train split only (the held-out split measures the verifier)")
        records, counts = _sample_verifier_data(args, args.policy, args.families)
        from ftlm.infer.verifier_data import write_records
        path = write_records(records, Path(args.out))
        print(f"{_counts_line(counts)}; written to {path}")
        return 0
    from ftlm.infer.verifier import write_verifier_data
    tasks = generate_tasks(args.families, args.split, args.n, args.seed)
    path = write_verifier_data(tasks, Path(args.out), wrong_per_task=args.wrong, seed=args.seed)
    print(f"{len(tasks) * (1 + args.wrong)} labelled solutions of {len(tasks)} {args.split} tasks "
          f"written to {path}; train a verifier with `ftlm sft` on it")
    return 0


def _sample_verifier_data(args: argparse.Namespace, policy_path: str, families: str):
    """Sample ``args.samples`` completions of ``args.n`` train tasks from the policy; label them."""
    from ftlm.errors import ConfigError
    from ftlm.infer.chat import chat_stop_ids
    from ftlm.infer.engine import Engine
    from ftlm.infer.sampling import SamplingParams
    from ftlm.infer.verifier_data import sampled_records
    from ftlm.tasks import generate as generate_tasks
    if args.samples < 1:
        raise ConfigError(f"--samples={args.samples} must be at least 1")
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    policy = _load_run(policy_path, device=args.device)
    if policy.tokenizer is None:
        raise ConfigError(f"no tokenizer found for the policy {policy_path}")
    tok = policy.tokenizer
    engine = Engine(policy.model, max_batch=args.max_batch, eos_id=tok.eos_id,
                    detokenize=tok.decode)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            seed=args.seed, stop_ids=chat_stop_ids(tok))
    tasks = generate_tasks(families, "train", args.n, args.seed)
    return sampled_records(engine, tok, tasks, args.samples, params,
                           process=not args.outcome_labels, seed=args.seed)


def _counts_line(c: dict) -> str:
    return (f"{c['samples']} samples of {c['tasks']} train tasks, {c['correct_samples']} correct; "
            f"{c['completions']} distinct completions, {c['lines']} lines labelled "
            f"({c['yes_lines']} yes)")


def cmd_verifier_train(args: argparse.Namespace) -> int:
    """Sample the policy on train tasks, label by the checkers, then ``ftlm sft`` the verifier."""
    from ftlm.config import load_config
    from ftlm.errors import ConfigError
    from ftlm.infer.verifier_data import write_records
    from ftlm.model.counts import param_count
    from ftlm.observe.report import format_summary
    from ftlm.post import run
    if args.n < 1:
        raise ConfigError(f"--n={args.n} must be at least 1")
    config = load_config(args.config, args.overrides)
    policy_cfg = _load_run(args.policy, device="cpu").model.cfg
    small, big = param_count(config.model), param_count(policy_cfg)
    if small >= big and not args.allow_larger:
        raise ConfigError(f"the verifier ({small / 1e6:.2f}M parameters, [model] of {args.config}) "
                          f"is not smaller than the policy ({big / 1e6:.2f}M); shrink it with "
                          "--set model.dim=... or pass --allow-larger")
    data = config.run.path / "verifier_data.jsonl"
    records, counts = _sample_verifier_data(args, args.policy, args.families or
                                            config.post.families)
    write_records(records, data)
    # What labelling cost (policy samples drawn), kept beside the data: the verifier's training
    # compute is its run's tokens plus these samples (bench.test_time_scaling amortises both).
    data.with_suffix(".counts.json").write_text(json.dumps(counts))
    print(f"{_counts_line(counts)}; training the verifier ({small / 1e6:.2f}M parameters, policy "
          f"{big / 1e6:.2f}M) on {data}", flush=True)
    config = load_config(args.config, [*args.overrides, f"post.data={data}"])
    print(format_summary(run.run("sft", config)))
    print(f"verifier written to {config.run.path}; use it with `ftlm generate --scorer verifier "
          f"--verifier {config.run.path}` or `ftlm serve --verifier {config.run.path}`")
    return 0


def _serve_token(args: argparse.Namespace, loaded) -> str:
    """The bearer key: FTLM_TOKEN, else --token-file, else the run's job token."""
    from ftlm.errors import ConfigError
    if os.environ.get("FTLM_TOKEN"):
        return os.environ["FTLM_TOKEN"].strip()
    if args.token_file:
        path = Path(args.token_file)
        if not path.is_file():
            raise ConfigError(f"--token-file {path} does not exist")
        return path.read_text().strip()
    if loaded.config is not None and loaded.config.ft.token_file:
        return loaded.config.ft.read_token()
    run_token = loaded.run_dir / "token" if loaded.run_dir else None
    if run_token is not None and run_token.is_file():
        return run_token.read_text().strip()
    return ""


def _verifier(path: str, device: str, dtype: str, head: str = ""):
    """A ``Verifier`` over the model of run directory ``path``; with ``head`` (a JSON file of
    ``ftlm verifier head``), an ``OutcomeVerifier`` of that model and head."""
    from ftlm.errors import ConfigError
    from ftlm.infer.verifier import Verifier
    judge = _load_run(path, device=device, dtype=dtype)
    if judge.tokenizer is None:
        raise ConfigError(f"no tokenizer found for the verifier {path}")
    if head:
        from ftlm.infer.outcome import OutcomeVerifier, load_head
        return OutcomeVerifier(judge.model, judge.tokenizer, load_head(Path(head)))
    return Verifier(judge.model, judge.tokenizer)


def cmd_verifier_head(args: argparse.Namespace) -> int:
    """Sample the policy on train tasks, label by the checkers, fit an outcome head."""
    import torch

    from ftlm.errors import ConfigError
    from ftlm.infer import strategies as st
    from ftlm.infer.chat import chat_stop_ids, render_chat
    from ftlm.infer.engine import Engine
    from ftlm.infer.outcome import fit_head, likelihood_features, save_head
    from ftlm.infer.sampling import SamplingParams
    from ftlm.infer.verifier_data import check_train_split
    from ftlm.model.counts import param_count
    from ftlm.tasks import check
    from ftlm.tasks import generate as generate_tasks
    if args.n < 1 or args.samples < 1:
        raise ConfigError(f"--n={args.n} and --samples={args.samples} must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    judge = _load_run(args.model, device=args.device)
    policy = _load_run(args.policy, device=args.device)
    if judge.tokenizer is None or policy.tokenizer is None:
        raise ConfigError(f"no tokenizer found for {args.model if judge.tokenizer is None else args.policy}")
    small, big = param_count(judge.model.cfg), param_count(policy.model.cfg)
    if small >= big and not args.allow_larger:
        raise ConfigError(f"the verifier {args.model} ({small / 1e6:.2f}M parameters) is not "
                          f"smaller than the policy ({big / 1e6:.2f}M); pass --allow-larger")
    tasks = generate_tasks(args.families, "train", args.n, args.seed)
    check_train_split(tasks)
    tok = policy.tokenizer
    engine = Engine(policy.model, max_batch=args.max_batch, eos_id=tok.eos_id,
                    detokenize=tok.decode)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            seed=args.seed, stop_ids=chat_stop_ids(tok))
    prompts = [render_chat([{"role": "user", "content": t.prompt}], tok) for t in tasks]
    pools = st.sample_candidates(engine, tok, prompts, args.samples, params)
    # Each distinct completion of a task once: the head should not learn a policy's repeats.
    pairs = list(dict.fromkeys((t.prompt, c.text) for t, pool in zip(tasks, pools) for c in pool))
    by_prompt = {t.prompt: t for t in tasks}
    labels = [check(by_prompt[p], c) for p, c in pairs]
    rows = likelihood_features(judge.model, judge.tokenizer, pairs)
    info = {"model": args.model, "policy": args.policy, "families": args.families,
            "tasks": len(tasks), "samples": len(tasks) * args.samples,
            "distinct": len(pairs), "right": sum(labels)}
    head = fit_head(rows, labels, info=info)
    path = save_head(head, Path(args.out))
    print(f"{info['samples']} samples of {len(tasks)} train tasks, {len(pairs)} distinct, "
          f"{sum(labels)} right; head written to {path}; use it with `--verifier {args.model} "
          f"--verifier-head {path}`")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from ftlm.serve import ServeConfig, Server
    scorer = (_verifier(args.verifier, args.device, args.dtype, args.verifier_head)
              if args.verifier else None)
    loaded, engine = _load(args)
    config = ServeConfig(host=args.host, port=args.port, model_name=args.name or loaded.name,
                         token=_serve_token(args, loaded), insecure=args.insecure,
                         max_batch=args.max_batch, max_queue=args.max_queue, max_n=args.max_n,
                         default_max_tokens=args.default_max_tokens)
    Server(engine, loaded.tokenizer, config, scorer=scorer).serve_forever()
    return 0


def _add_verifier_data_args(p: argparse.ArgumentParser, families: str = "add,mod,sort,count",
                            policy: bool = False, outcome_labels: bool = True) -> None:
    if policy:  # the verifier's training commands: a policy to sample, smaller by default
        p.add_argument("--policy", required=True, metavar="RUN_DIR", help="the policy to sample")
        p.add_argument("--allow-larger", action="store_true",
                       help="allow a verifier as large as the policy or larger")
    p.add_argument("--n", type=int, default=2000, help="tasks (default 2000)")
    p.add_argument("--families", default=families,
                   help="task families (default: " + (families or "the config's post.families")
                        + ")")
    p.add_argument("--seed", type=int, default=0, help="seed of the tasks and samples (default 0)")
    p.add_argument("--samples", type=int, default=8, help="with a policy: samples per task (8)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0.8)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens per sample (96)")
    p.add_argument("--max-batch", type=int, default=64, help="sequences decoded together (64)")
    p.add_argument("--device", default="cpu", help="device of the policy (default cpu)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads while sampling (default 1; 0: torch's default)")
    if not outcome_labels:
        return
    p.add_argument("--outcome-labels", action="store_true",
                   help="label every line with the sample's outcome instead of its own check "
                        "(the ablation of the process labels)")


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``ftlm generate`` and ``ftlm serve``."""
    p = sub.add_parser("generate", help="generate text from a trained model (KV-cache engine, "
                                        "batched; best-of-N, self-consistency, thinking budget)")
    _add_model_args(p)
    _add_sampling_args(p)
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompts-file", default="", help="a text file, one prompt per line")
    p.add_argument("--tasks", type=int, default=0, metavar="N",
                   help="also prompt with N tasks of ftlm.tasks and report the accuracy")
    p.add_argument("--split", default="test", help="split of --tasks (default test: held out)")
    p.add_argument("--families", default="add,mod,sort,count", help="families of --tasks")
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user message of the chat template")
    p.add_argument("--bos", action="store_true", help="start each prompt with <|bos|>")
    p.add_argument("-n", type=int, default=1, help="samples per prompt (default 1)")
    p.add_argument("--strategy", default="sample", choices=STRATEGIES,
                   help="how to pick among the n samples (default: the first sample); "
                        "beam-search: step-level search, n partials per round, scored by "
                        "--verifier")
    p.add_argument("--scorer", default="confidence",
                   help=f"scorer of best-of-n: {', '.join(SCORERS)}, verifier (--verifier), or "
                        "oracle (the exact task checker; --tasks only: an upper bound)")
    p.add_argument("--verifier", default="", metavar="RUN_DIR",
                   help="verifier model (`ftlm verifier train`): --scorer verifier, beam-search")
    p.add_argument("--verifier-head", default="", metavar="JSON",
                   help="outcome head of --verifier (`ftlm verifier head`): score whole samples "
                        "by it instead of line by line")
    p.add_argument("--beam-width", type=int, default=0,
                   help="beam-search: next steps sampled per kept partial; n/width partials are "
                        "kept per round (default min(4, n))")
    p.add_argument("--thinking-budget", type=int, default=0, metavar="TOKENS",
                   help="cap the reasoning at TOKENS, then force </think> and the answer")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("verifier", help="line-by-line verifier for best-of-N and beam "
                                        "search: its training data, its training")
    vsub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    vp = vsub.add_parser("data", help="write labelled solutions of the task suite as JSONL for "
                                      "`ftlm sft`: with --policy, the policy's samples labelled "
                                      "by the exact checkers; without, reference solutions (yes) "
                                      "and changed final answers (no)")
    vp.add_argument("--out", required=True, help="output .jsonl")
    vp.add_argument("--policy", default="", metavar="RUN_DIR",
                    help="label samples of this policy (train split only)")
    vp.add_argument("--wrong", type=int, default=1,
                    help="without --policy: wrong solutions per task (default 1)")
    vp.add_argument("--split", default="train", help="task split (default train)")
    _add_verifier_data_args(vp)
    vp.set_defaults(fn=cmd_verifier_data)
    vt = vsub.add_parser("train", help="sample a policy on train tasks, label the samples with "
                                       "the exact checkers, and train a (smaller) verifier on "
                                       "them with `ftlm sft` (a yes/no verdict after every "
                                       "line)")
    vt.add_argument("config", help="TOML run config of the verifier (its [model], [train], "
                                   "run.dir), e.g. configs/tiny.toml --set model.dim=64")
    vt.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="SECTION.KEY=VALUE", help="override a verifier config field")
    _add_verifier_data_args(vt, families="", policy=True)
    vt.set_defaults(fn=cmd_verifier_train)
    vh = vsub.add_parser("head", help="fit an outcome head: a small `ftlm sft` model reads the "
                                      "policy's samples of train tasks (its likelihood of the "
                                      "work and of the answer line given the work), a logistic "
                                      "head learns right vs wrong from them (balanced)")
    vh.add_argument("model", help="run directory of the verifier model (an `ftlm sft` model of "
                                  "the task suite, smaller than the policy)")
    vh.add_argument("--out", required=True, help="output .json (the head)")
    _add_verifier_data_args(vh, families="add", policy=True, outcome_labels=False)
    vh.set_defaults(fn=cmd_verifier_head)

    p = sub.add_parser("serve", help="serve a trained model over an OpenAI-compatible HTTP API")
    _add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free)")
    p.add_argument("--name", default="", help="model id in the API (default: the run's name)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="sequences that may wait for a slot before requests get 429 (64)")
    p.add_argument("--max-n", type=int, default=8, help="largest n per request (default 8)")
    p.add_argument("--default-max-tokens", type=int, default=128,
                   help="max_tokens of requests that give none (default 128)")
    p.add_argument("--token-file", default="",
                   help="file holding the bearer key (default: FTLM_TOKEN, the run's job token)")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without a token")
    p.add_argument("--verifier", default="", metavar="RUN_DIR",
                   help="verifier model (`ftlm verifier train`) that scores the samples of "
                        "requests with strategy best-of-n / weighted-best-of-n (default: the "
                        "policy's confidence)")
    p.add_argument("--verifier-head", default="", metavar="JSON",
                   help="outcome head of --verifier (`ftlm verifier head`): score whole samples "
                        "by it instead of line by line")
    p.set_defaults(fn=cmd_serve)
