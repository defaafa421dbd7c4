"""Communication in real training steps across ranks (issue #24 item 5): per stage, wall ms/step,
the NCCL kernel time per step and the part of it with no compute kernel running, from a profiler
trace of rank 0, with the NCCL time by collective kind (the n-gram table's exchanges with the rows'
owners, T3.19, are all_to_all: NCCL runs them as SendRecv kernels). An NCCL kernel's time includes its
wait for the other ranks (launch-bound steps launch them early), so the cost of communication is the
wall ms/step against the same steps on one rank (--nproc_per_node=1 --share 8: nothing reduced).

    torchrun --standalone --nproc_per_node=2 bench/profile_comm.py [--share 8] [--stages 1,2,3]
        [--steps 6] [--synthetic] [--out DIR]

--share 8: each rank computes one 8-rank share of the step (no gradient accumulation), the compute an
8-GPU step leaves each GPU; the step then trains on world/8 of the batch, which changes no kernel's
shape. Without it the run is the full batch (accumulation 8/world), as train_gpt.py runs it.

The 8-rank model printed last: a ring reduce-scatter or all-gather moves (w-1)/w of the buffer per
rank, so at equal bus bandwidth its kernel time grows by (7/8)/((w-1)/w) from w ranks to 8 (1.75x from
2); the time with no compute running at 8 then lies between the measured one (the growth hides
behind compute) and that plus the whole growth.

Data: TRAIN_FILES/VAL_FILES as for train_gpt.py, or --synthetic: Zipf-distributed shards written to a
temporary directory (the timing of the steps hardly depends on the text; the n-gram table's exchanges do,
through the distinct rows a batch reads, so the table says which data it ran on).
"""
import argparse
import dataclasses
import json
import os
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_gpt as T  # noqa: E402
from bench_optimizer import trace_summary  # noqa: E402
from profile_stages import stage_step  # noqa: E402

FULL_WORLD = T.RANKS_PER_STEP


def write_synthetic_shards(directory: str, n_train: int = 2, tokens: int = 20_000_000, seed: int = 0):
    """Zipf-distributed GPT-2 ids with a BOS every ~1,000 tokens: patterns for TRAIN_FILES, VAL_FILES."""
    from data.shards import write_shard
    rng = np.random.default_rng(seed)
    vocab, bos = 50257, 50256
    for name in [f"syn_train_{i:06d}.bin" for i in range(1, n_train + 1)] + ["syn_val_000000.bin"]:
        ids = np.minimum(rng.zipf(1.2, tokens) - 1, vocab - 2).astype(np.uint16)
        ids[rng.random(tokens) < 1e-3] = bos
        ids[0] = bos
        write_shard(os.path.join(directory, name), ids)
    return os.path.join(directory, "syn_train_*.bin"), os.path.join(directory, "syn_val_*.bin")


def collective_kind(name: str) -> str:
    for kind in ("ReduceScatter", "AllGather", "AllReduce", "Broadcast", "SendRecv"):
        if kind.lower() in name.lower():
            return kind
    return "other"


