"""The optimizer step alone on the real parameter shapes, across ranks:
median time of NorMuon-only and Adam steps, and a profiler trace of a few steps from which it
reports communication time and how much of it is exposed (no compute kernel running).

    torchrun --standalone --nproc_per_node=2 bench/bench_optimizer.py [out_dir]

Hyperparameters (shapes, optimizer settings) come from the environment like train_gpt.py's.
"""
import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt as T  # noqa: E402


def union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def overlap(a, b):
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += min(end, b[k][1]) - max(start, b[k][0])
            k += 1
    return total


def trace_summary(path, steps):
    """Per step: communication kernel time, and the part of it with no compute kernel running."""
    events = json.load(open(path))["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    comm = union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()])
    compute = union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()])
    comm_us = sum(end - start for start, end in comm)
    exposed_us = comm_us - overlap(comm, compute)
    compute_us = sum(end - start for start, end in compute)
    return comm_us / steps / 1000, exposed_us / steps / 1000, compute_us / steps / 1000


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", default=".", help="where rank 0 writes its profiler trace")
    out_dir = parser.parse_args().out_dir
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    hp = T.Hyperparameters.from_env()
    cuda = hp.run.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    T.allow_graph_per_shape()  # as main(): one graph per table shape
    torch.manual_seed(0)
    model = T.GPT(hp.model, T.longest_forward(hp)).to(device)
    params = dict(model.named_parameters())
    opt = T.NorMuonAdam(params, T.param_specs(model), hp.optim, rank, world, tied=("embed", "lm_head"),
                        compile=hp.execution.compile)
    steps_taken = [0]
    grads = {k: torch.randn_like(p) * 1e-3 for k, p in params.items()}

    def step():
        adam = steps_taken[0] % 2 == 1  # Adam on odd steps, as the schedule runs it
        steps_taken[0] += 1
        for k, p in params.items():
            if p.grad is None:
                p.grad = grads[k].clone()
        sync()
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        end = torch.cuda.Event(enable_timing=True) if cuda else None
        if cuda:
            start.record()
        opt.step(adam=adam)
        if cuda:
            end.record()
        sync()
        return adam, start.elapsed_time(end) if cuda else 0.0

    def sync():
        if cuda:
            torch.cuda.synchronize()
        if world > 1:
            dist.barrier()

    for _ in range(6):  # compile both step kinds
        step()
    times = {False: [], True: []}
    for _ in range(20):
        adam, ms = step()
        times[adam].append(ms)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    trace = os.path.join(out_dir, f"optimizer_trace_rank{rank}.json")
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(4):
            step()
    if rank == 0:
        prof.export_chrome_trace(trace)
        comm, exposed, compute = trace_summary(trace, 4)
        print(f"device: {torch.cuda.get_device_name(device) if cuda else 'cpu'} x{world}, torch {torch.__version__}")
        print(f"optimizer step, median of {len(times[False])}: NorMuon-only {statistics.median(times[False]):.2f} ms, "
              f"with Adam {statistics.median(times[True]):.2f} ms")
        print(f"profile (4 steps, rank 0): communication {comm:.2f} ms/step, exposed {exposed:.2f} ms/step, "
              f"compute kernels {compute:.2f} ms/step; trace {trace}")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
