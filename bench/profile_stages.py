"""Where the GPU time of a training step goes, per stage: kernel groups of one or more versions of
train_gpt.py side by side (ms of GPU work per step), plus wall ms/step and launches per step.

    python bench/profile_stages.py [SOURCE ...] [--steps 6] [--stages 1,2,3] [--out DIR] [--verbose]
    python bench/profile_stages.py --merge DIR/*.json      # the table of earlier runs (rules re-applied)

SOURCE: a path to a train_gpt.py, or a git revision of this repository (HEAD, main~1, a hash: its
`git show REV:train_gpt.py`), optionally labelled LABEL=SOURCE; default: the working copy. Where the
machine has no .git (the device tool's copy), write revisions to files first:
`git show main:train_gpt.py > .bench/main.py`.

Each source runs in its own subprocess (own module, compile state and GPU memory). It imports the
source, builds its Trainer for one GPU from the environment as main() does (no process group,
nothing logged, no compile warm-up), then for each stage takes the step in the middle of the stage
(Adam on every other of the repeated steps, as in the run) and runs:
--warmup-steps untimed steps (compile); where the source plans CUDA graphs of the step (#47: its
Trainer has step_graphs, on a GPU unless CUDA_GRAPHS=0; WARMUP is set to 1 for the Trainer, since this
warm-up is the child's own), the stage's two graphs (Adam and non-Adam step) are captured and checked
as the run's warm-up does, and the steps after replay them
(`--graphs off`: eager steps; `--graphs both`: each source twice, the eager one labelled
"LABEL eager"); then --steps steps between two synchronizations (wall ms/step, no profiler), the
same steps under torch.profiler. Every kernel, memcpy and memset is summed by name
(durations, so work overlapping on several streams counts in full);
those launched inside optimizer.step() (a record_function range, linked CPU launch -> GPU kernel by
the profiler's correlation ids) form the optimizer group, the others go to the first GROUPS rule
that matches their name. From the same trace, the GPU's idle time between activities (overlapping
ones merged), the part of it before the next activity had been launched (the CPU was behind) and the
part before optimizer work, with the largest gaps (listed under each stage's line); and where the
CPU's time goes (CPU ops by exclusive time, on the forward's and autograd's threads, also under each
stage's line). The profiler adds CPU work to every op, so the host-bound part reads high; the wall
row is measured without it.
The child writes DIR/<label>.json (raw per-kernel totals: grouping happens
here, so --merge applies refined rules to old runs); the parent writes DIR/kernels.csv and
DIR/table.md and prints the markdown table last.

Environment: that of a rank-slice run (README), e.g. RANK_SLICE=1 TRAIN_FILES=... VAL_FILES=...
VAL_TOKENS=3932160. A source needs this repository's interfaces: Hyperparameters.from_env (settings
grouped in parts with hp.flat(), or flat as before the config restructure: device, train_files and
rank_slice are read either way),
Trainer(hp, rank, world_size, device, log) with its schedule, optimizer and train_step, RunLog,
TrainLoader; both the current one (Schedule.plan(step) -> StepPlan, train_step(plan, loader)) and
the one before the restructure (train_step(step, loader), the optimizer's step_count) are driven;
other repositories' scripts need a port.
"""
import argparse
import csv
import dataclasses
import gzip
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIMIZER = "optimizer (NorMuon + Adam)"
OTHER = "other"
OPTIMIZER_RANGE = "profile_stages:optimizer.step"  # record_function label around optimizer.step()

# Inductor kernels are named triton_<poi|red|per|for|tem>_fused_<sorted aten ops>_<n> (the ops as
# before decomposition, e.g. _fused_rms_norm, _to_copy); library kernels by their C++ names.
# A fused kernel carrying only layout/cast/fill ops is a copy.
_LAYOUT_OPS = ("_to_copy", "_unsafe_view", "alias", "as_strided", "cat", "clone", "constant_pad_nd", "copy_?",
               "empty", "expand", "fill_?", "full", "lift_fresh", "new_empty", "new_zeros", "permute", "repeat",
               "repeat_interleave", "select", "select_backward", "slice", "slice_backward", "split",
               "split_with_sizes", "squeeze", "stack", "t", "transpose", "unbind", "unsqueeze", "view", "zeros",
               "zeros_like")
