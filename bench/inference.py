"""Benchmark: the KV-cache engine vs ``transformers`` ``generate``, and the server under load.

Part 1, side by side in one run on the same weights (a randomly initialised ftlm model copied into
a ``transformers`` ``LlamaForCausalLM`` through ``ftlm.model.hf``), greedy, a fixed number of new
tokens (EOS ignored), batch 1, 8 and 32:

* *TTFT*: seconds from the call to the first new token of every sequence (prefill plus one
  sample): ``Engine.step`` once vs ``generate(max_new_tokens=1)``;
* *decode tokens/s*: ``batch * (new - 1) / (total - TTFT)`` for a whole generation;
* *same tokens*: the share of sequences whose greedy tokens are equal on both sides.

Repetitions alternate the two sides (ABAB); medians are reported. Part 2 serves the same model
with ``ftlm.serve`` (``max_batch`` 16) and runs 16 concurrent streaming clients (aiohttp, raw
SSE) against it: aggregate tokens/s and the median client-side time to first token.

It does not test accuracy, and its CPU figures are not GPU claims (see the top of BENCHMARKS.md).

    python -m bench.inference [--quick] [--size small,tiny] [--reps N] [--threads 1] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from bench.common import median, section_header, table, write_section
from ftlm.infer import Engine, SamplingParams
from ftlm.model import ModelConfig, Transformer, param_count

SECTION = "inference"
CPU_READING = (
    "Reading: on a CPU both sides run the same matmuls over the same float32 weights, so the "
    "engine can gain only on what surrounds them, and the ratio moves with the load of the shared "
    "box (ABAB medians damp it, they do not remove it). The decode step here is the fused one "
    "(`kv.DecodeWeights`: `wq|wk|wv` and `w1|w3` stacked once at engine start, queries and keys "
    "rotated in one operation, `F.rms_norm`, attention over the filled part of the cache only "
    "and without a mask when every row is at the same position, the drawn token's "
    "log-probability without a full `log_softmax`). At batch 8 the step of `small` is bound by "
    "reading its weights: its matmuls alone stream the 63 MB of weights at about the rate one "
    "core copies memory (the table above), `transformers` reads the same bytes each step and "
    "does the same attention, and an engine with no other cost at all would be about 2x faster "
    "than `transformers` there, no more (the *bound* column). "
    "`tiny` (5 MB of weights, resident in the caches) is bound by per-operator overhead instead "
    "and has room, which is where the engine gains most. Tried on `small` and not kept "
    "(2026-12-01, load ~1): weights stored transposed (`[in, out]`, `x @ w`) halve the time of "
    "one matmul repeated on a matrix hot in the cache, but make the 33 matmuls of a step, which "
    "stream every matrix from memory, slower (10.3 vs 9.0 ms); MKL-packed weights "
    "(`torch.ops.mkl._mkl_linear`, what inductor's freezing uses) take 23% off those 33 "
    "matmuls, only at the batch size they were packed for (others fall back to `F.linear`); "
    "`torch.compile` of the step (CPU inductor, freezing on, session 8) about 20% less CPU per "
    "step; the engine's own `compile=True` (static shapes at `max_seq_len`), on `tiny` at batch "
    "8, was slower than eager (1.24-1.29x of `transformers` against 1.49-1.65x, three "
    "interleaved runs). None of these makes 2x. The >= 2x target needs a step whose cost is not its "
    "weight reads: a GPU, where a small model's decode step is launch-bound (section "
    "`inference_gpu`, not measured: no GPU was lent to this project's sessions), or weights in "
    "bfloat16, a different arithmetic (compared with `transformers` in bfloat16, which then "
    "reads the same halved bytes).")


def target_table(rows: list[list[object]]) -> str:
    """The target row: the batch-8 decode speed-up of each model in ``rows``."""
    at8 = [f"{r[0]}: {r[6]}" for r in rows if r[1] == 8]
    met = all(float(str(r[6]).rstrip("x")) >= 2.0 for r in rows if r[1] == 8)
    return ("| target | result |\n|---|---|\n"
            f"| decode >= 2x `transformers` `generate` at batch 8 | {'; '.join(at8)} "
            f"({'met' if met else 'not met'} on this machine) |")


def hf_copy(model: Transformer):
    """A ``transformers`` LlamaForCausalLM with ``model``'s weights, dtype and device."""
    import transformers

    from ftlm.model.hf import config_to_hf, state_to_hf
    config = transformers.LlamaConfig(**config_to_hf(model.cfg))
    config._attn_implementation = "sdpa"
    hf = transformers.LlamaForCausalLM(config)
    hf.load_state_dict(state_to_hf(model), strict=False)
    hf.tie_weights()
    weight = model.tok_embeddings.weight
    return hf.to(weight.device, weight.dtype).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_engine(model: Transformer, prompts: torch.Tensor, new: int, compile: bool = False
                ) -> tuple[float, float, list[list[int]]]:
    """(TTFT s, total s, tokens) of one greedy batch through a fresh engine."""
    engine = Engine(model, max_batch=prompts.shape[0], compile=compile)
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    device = model.tok_embeddings.weight.device
    _sync(device)
    t0 = time.perf_counter()
    seqs = [engine.add(p, params) for p in prompts.tolist()]
    engine.step()
    ttft = time.perf_counter() - t0
    while engine.has_work():
        engine.step()
    total = time.perf_counter() - t0
    return ttft, total, [s.tokens for s in seqs]