def nccl_by_kind(trace_path: str, steps: int) -> dict[str, float]:
    """ms per step of NCCL kernels by collective kind (summed durations)."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    totals: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "kernel" and "nccl" in e["name"].lower():
            kind = collective_kind(e["name"])
            totals[kind] = totals.get(kind, 0.0) + e["dur"] / 1000 / steps
    return totals


def scale_to(world: int, target: int = FULL_WORLD) -> float:
    """Kernel-time factor of a ring collective from `world` to `target` ranks at equal bus bandwidth."""
    return ((target - 1) / target) / ((world - 1) / world)


def eight_rank_model(comm_ms: float, exposed_ms: float, world: int) -> tuple[float, float, float]:
    """(comm at 8 ranks, exposed at 8 if the growth hides, exposed at 8 if none of it hides)."""
    comm8 = comm_ms * scale_to(world)
    return comm8, exposed_ms, exposed_ms + (comm8 - comm_ms)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--share", type=int, choices=[0, FULL_WORLD], default=0,
                        help=f"{FULL_WORLD}: each rank computes one {FULL_WORLD}-rank share (no accumulation)")
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--steps", type=int, default=6, help="timed and profiled steps per stage")
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed steps per stage after the warm-up")
    parser.add_argument("--synthetic", action="store_true", help="Zipf token shards instead of TRAIN_FILES")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if not torch.cuda.is_available():
        raise SystemExit("error: no CUDA GPU visible; run under torchrun "
                         "(--nproc_per_node=1 gives the no-communication baseline)")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl", device_id=device)
    barrier = dist.barrier if world > 1 else (lambda: None)
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        hp = T.Hyperparameters.from_env()
        if args.synthetic:
            shared = [None]
            if rank == 0:
                shared = [write_synthetic_shards(tmp)]
            if world > 1:
                dist.broadcast_object_list(shared, 0)
            hp = hp.replace(train_files=shared[0][0], val_files=shared[0][1], val_tokens=4 * hp.data.val_seq_len)
        T.check_hyperparameters(hp)
        hp = T.rows_for_world(hp, world)  # NGRAM_ROWS_PER_RANK, as main() resolves it
        T.check_ngram_rows(hp, world)  # the table's rows per process fit, as main() checks
        T.allow_graph_per_shape()
        trainer = T.Trainer(hp, rank, world, device, T.RunLog(None))
        if args.share:  # before the warm-up, which captures the step's CUDA graphs with these
            trainer.grad_accum, trainer.grad_scale = 1, 1.0
            if trainer.step_graphs is not None:
                trainer.step_graphs.grad_accum, trainer.step_graphs.grad_scale = 1, 1.0
        trainer.warmup()  # every graph of the run compiled, guards skipped after it as in main()
        loader = T.TrainLoader(hp.data.train_files, rank, world, device, log=lambda _: None, grad_accum=trainer.grad_accum)
        schedule, optimizer = trainer.schedule, trainer.optimizer
        stages = [int(s) for s in args.stages.split(",")]
        mode = f"{args.share}-rank share per GPU" if args.share else f"full batch (accumulation {trainer.grad_accum})"
        lines = [f"device: {torch.cuda.get_device_name(device)} x{world}, torch {torch.__version__}, "
                 f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}; {mode}; "
                 f"data: {'synthetic' if args.synthetic else hp.data.train_files}", "",
                 "| stage | step | wall ms/step | NCCL ms/step (with waits) | of it, no compute running | "
                 "compute ms/step | by kind (ms/step) | 8 ranks: NCCL | 8 ranks: no compute running |",
                 "|---|---|---|---|---|---|---|---|---|"]

        def run(step, n):
            """n steps at `step`, Adam on every other one, non-Adam first: as in the run, each Adam step
            adds the gradient kept from the step before (T2.7). The warm-up compiles no Adam step without one,
            and after it dynamo's guards are skipped (T5.2), so starting on an Adam step (the middle of
            stage 1 is odd) would need a graph the warm-up did not compile."""
            for i in range(n):
                trainer.train_step(dataclasses.replace(schedule.plan(step), adam_step=i % 2 == 1), loader)

        for stage in stages:
            step = stage_step(schedule, stage)
            if schedule.untie_step is not None and step > schedule.untie_step and optimizer.tied:
                optimizer.untie()
            run(step, args.warmup_steps)
            torch.cuda.synchronize()
            barrier()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            run(step, args.steps)
            end.record()
            torch.cuda.synchronize()
            wall = start.elapsed_time(end) / args.steps
            barrier()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                run(step, args.steps)
                torch.cuda.synchronize()
            trace = os.path.join(tmp, f"comm_trace_stage{stage}.json")
            if rank == 0:
                prof.export_chrome_trace(trace)
                comm, exposed, compute = trace_summary(trace, args.steps)
                kinds = ", ".join(f"{k} {v:.2f}" for k, v in sorted(nccl_by_kind(trace, args.steps).items()))
                model8 = "| - | - |"
                if world > 1:
                    comm8, low, high = eight_rank_model(comm, exposed, world)
                    model8 = f"| {comm8:.2f} | {low:.2f}-{high:.2f} |"
                lines.append(f"| {stage} | {step} | {wall:.2f} | {comm:.2f} | {exposed:.2f} | {compute:.2f} | "
                             f"{kinds or '-'} {model8}")
        if rank == 0 and world > 1:
            lines += ["", f"The n-gram table (NGRAM_ROWS={hp.model.ngram_rows}, T3.19) sends its rows and their "
                      "gradients to their owners inside the steps above: all_to_all of equal splits in fixed-size "
                      "slots, the loads inside the step graphs (SendRecv)."]
        if rank == 0:
            text = "\n".join(lines)
            print(text, flush=True)
            with open(os.path.join(args.out, "profile_comm.md"), "w") as f:
                f.write(text + "\n")
        barrier()
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