# (group, rule on the kernel name): first match wins, case-insensitive. Kernels launched inside
# optimizer.step() go to OPTIMIZER when no earlier rule (NCCL) takes them.
GROUPS = [
    ("NCCL communication", r"nccl"),
    (OPTIMIZER, r"_aat_kernel|_ata_kernel|(?:^|_)lerp(?:_|$)"),
    # FA2 (pytorch_flash::flash_*), FA3 (flash::FlashAttn*, cutlass-named), cuDNN (*sdpa*), mem-efficient
    # (fmha_cutlass*), math SDPA softmax, flex templates (triton_tem_fused_* except matmul templates)
    ("attention (flash fwd+bwd)", r"flash|fmha|attention|sdpa|varlen_attn|(?:^|_)_?(?:safe_)?softmax(?:_|$)"
                                  r"|^triton_tem_(?!.*_(?:mm|addmm|bmm|baddbmm|_scaled_mm)(?:_|$))"),
    ("MLP Triton GEMM (+ReLU²)", r"mlp|relu_?sq|squared_relu|relu2"),
    ("cuBLAS/cutlass GEMM", r"gemm|gemv|nvjet|cutlass|xmma|cublas|splitkreduce|^triton_tem_"),
    # lse of the soft-capped logits, the target gather, and their backward (exp, scatter), also
    # where inductor fuses the e5m2 gradient quantization into it
    ("softcapped CE fwd+bwd", r"softcap|cross_?entropy|(?:^|_)(?:ce|logsumexp|exp|gather|scatter|_?log_softmax"
                              r"|nll_loss)(?:_|$)"),
    ("ReLU² elementwise", r"(?:^|_)(?:relu|threshold_backward|square)(?:_|$)"),
    ("RMSNorm/residual fusions", r"rms_?norm|(?:^|_)(?:rsqrt|mean|pow)(?:_|$)"),
    ("FP8 quantize/transpose", r"(?:^|_)(?:_scaled_mm(?:_|$)|clamp(?:_(?!max|min)|$))"),
    ("embeddings (index, index_put)", r"(?:^|_)(?:index|index_select|index_put|index_add|embedding\w*)(?:_|$)"
                                      r"|indexselect|indexing_backward|index_elementwise"),
    ("gates (sigmoid)", r"(?:^|_)sigmoid(?:_|$)"),  # attention output, value-embedding, smear and skip gates
    ("copies/memset", r"^mem(?:cpy|set)|direct_copy|catarraybatchedcopy|copy_kernel|fillfunctor"
                      r"|^triton_[a-z]{3}_fused(?:_(?:" + "|".join(_LAYOUT_OPS) + r"))+_\d+$"),
]
_RULES = [(group, re.compile(rule, re.IGNORECASE)) for group, rule in GROUPS]
GROUP_ORDER = [group for group, _ in GROUPS] + [OTHER]


def classify(kernel: str, in_optimizer: bool = False) -> str:
    for group, rule in _RULES:
        if group == OPTIMIZER and in_optimizer:
            return group
        if rule.search(kernel):
            return group
    return OTHER


# --- sources -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class Source:
    label: str
    path: str  # a train_gpt.py to import
    description: str  # the path, or the revision and its commit


def resolve_sources(specs: list[str], repo_dir: str, tmp_dir: str) -> list[Source]:
    """Each spec: [LABEL=]PATH or [LABEL=]REV (a git revision of repo_dir, written to tmp_dir).
    Repeated labels get #2, #3 (timing the same version twice is how a difference is judged)."""
    sources, seen = [], {}
    for spec in specs:
        label, target = None, spec
        head, sep, rest = spec.partition("=")
        if sep and head and rest and "/" not in head and not os.path.exists(spec):
            label, target = head, rest
        if os.path.isfile(target):
            path = os.path.abspath(target)
            if path == os.path.join(os.path.abspath(repo_dir), "train_gpt.py"):
                default = "working"
            elif os.path.basename(path) == "train_gpt.py":
                default = os.path.basename(os.path.dirname(path))
            else:
                default = os.path.splitext(os.path.basename(path))[0]
            description = target
        else:
            commit = _git(repo_dir, "rev-parse", "--verify", "--quiet", f"{target}^{{commit}}")
            if commit is None:
                raise SystemExit(f"error: {target!r} is neither a file nor a git revision of {repo_dir}")
            text = _git(repo_dir, "show", f"{commit}:train_gpt.py", strip=False)
            if text is None:
                raise SystemExit(f"error: revision {target} ({commit[:10]}) has no train_gpt.py")
            default, description = target, f"git {target} ({commit[:10]})"
            path = os.path.join(tmp_dir, f"rev_{commit[:12]}_{len(sources)}.py")
            with open(path, "w") as f:
                f.write(text)
        label = label or default
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            label = f"{label}#{seen[label]}"
        sources.append(Source(label, path, description))
    return sources