@torch.no_grad()
def time_hf(hf, prompts: torch.Tensor, new: int) -> tuple[float, float, list[list[int]]]:
    """(TTFT s, total s, tokens) of ``transformers`` greedy ``generate`` with its cache."""
    x = prompts.to(hf.device)
    mask = torch.ones_like(x)
    kwargs = {"attention_mask": mask, "do_sample": False, "use_cache": True, "pad_token_id": 0,
              "eos_token_id": None}
    _sync(hf.device)
    t0 = time.perf_counter()
    hf.generate(x, max_new_tokens=1, min_new_tokens=1, **kwargs)
    _sync(hf.device)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = hf.generate(x, max_new_tokens=new, min_new_tokens=new, **kwargs)
    _sync(hf.device)
    total = time.perf_counter() - t0
    return ttft, total, out[:, x.shape[1]:].tolist()


def engine_vs_hf(model: Transformer, batches: list[int], prompt_len: int, new: int, reps: int,
                 label: str = "") -> list[list[object]]:
    hf = hf_copy(model)
    g = torch.Generator().manual_seed(0)
    rows = []
    for batch in batches:
        prompts = torch.randint(0, model.cfg.vocab_size, (batch, prompt_len), generator=g)
        time_engine(model, prompts[:, :8], 4)  # warm-up both sides
        time_hf(hf, prompts[:, :8], 4)
        ours, theirs, same = [], [], 0.0
        for _ in range(reps):
            ours.append(time_engine(model, prompts, new))
            theirs.append(time_hf(hf, prompts, new))
        same = sum(a == b for a, b in zip(ours[-1][2], theirs[-1][2])) / batch

        def rate(r: tuple, batch: int = batch) -> float:
            return batch * (new - 1) / max(r[1] - r[0], 1e-9)
        o_ttft, t_ttft = median(r[0] for r in ours), median(r[0] for r in theirs)
        o_rate, t_rate = median(rate(r) for r in ours), median(rate(r) for r in theirs)
        rows.append([label, batch, f"{o_ttft * 1000:.1f}", f"{t_ttft * 1000:.1f}", f"{o_rate:,.0f}",
                     f"{t_rate:,.0f}", f"{o_rate / t_rate:.2f}x", f"{same:.0%}"])
        print(f"{label} batch {batch}: engine {o_rate:,.0f} tok/s (TTFT {o_ttft * 1000:.1f} ms), "
              f"transformers {t_rate:,.0f} tok/s (TTFT {t_ttft * 1000:.1f} ms)", flush=True)
    return rows


