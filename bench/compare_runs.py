"""Per-step equivalence of runs that should compute the same training: 1 GPU (accumulation 8)
against 2 or 4 GPUs, or a change that must not alter the math. Reads train_gpt.py logs, complete
or stopped early (STOP_AFTER), run with TRAIN_LOSS_EVERY=1, and prints for each log against the
first: the largest train- and val-loss differences over the steps both logged, and ms/step.

    python bench/compare_runs.py logs/one_gpu.txt logs/two_gpus.txt logs/four_gpus.txt [--tolerance 5e-3]

Exit code 1 when a difference exceeds the tolerance (reduction-order noise of bf16 gradient sums
stays at a few 1e-3 per step; a wrong data slice or a missed reduction moves losses by ~1e-1).
"""
import argparse
import re
import sys
from dataclasses import dataclass, field

STEP_RE = re.compile(r"^step:(\d+)/(\d+) (?:val_loss:(\S+) )?(?:train_loss:(\S+) )?train_time:(\d+)ms "
                     r"step_avg:(\S+)ms$")
DESC_RE = re.compile(r"^(mode|world_size|grad_accum_steps|hardware): (.*)$")


@dataclass
class Losses:
    path: str
    description: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)  # step -> train loss (rank mean) after that step
    val: dict = field(default_factory=dict)  # step -> val loss
    last_step: int = 0
    step_avg_ms: float = float("nan")  # training time per step at the last step line

    @property
    def setup(self) -> str:
        d = self.description
        return f"{d.get('mode', '?')}, world {d.get('world_size', '?')}, accumulation {d.get('grad_accum_steps', '?')}"


def read_losses(path: str) -> Losses:
    run = Losses(path)
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if m := DESC_RE.match(line):
                run.description.setdefault(m.group(1), m.group(2))
            elif m := STEP_RE.match(line):
                step = int(m.group(1))
                if m.group(3) is not None:
                    run.val[step] = float(m.group(3))
                if m.group(4) is not None:
                    run.train[step] = float(m.group(4))
                run.last_step, run.step_avg_ms = step, float(m.group(6))
    if not run.train:
        raise SystemExit(f"error: {path}: no train_loss in its step lines; rerun with TRAIN_LOSS_EVERY=1")
    return run


def largest_difference(a: dict, b: dict) -> tuple[float, int | None, int]:
    """(max |a - b|, the step where it occurs, number of steps compared) over the common steps."""
    common = sorted(set(a) & set(b))
    if not common:
        return float("nan"), None, 0
    step = max(common, key=lambda s: abs(a[s] - b[s]))
    return abs(a[step] - b[step]), step, len(common)


def compare(runs: list[Losses], tolerance: float) -> tuple[list[str], bool]:
    base = runs[0]
    lines = ["| log | setup | steps | ms/step | max abs train-loss diff (step) | max abs val-loss diff (step) |",
             "|---|---|---:|---:|---:|---:|",
             f"| {base.path} (base) | {base.setup} | {base.last_step} | {base.step_avg_ms:.2f} | | |"]
    ok = True
    for run in runs[1:]:
        cells = []
        for mine, theirs in ((run.train, base.train), (run.val, base.val)):
            diff, step, count = largest_difference(mine, theirs)
            if count == 0:
                cells.append("no common steps")
                ok = False
                continue
            ok &= diff <= tolerance
            cells.append(f"{diff:.2e} ({step}, {count} steps)")
        lines.append(f"| {run.path} | {run.setup} | {run.last_step} | {run.step_avg_ms:.2f} | {cells[0]} | {cells[1]} |")
    return lines, ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", help="train_gpt.py logs; the first is the base")
    p.add_argument("--tolerance", type=float, default=5e-3, help="largest accepted loss difference (default 5e-3)")
    args = p.parse_args(argv)
    if len(args.logs) < 2:
        p.error("give at least two logs")
    lines, ok = compare([read_losses(path) for path in args.logs], args.tolerance)
    print("\n".join(lines))
    print(f"all differences within {args.tolerance:g}" if ok else f"a difference exceeds {args.tolerance:g}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
