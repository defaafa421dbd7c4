"""The hashed n-gram table's own work per training step (T3.19), without the model: a micro-batch's load
(hashing, the distinct rows, their gather into the row cache), the keeping of its row gradients, and the
table's row-wise RMSprop step (per-row sums of the kept micro-batches, the update), at the stages' tokens per
micro-batch, on real tokens. The calls are train_gpt.NgramTable's own (load, keep_gradient, step).

    python bench/bench_row_tables.py [--rows 10575360] [--tokens 16384,32768,49152] [--kept 2] [--repeats 20]
                                     [--profile]

Tokens: the first shard of TRAIN_FILES (the environment of a run, which bench/lease.sh exports), each
micro-batch a stretch of it further on; without TRAIN_FILES, random ids from a Zipf law over the
vocabulary (more distinct n-grams than text has). --kept: micro-batches whose gradients one optimizer step
sums (2 in rank-slice mode, where Adam runs every other step, T2.7). The update is compiled on a GPU as in
a run (--eager: not). The table is one process's (world size 1), its rows and state allocated in full
(10,575,360 rows: 15.2 GiB with the row-wise state). Prints, per tokens per micro-batch, the median ms of
each part over --repeats (after 3 untimed ones), the distinct rows a micro-batch reads, and the table's
ms per training step in rank-slice (a load and a keep every step, the optimizer step every --kept steps);
--profile adds the largest GPU kernels of one repeat per size.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt as T  # noqa: E402

WARMUP = 3


def token_source(train_files: str | None, needed: int, vocab: int, seed: int) -> np.ndarray:
    """`needed` tokens: the start of the first shard that `train_files` names, or Zipf-distributed ids."""
    if train_files:
        path = T.find_shards(train_files)[0]  # no match or a damaged header: its one-line error
        tokens = T.Shard(path, pin_memory=False).tokens
        if tokens.size < needed:
            raise SystemExit(f"{path}: {tokens.size} tokens, the benchmark reads {needed}: give fewer --repeats")
        return tokens[:needed].astype(np.int64)
    rng = np.random.default_rng(seed)
    return np.minimum(rng.zipf(1.2, needed) - 1, vocab - 1).astype(np.int64)


class Clock:
    """Wall ms of a call, the device drained before and after it."""

    def __init__(self, device: torch.device):
        self.device = device

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn):
        self.sync()
        start = time.perf_counter()
        result = fn()
        self.sync()
        return result, (time.perf_counter() - start) * 1e3


def build_table(rows: int, max_tokens: int, device: torch.device, compile: bool = True) -> T.NgramTable:
    """One process's n-gram table (world size 1) of `rows` rows, all of them allocated with their state, its
    row cache sized for micro-batches of up to `max_tokens` tokens; the update compiled on a GPU with `compile`."""
    cfg = T.ModelConfig(ngram_rows=rows)
    return T.NgramTable(cfg, max_tokens, max_tokens).to(device).shard(T.OptimConfig(), compile=compile)


def measure(table: T.NgramTable, tokens: np.ndarray, per_batch: int, kept: int, repeats: int,
            device: torch.device, profile: bool = False) -> dict:
    """Median ms of load, keep and step over `repeats` optimizer steps (after WARMUP), each of `kept`
    micro-batches of `per_batch` consecutive tokens; the distinct rows per micro-batch; with `profile`, the
    largest kernels of one more repeat. The table's rows and state change as a run's would; the backward's
    per-row gradient sums are a fixed random tensor of the cache's shape."""
    cache = table.cache_for(per_batch)
    grad = torch.randn(cache.shape, generator=torch.Generator().manual_seed(0)).mul_(1e-3).to(device, cache.dtype)
    clock = Clock(device)
    loads, keeps, steps, distinct_counts = [], [], [], []
    batch = 0

    def one_repeat(record: bool):
        nonlocal batch
        for _ in range(kept):
            start = (batch * per_batch) % (tokens.size - per_batch + 1)
            ids = torch.from_numpy(tokens[start: start + per_batch]).to(device)
            batch += 1
            distinct, ms_load = clock(lambda: table.load(ids))
            _, ms_keep = clock(lambda: table.keep_gradient(distinct, grad))
            if record:
                loads.append(ms_load)
                keeps.append(ms_keep)
                distinct_counts.append(int((distinct < table.rows).sum()))
        _, ms_step = clock(lambda: table.step(1.0, adam=True))
        if record:
            steps.append(ms_step)

    for r in range(WARMUP + repeats):
        one_repeat(record=r >= WARMUP)
    result = {"tokens": per_batch, "load_ms": statistics.median(loads), "keep_ms": statistics.median(keeps),
              "step_ms": statistics.median(steps), "distinct": statistics.mean(distinct_counts),
              "distinct_counts": distinct_counts}
    result["per_step_ms"] = result["load_ms"] + result["keep_ms"] + result["step_ms"] / kept
    if profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            one_repeat(record=False)
            clock.sync()
        sort_by = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        result["profile"] = prof.key_averages().table(sort_by=sort_by, row_limit=15)
    return result


def table_markdown(results: list[dict], rows: int, kept: int, source: str) -> str:
    lines = [f"n-gram table: {rows:,} rows, row-wise RMSprop, {kept} micro-batches per optimizer step, "
             f"tokens: {source}", "",
             "| tokens per micro-batch | distinct rows | load ms | keep ms | optimizer step ms | ms per step |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['tokens']:,} | {r['distinct']:,.0f} | {r['load_ms']:.3f} | {r['keep_ms']:.3f} | "
                     f"{r['step_ms']:.3f} | {r['per_step_ms']:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_575_360)
    parser.add_argument("--tokens", default="16384,32768,49152", help="tokens per micro-batch, comma-separated")
    parser.add_argument("--kept", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--eager", action="store_true", help="the update uncompiled on a GPU too")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sizes = [int(s) for s in args.tokens.split(",")]
    table = build_table(args.rows, max(sizes), device, compile=not args.eager)
    train_files = os.environ.get("TRAIN_FILES")
    needed = max(sizes) * args.kept * (WARMUP + args.repeats + 1)
    tokens = token_source(train_files, needed, T.ModelConfig().vocab_size, args.seed)
    source = f"the first shard of {train_files}" if train_files else "Zipf(1.2) ids"
    results = [measure(table, tokens, n, args.kept, args.repeats, device, args.profile) for n in sizes]
    for r in results:
        if "profile" in r:
            print(f"\n{r['tokens']:,} tokens per micro-batch, one repeat:\n{r['profile']}")
    label = f"{torch.cuda.get_device_name(device)}" if device.type == "cuda" else "CPU"
    print(f"\n{label}, torch {torch.__version__}")
    print(table_markdown(results, args.rows, args.kept, source))
    return results


if __name__ == "__main__":
    main()
