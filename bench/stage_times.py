"""Per-stage ms/step of a train_gpt.py log: training-time deltas between stage boundaries
(validation is outside the clock already).

    python bench/stage_times.py logs/<run_id>.txt [...]
"""
import json
import re
import sys


def stage_table(path):
    hp, times = None, {}
    for line in open(path):
        if line.startswith("hyperparameters: "):
            hp = json.loads(line[len("hyperparameters: "):])
        m = re.match(r"step:(\d+)/(\d+) (?:val_loss:\S+ )?(?:train_loss:\S+ )?train_time:(\d+)ms", line)
        if m:
            times[int(m.group(1))] = int(m.group(3))
    n = hp["num_scheduled_iterations"]
    bounds = [round(n * k / 3) for k in range(3)] + [n, n + hp["num_extension_iterations"]]
    rows = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if a in times and b in times and b > a:
            rows.append((i + 1 if i < 3 else "ext", a, b - 1, (times[b] - times[a]) / (b - a)))
    return rows, times[max(times)]


if __name__ == "__main__":
    for path in sys.argv[1:]:
        rows, total = stage_table(path)
        print(path)
        for stage, a, b, ms in rows:
            print(f"  stage {stage} (steps {a}-{b}): {ms:.2f} ms/step")
        print(f"  total train_time {total / 1000:.2f} s")