def _git(repo_dir: str, *args: str, strip: bool = True) -> str | None:
    proc = subprocess.run(["git", "-C", repo_dir, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    return proc.stdout.strip() if strip else proc.stdout


# --- the profile of one source (child process) ------------------------------------------------------
def stage_step(schedule, stage: int) -> int:
    """The middle step of stage 1..3, avoiding the untie step (whose train_step unties)."""
    start, end = schedule.stage_starts[stage - 1], schedule.stage_starts[stage]
    step = (start + end) // 2
    if step == schedule.untie_step:
        step = step + 1 if step + 1 < end else step - 1
    return step


GPU_EVENT_KINDS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}


def _launches(events: list[dict]) -> tuple[dict, int]:
    """{correlation id: (CPU launch time µs, launched inside optimizer.step())} of every runtime or
    driver call that launched GPU work, and the number of optimizer ranges."""
    ranges: dict[tuple, list] = {}
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("name") == OPTIMIZER_RANGE:
            ranges.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    launches = {}
    for e in events:
        correlation = e.get("args", {}).get("correlation")
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and correlation is not None:
            inside = any(start <= e["ts"] <= end for start, end in ranges.get((e.get("pid"), e.get("tid")), ()))
            launches[correlation] = (e["ts"], inside)
    return launches, sum(len(r) for r in ranges.values())


def kernel_totals(events: list[dict]) -> tuple[dict, int, int]:
    """From Chrome-trace events: {(name, kind, launched inside optimizer.step): [µs, count]} over the
    kernels, memcpys and memsets; the number of optimizer ranges; the GPU events whose correlation id
    matches no CPU launch (those cannot be attributed to the optimizer)."""
    launches, ranges = _launches(events)
    totals: dict[tuple, list] = {}
    unlinked = 0
    for e in events:
        kind = GPU_EVENT_KINDS.get(e.get("cat"))
        if kind is None:
            continue
        correlation = e.get("args", {}).get("correlation")
        unlinked += correlation not in launches
        entry = totals.setdefault((e["name"], kind, correlation in launches and launches[correlation][1]), [0.0, 0])
        entry[0] += e["dur"]
        entry[1] += 1
    return totals, ranges, unlinked


def gpu_idle(events: list[dict], top: int = 5) -> dict:
    """Where the GPU waited between its first and last activity (kernels, memcpys, memsets; activities
    that overlap, e.g. on two streams, count as one busy stretch), in µs: `idle`, all gaps; `host`, the
    part of each gap before the next activity had even been launched (the CPU was behind);
    `optimizer`, the gaps before activities launched inside optimizer.step(); `gaps`, their number;
    `largest`, the top gaps as [µs, activity before, activity after]."""
    launches, _ = _launches(events)
    activities = sorted((e["ts"], e["ts"] + e["dur"], e["name"], e.get("args", {}).get("correlation"))
                        for e in events if e.get("cat") in GPU_EVENT_KINDS)
    idle = host = optimizer = 0.0
    gaps, largest = 0, []
    busy_end, before = None, None
    for start, end, name, correlation in activities:
        if busy_end is not None and start > busy_end:
            gap = start - busy_end
            launched_at, inside = launches.get(correlation, (None, False))
            idle += gap
            gaps += 1
            if launched_at is not None:
                host += min(max(launched_at - busy_end, 0.0), gap)
            if inside:
                optimizer += gap
            largest.append([gap, before, name])
        if busy_end is None or end > busy_end:
            busy_end, before = end, name
    largest = sorted(largest, key=lambda g: -g[0])[:top]
    return dict(idle=idle, host=host, optimizer=optimizer, gaps=gaps, largest=largest)


CPU_EVENT_KINDS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
# Names folded into one entry of the host-time list: inductor's own kernel launches, the Python
# wrapper of a compiled graph (its name carries the graph's hash), the CUDA API's launch calls.
HOST_FOLDS = [("inductor Triton launches", re.compile(r"^triton_(?:poi|red|per|tem)_")),
              ("compiled graph wrapper code", re.compile(r"^## Call CompiledFxGraph")),
              ("CUDA launch API", re.compile(r"^(?:cuLaunchKernel|cudaLaunchKernel|cudaGraphLaunch)"))]


def _host_name(name: str) -> str:
    """A CPU op's name, or the HOST_FOLDS entry that folds it."""
    return next((folded for folded, rule in HOST_FOLDS if rule.search(name)), name)


def host_time(events: list[dict], top: int = 12) -> dict:
    """Where the CPU time of the profiled steps goes, in µs: `busy`, the CPU ops' time on every
    thread outside any other op (the forward's thread and autograd's backward thread); `self`, the
    top `top` names by exclusive time (an op's time less its nested ops'), names folded by
    HOST_FOLDS, as [name, µs, calls]. The profiler adds its own cost to every op, so the sum reads
    higher than the unprofiled host time; the ranking is what it shows."""
    by_thread: dict[tuple, list] = {}
    for e in events:
        if e.get("cat") in CPU_EVENT_KINDS and e.get("ph", "X") == "X" and "dur" in e:
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    busy = 0.0
    exclusive: dict[str, list] = {}

    def close(entry):  # [event, time of its nested ops]
        total = exclusive.setdefault(_host_name(entry[0]["name"]), [0.0, 0])
        total[0] += entry[0]["dur"] - entry[1]
        total[1] += 1

    for ops in by_thread.values():
        ops.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []
        for e in ops:
            while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= e["ts"]:
                close(stack.pop())
            if stack:
                stack[-1][1] += e["dur"]
            else:
                busy += e["dur"]
            stack.append([e, 0.0])
        while stack:
            close(stack.pop())
    ranked = sorted(([name, us, calls] for name, (us, calls) in exclusive.items()), key=lambda r: -r[1])
    return dict(busy=busy, self=ranked[:top])


def load_source(path: str):
    spec = importlib.util.spec_from_file_location("profiled_train_gpt", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def setting(hp, name: str):
    """A setting by its flat name (that of its environment variable, in lower case): sources since the
    config restructure group them in parts (hp.run.device; hp.flat() lists them all by flat name),
    earlier ones keep them flat (hp.device)."""
    return hp.flat()[name] if hasattr(hp, "flat") else getattr(hp, name)


def run_child(args):
    module = load_source(args.child)  # first: it sets PYTORCH_ALLOC_CONF before CUDA starts
    import torch

    hp = module.Hyperparameters.from_env()
    module.check_hyperparameters(hp)
    if "warmup" in (hp.flat() if hasattr(hp, "flat") else vars(hp)):  # the steps below are the warm-up, and a
        # source since step_runner() plans its step graphs only with WARMUP=1 (the warm-up captures them)
        hp = hp.replace(warmup=True) if hasattr(hp, "flat") else dataclasses.replace(hp, warmup=True)
    device_name = setting(hp, "device")
    if device_name == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("error: no CUDA GPU visible (DEVICE=cpu COMPILE=0 profiles the CPU path, without kernels)")
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    else:
        device = torch.device(device_name)
    cuda = device.type == "cuda"
    for name in ("recompile_limit", "cache_size_limit"):  # as main(): one graph per stage shape
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    trainer = module.Trainer(hp, 0, 1, device, module.RunLog(None))
    loader = module.TrainLoader(setting(hp, "train_files"), 0, 1, device, log=lambda _: None, grad_accum=trainer.grad_accum)
    optimizer, schedule = trainer.optimizer, trainer.schedule
    graphs = None if args.no_graphs else getattr(trainer, "step_graphs", None)
    if graphs is None and hasattr(trainer, "eager_forward_backward"):  # a Trainer that decided on graphs in
        trainer.forward_backward = trainer.eager_forward_backward  # __init__ (step_runner) steps eagerly here
    if hasattr(schedule, "plan"):
        tokens_per_rank = lambda step: schedule.plan(step).tokens_per_rank  # noqa: E731
        max_seq_len = lambda step: schedule.plan(step).shape.max_seq_len  # noqa: E731
    else:
        tokens_per_rank, max_seq_len = schedule.tokens_per_rank, lambda step: schedule.forward_shape(step).max_seq_len
    optimizer_step = optimizer.step

    def annotated_step(*args, **kwargs):
        with torch.profiler.record_function(OPTIMIZER_RANGE):
            optimizer_step(*args, **kwargs)

    optimizer.step = annotated_step

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def run(step, n):
        """n train steps at `step`, Adam on the i-th when step + i is odd, so every window has the
        same Adam / non-Adam sequence. Returns the number of Adam steps."""
        adam_steps = 0
        for i in range(n):
            if hasattr(schedule, "plan"):
                plan = schedule.plan(step)
                plan = dataclasses.replace(plan, adam_step=schedule.plan(step + i).adam_step)
                adam_steps += plan.adam_step
                trainer.train_step(plan, loader)
            else:  # before the restructure: the optimizer counts its steps
                optimizer.step_count = step + i
                adam_steps += optimizer.is_adam_step()
                trainer.train_step(step, loader)
        return adam_steps

    def capture(step):
        """The graphs of step's stage, Adam and non-Adam, as the warm-up captures them; the
        following steps replay them."""
        for adam_step in (False, True):
            plan = dataclasses.replace(schedule.plan(step), adam_step=adam_step)
            trainer.set_long_windows(plan.long_windows)
            cap = {"attention_cap": plan.attention_cap} if hasattr(plan, "attention_cap") else {}  # T5.5's, where it exists
            batches = [loader.next_batch(plan.tokens_per_rank, plan.shape.max_seq_len, **cap)
                       for _ in range(trainer.grad_accum)]
            graphs.capture(plan, trainer.stage_execution[plan.stage], batches[0], trainer.target_weights[plan.step])
        trainer.forward_backward = graphs.run

    result = dict(label=args.label, source=args.describe or args.child, steps=args.steps,
                  device=torch.cuda.get_device_name(device) if cuda else str(device),
                  torch=torch.__version__, rank_slice=setting(hp, "rank_slice"), cuda_graphs=graphs is not None,
                  stages=[])
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with tempfile.TemporaryDirectory() as tmp:
        for stage in args.stages:
            step = stage_step(schedule, stage)
            if schedule.untie_step is not None and step > schedule.untie_step and optimizer.tied:
                optimizer.untie()  # the run unties at untie_step: later steps update embed and lm_head apart
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            if graphs is not None:
                trainer.forward_backward = trainer.eager_forward_backward  # until this stage's graphs exist
            run(step, args.warmup_steps)
            if graphs is not None:
                capture(step)
            sync()
            print(f"[{args.label}] stage {stage}: step {step}, warm-up ({args.warmup_steps} steps) "
                  f"{time.perf_counter() - start:.0f}s", flush=True)
            start = time.perf_counter()
            adam_steps = run(step, args.steps)
            sync()
            wall_ms = 1000 * (time.perf_counter() - start) / args.steps
            with torch.profiler.profile(activities=activities) as prof:
                run(step, args.steps)
                sync()
            trace = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(trace)
            with open(trace) as f:
                events = json.load(f)["traceEvents"]
            totals, ranges, unlinked = kernel_totals(events)
            idle = gpu_idle(events)
            host = host_time(events)
            if args.trace_dir:
                kept = os.path.join(args.trace_dir, f"{_slug(args.label)}_st{stage}.json.gz")
                with open(trace, "rb") as fin, gzip.open(kept, "wb") as fout:
                    shutil.copyfileobj(fin, fout)
            loss = trainer.losses[step].item()
            result["stages"].append(dict(
                stage=stage, step=step, tokens_per_step=tokens_per_rank(step) * trainer.grad_accum,
                max_seq_len=max_seq_len(step), adam_steps=adam_steps, wall_ms=wall_ms,
                loss=loss if math.isfinite(loss) else str(loss), optimizer_ranges=ranges, unlinked_gpu_events=unlinked,
                peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                idle=dict(ms=idle["idle"] / 1000 / args.steps, host_ms=idle["host"] / 1000 / args.steps,
                          optimizer_ms=idle["optimizer"] / 1000 / args.steps, gaps=idle["gaps"] / args.steps,
                          largest=idle["largest"]) if cuda else None,
                host=dict(busy_ms=host["busy"] / 1000 / args.steps,
                          top=[[name, us / 1000 / args.steps, calls / args.steps] for name, us, calls in host["self"]]),
                kernels=[dict(name=name, kind=kind, optimizer=opt, ms=us / 1000 / args.steps, calls=count / args.steps)
                         for (name, kind, opt), (us, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])]))
            print(f"[{args.label}] stage {stage}: wall {wall_ms:.2f} ms/step, loss {loss:.4f}", flush=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


# --- report (parent) ----------------------------------------------------------------------------------
def group_totals(stage: dict) -> dict[str, list]:
    """{group: [ms/step, calls/step]} of one profiled stage."""
    groups: dict[str, list] = {}
    for k in stage["kernels"]:
        entry = groups.setdefault(classify(k["name"], k["optimizer"]), [0.0, 0.0])
        entry[0] += k["ms"]
        entry[1] += k["calls"]
    return groups


def format_table(results: list[dict]) -> str:
    """Markdown table, columns `<label> st<k>` stage by stage (sources side by side)."""
    stages = sorted({s["stage"] for r in results for s in r["stages"]})
    columns = [(r["label"], s) for stage in stages for r in results for s in r["stages"] if s["stage"] == stage]
    groups = [group_totals(s) for _, s in columns]
    rows = []
    for group in GROUP_ORDER:
        if any(group in g for g in groups):
            rows.append([group] + [f"{g[group][0]:.1f}" if group in g else "—" for g in groups])
    kernels = [s["kernels"] for _, s in columns]
    rows.append(["all kernels"] + [f"{sum(k['ms'] for k in ks):.1f}" if ks else "—" for ks in kernels])
    rows.append(["wall"] + [f"{s['wall_ms']:.1f}" for _, s in columns])
    rows.append(["launches/step"] + [f"{sum(k['calls'] for k in ks if k['kind'] == 'kernel'):.0f}" for ks in kernels])
    idle = [s.get("idle") for _, s in columns]  # profiles made before the idle analysis have none
    if any(idle):
        for label, key, fmt in (("GPU idle between activities", "ms", "{:.1f}"), ("of it, next one not yet launched",
                                "host_ms", "{:.1f}"), ("of it, before optimizer work", "optimizer_ms", "{:.1f}"),
                                ("gaps/step", "gaps", "{:.0f}")):
            rows.append([label] + [fmt.format(i[key]) if i else "—" for i in idle])
    header = ["kernel group (ms/step)"] + [f"{label} st{s['stage']}" for label, s in columns]
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * len(columns) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def describe(results: list[dict]) -> str:
    lines = []
    for r in results:
        lines.append(f"{r['label']}: {r['source']} on {r['device']}, torch {r['torch']}, "
                     f"{'rank-slice' if r['rank_slice'] else 'full batch'}, {r['steps']} steps per stage")
        for s in r["stages"]:
            notes = []
            if s["optimizer_ranges"] != r["steps"]:
                notes.append(f"{s['optimizer_ranges']} optimizer ranges in the trace, expected {r['steps']}")
            if s["unlinked_gpu_events"]:
                notes.append(f"{s['unlinked_gpu_events']} GPU events without a CPU launch (not attributable to the optimizer)")
            loss = s["loss"]
            if isinstance(loss, str):
                notes.append(f"non-finite loss {loss}")
            else:
                loss = f"{loss:.3f}"
            lines.append(f"  st{s['stage']}: step {s['step']}, {s['tokens_per_step']} tokens/step, seq {s['max_seq_len']}, "
                         f"{s['adam_steps']}/{r['steps']} Adam steps, loss {loss}, peak {s['peak_memory_gib']:.1f} GiB"
                         + "".join(f"; warning: {n}" for n in notes))
            for gap, before, after in (s.get("idle") or {}).get("largest", []):
                lines.append(f"    idle {gap:8.1f} µs after {str(before)[:70]} before {str(after)[:70]}")
            host = s.get("host")  # profiles made before the host analysis have none
            if host:
                lines.append(f"    host (profiled): {host['busy_ms']:.1f} ms/step in CPU ops; by exclusive time:")
                for name, ms, calls in host["top"]:
                    lines.append(f"      {ms:7.2f} ms/step {calls:6.1f} calls  {name[:90]}")
    return "\n".join(lines)


def unclassified(results: list[dict], top: int = 15) -> str:
    lines = []
    for r in results:
        totals: dict[str, list] = {}
        for s in r["stages"]:
            for k in s["kernels"]:
                if classify(k["name"], k["optimizer"]) == OTHER:
                    entry = totals.setdefault(k["name"], [0.0, 0.0])
                    entry[0] += k["ms"]
                    entry[1] += k["calls"]
        lines.append(f"{r['label']}: top unclassified kernels (ms/step and calls/step, summed over stages)")
        for name, (ms, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"  {ms:8.3f} {calls:6.1f}  {name[:200]}")
    return "\n".join(lines)


def write_outputs(results: list[dict], out: str, table: str):
    with open(os.path.join(out, "kernels.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["label", "stage", "group", "kernel", "kind", "in_optimizer", "ms_per_step", "calls_per_step"])
        for r in results:
            for s in r["stages"]:
                for k in s["kernels"]:
                    writer.writerow([r["label"], s["stage"], classify(k["name"], k["optimizer"]), k["name"], k["kind"],
                                     int(k["optimizer"]), f"{k['ms']:.6f}", f"{k['calls']:g}"])
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table + "\n")


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sources", nargs="*", help="[LABEL=]PATH or [LABEL=]GIT_REVISION (default: the working copy)")
    p.add_argument("--steps", type=int, default=6, help="timed and profiled steps per stage (even: as many Adam as non-Adam steps)")
    p.add_argument("--warmup-steps", type=int, default=4, help="untimed steps per stage before timing (compile)")
    p.add_argument("--stages", default="1,2,3", help="stages to profile, of 1,2,3")
    p.add_argument("--out", help="output folder (default logs/profile_stages/<time>)")
    p.add_argument("--verbose", action="store_true", help="also list the top unclassified kernels")
    p.add_argument("--traces", action="store_true", help="keep the profiler traces (gzipped Chrome JSON) under --out")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="print the table of earlier per-source JSON files")
    p.add_argument("--graphs", choices=("planned", "off", "both"), default="planned",
                   help="CUDA graphs of the step where the source plans them (default), never, or both ways")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--label", help=argparse.SUPPRESS)
    p.add_argument("--describe", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--trace-dir", help=argparse.SUPPRESS)
    p.add_argument("--no-graphs", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.stages = sorted({int(s) for s in args.stages.split(",")})
    if not set(args.stages) <= {1, 2, 3} or args.steps < 1 or args.warmup_steps < 0:
        p.error("--stages takes numbers of 1,2,3; --steps >= 1; --warmup-steps >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    if args.merge:
        results = []
        for path in args.merge:
            with open(path) as f:
                results.append(json.load(f))
        if args.verbose:
            print(unclassified(results))
        print(describe(results))
        print(format_table(results))
        return
    out = args.out or os.path.join("logs", "profile_stages", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    results, failures = [], []
    with tempfile.TemporaryDirectory() as tmp:
        sources = resolve_sources(args.sources or [os.path.join(REPO_ROOT, "train_gpt.py")], REPO_ROOT, tmp)
        modes = {"planned": [False], "off": [True], "both": [False, True]}[args.graphs]  # --no-graphs per run
        for source, no_graphs in [(source, no_graphs) for source in sources for no_graphs in modes]:
            label = source.label + (" eager" if no_graphs and args.graphs == "both" else "")
            json_path = os.path.join(out, f"{_slug(label)}.json")
            command = [sys.executable, os.path.abspath(__file__), "--child", source.path, "--label", label,
                       "--describe", source.description, "--json", json_path, "--steps", str(args.steps),
                       "--warmup-steps", str(args.warmup_steps), "--stages", ",".join(map(str, args.stages))]
            if args.traces:
                command += ["--trace-dir", out]
            if no_graphs:
                command += ["--no-graphs"]
            print(f"profiling {label} ({source.description})", flush=True)
            code = subprocess.run(command).returncode
            if code != 0:
                failures.append(f"error: profiling {label} ({source.description}) failed with exit code {code}")
                continue
            with open(json_path) as f:
                results.append(json.load(f))
    for failure in failures:
        print(failure)
    if not results:
        raise SystemExit(1)
    table = format_table(results)
    write_outputs(results, out, table)
    if args.verbose:
        print(unclassified(results))
    print(f"per-kernel totals: {out}/kernels.csv, {out}/<label>.json")
    print(describe(results))
    print(table)
    if failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