def step_bound(model: Transformer, hf, batch: int, prompt_len: int, new: int, reps: int
               ) -> list[object]:
    """Where one decode step goes (CPU): CPU time (``time.thread_time``) of an engine step and of
    a ``transformers`` decode step (its ``generate`` of ``new`` tokens minus that of 1, over
    ``new - 1``), and of the step's matmuls alone: every decode weight once through ``F.linear``
    with ``batch`` rows, as both sides do each step, and attention alone: each layer's
    ``scaled_dot_product_attention`` of one query per row over the cache at its mean length
    during the run. Both sides do that work, so transformers' step over it bounds the speed-up
    of an engine with no other cost at all."""
    import torch.nn.functional as F

    from ftlm.infer import kv
    w = kv.DecodeWeights.of(model)
    mats = [m for i in range(model.cfg.n_layers)
            for m in (w.wqkv[i], w.wo[i], w.w13[i], w.w2[i])] + [w.output]
    rows = [torch.randn(batch, m.shape[1]) for m in mats]
    weight_bytes = sum(m.numel() * m.element_size() for m in mats)
    cfg = model.cfg
    kv_heads, dim = cfg.n_kv_heads, cfg.head_dim
    q = torch.randn(batch, kv_heads, cfg.n_heads // kv_heads, dim)
    caches = [[torch.randn(batch, kv_heads, prompt_len + new // 2, dim) for _ in range(2)]
              for _ in range(cfg.n_layers)]  # one per layer: read from memory, as in a step
    prompts = torch.randint(0, model.cfg.vocab_size, (batch, prompt_len),
                            generator=torch.Generator().manual_seed(1))
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)

    def ours() -> float:
        engine = Engine(model, max_batch=batch)
        for p in prompts.tolist():
            engine.add(p, params)
        engine.step()  # prefill
        times = []
        while engine.has_work():
            t = time.thread_time()
            engine.step()
            times.append(time.thread_time() - t)
        return median(times)

    @torch.no_grad()
    def theirs() -> float:
        kwargs = {"attention_mask": torch.ones_like(prompts), "do_sample": False,
                  "use_cache": True, "pad_token_id": 0, "eos_token_id": None}
        t = time.thread_time()
        hf.generate(prompts, max_new_tokens=1, min_new_tokens=1, **kwargs)
        one = time.thread_time() - t
        t = time.thread_time()
        hf.generate(prompts, max_new_tokens=new, min_new_tokens=new, **kwargs)
        return (time.thread_time() - t - one) / (new - 1)

    def matmuls() -> float:
        t = time.thread_time()
        for x, m in zip(rows, mats):
            F.linear(x, m)
        return time.thread_time() - t

    def attention() -> float:
        t = time.thread_time()
        for cache in caches:
            F.scaled_dot_product_attention(q, *cache)
        return time.thread_time() - t

    ours(), theirs(), matmuls(), attention()  # warm-up
    o, h, mm, att = [], [], [], []
    for _ in range(reps):  # interleaved
        o.append(ours())
        h.append(theirs())
        mm += [matmuls() for _ in range(10)]
        att += [attention() for _ in range(10)]
    o_s, h_s, mm_s, att_s = median(o), median(h), median(mm), median(att)
    return [f"{o_s * 1e3:.2f}", f"{h_s * 1e3:.2f}", f"{h_s / o_s:.2f}x", f"{mm_s * 1e3:.2f}",
            f"{weight_bytes / 1e6:.1f}", f"{weight_bytes / mm_s / 1e9:.1f}",
            f"{att_s * 1e3:.2f}", f"{(mm_s + att_s) / o_s:.0%}", f"{h_s / (mm_s + att_s):.2f}x"]


def copy_bandwidth(mib: int = 256, reps: int = 5) -> float:
    """GB/s of one thread copying ``mib`` MiB (bytes read plus bytes written)."""
    src = torch.empty(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return 2 * mib * 2**20 / median(times) / 1e9


async def _client(session, url: str, prompt: str, new: int) -> tuple[float, int]:
    body = {"model": "bench", "prompt": prompt, "max_tokens": new, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, tokens = None, 0
    async with session.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if payload["choices"] and payload["choices"][0]["text"]:
                first = first or time.perf_counter() - t0
            if payload.get("usage"):
                tokens = payload["usage"]["completion_tokens"]
    return first or float("nan"), tokens


def server_throughput(model: Transformer, clients: int, new: int) -> list[object]:
    import aiohttp

    from ftlm.serve import ServeConfig, Server

    class ByteCodec:  # bytes as token ids: the server needs a tokenizer, the model is random
        eos_id = 1

        def encode(self, text: str) -> list[int]:
            return [b % model.cfg.vocab_size for b in text.encode()]

        def decode(self, ids) -> str:
            return "".join(chr(32 + i % 90) for i in ids)

    codec = ByteCodec()
    engine = Engine(model, max_batch=clients, detokenize=codec.decode)
    server = Server(engine, codec, ServeConfig(port=0, model_name="bench", max_batch=clients,
                                               max_queue=4 * clients, max_n=1))
    server.start()

    async def run() -> tuple[float, list[tuple[float, int]]]:
        async with aiohttp.ClientSession() as session:
            await _client(session, server.url, "warm up", 4)
            t0 = time.perf_counter()
            results = await asyncio.gather(*(_client(session, server.url, f"client {i} says",
                                                     new) for i in range(clients)))
            return time.perf_counter() - t0, results

    try:
        wall, results = asyncio.run(run())
    finally:
        server.stop()
    tokens = sum(n for _, n in results)
    ttfts = [t for t, _ in results]
    return [clients, new, tokens, f"{wall:.2f}", f"{tokens / wall:,.0f}",
            f"{statistics.median(ttfts) * 1000:.0f}", f"{max(ttfts) * 1000:.0f}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.inference", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke run of well under a minute")
    p.add_argument("--size", default=None,
                   help="named model sizes, comma-separated, the first also serves (default "
                        "small,tiny; tiny with --quick; 1b on CUDA)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3, 1 --quick)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads on CPU (default 1: on a shared box two threads "
                        "stall each other at every operator's barrier)")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    sizes = (args.size or ("tiny" if args.quick else "1b" if device.type == "cuda"
                           else "small,tiny")).split(",")
    reps = args.reps or (1 if args.quick else 3)
    prompt_len, new = (16, 16) if args.quick else (128, 64)
    batches = [1, 8] if args.quick else [1, 8, 32]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    started = time.perf_counter()
    rows, models, bounds = [], [], []
    for size in sizes:
        cfg = ModelConfig(size=size, max_seq_len=min(ModelConfig(size=size).max_seq_len, 1024))
        models.append(Transformer(cfg).to(device, dtype).eval())
        label = f"{size} ({param_count(cfg) / 1e6:.2f}M)"
        rows += engine_vs_hf(models[-1], batches, prompt_len, new, reps, label)
        if device.type == "cpu":
            bounds.append([label, *step_bound(models[-1], hf_copy(models[-1]), 8, prompt_len,
                                              new, max(reps, 3))])
            print(f"{label} batch 8 step: {bounds[-1][1:]}", flush=True)
    model, size = models[0], sizes[0]
    serve = server_throughput(model, 4 if args.quick else 16, new)
    seconds = time.perf_counter() - started
    flags = [f for f, on in (("--quick", args.quick),) if on]
    body = (section_header("Inference: KV-cache engine vs transformers generate; the server "
                           "under concurrent streams", "bench.inference", flags)
            + f"* Models: {', '.join(f'`{x}`' for x in sizes)} (random weights), "
              f"{dtype}, {device.type}, torch threads {torch.get_num_threads()}; prompts of "
              f"{prompt_len} random tokens, {new} new tokens, greedy, EOS ignored\n"
            + "* Method: see `bench/inference.py`: the same weights on both sides, ABAB, "
              f"{reps} repetition(s), medians; TTFT = prefill + first token of the whole batch; "
              "decode tokens/s = batch x (new - 1) / (total - TTFT). "
              f"Took {seconds:.0f} s.\n\n"
            + table(["model", "batch", "ftlm TTFT ms", "transformers TTFT ms", "ftlm decode tok/s",
                     "transformers decode tok/s", "speed-up", "same greedy tokens"], rows)
            + f"\n\nServer (`{size}`, `ftlm.serve`, `max_batch` = clients, streaming "
              "`/v1/completions`, "
              "raw SSE over aiohttp, one client per concurrent stream):\n\n"
            + table(["concurrent clients", "tokens each", "tokens", "wall s",
                     "aggregate tok/s", "median TTFT ms", "max TTFT ms"], [serve]))
    if device.type == "cpu":
        body += ("\n\nWhere a batch-8 decode step goes (`step_bound`: CPU time per step, medians "
                 "of interleaved repetitions; *matmuls alone*: every decode weight once through "
                 "`F.linear` with 8 rows, as both sides do each step; *attention alone*: each "
                 "layer's attention of one query per row over the cache at its mean length; "
                 "*bound*: transformers' step over the two, the speed-up of an engine whose "
                 "every other cost were zero). One thread copying 256 MiB on this machine: "
                 f"{copy_bandwidth():.1f} GB/s (read plus write).\n\n"
                 + table(["model", "ftlm step ms", "transformers step ms", "speed-up",
                          "matmuls alone ms", "weights MB", "weights GB/s", "attention alone ms",
                          "both, of ftlm's step", "bound"], bounds)
                 + "\n\n" + CPU_READING)
    body += "\n\n" + target_table(rows)
    print(body)
    if not args.no_write:
        write_section(SECTION if device.type == "cpu" else f"{SECTION}_gpu", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
