"""Issue #25's A/B of AVERAGE_LAST_STEPS, several windows from one training trajectory.

Averaging leaves training unchanged (the mean is only copied into the model before the final
validation), so one run per seed can score every window: after the last step this driver validates
the raw weights, then the mean of the last w steps for each window w, each on the full final
validation. The run ends on the largest window's mean, which the run's own final validation (and its
`final weights:` line) then reports. Each seed is thus a paired comparison: same trajectory, same data.

    AVERAGE_LAST_STEPS=200 AVERAGE_WINDOWS=25,50,100 SEEDS=1,2,3 python average_windows.py

from the root of a checkout of commit 29207d8 (the last train_gpt.py with AVERAGE_LAST_STEPS and
WeightAverage); every other setting as train_gpt.py reads it.
Log lines: `average window:<w> val_loss:<x>` (w = 0: the raw weights).
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
import train_gpt as T  # noqa: E402


class WindowAverages:
    """The means of the weights after each of the last w steps, for several w at once (fp32)."""

    def __init__(self, params, windows, largest, trainer):
        self.params, self.trainer = params, trainer
        self.windows = sorted({*windows, largest})
        self.largest = largest
        self.reset()

    def reset(self):
        self.means, self.counts, self.added = {}, {}, 0

    @torch.no_grad()
    def add(self):
        self.added += 1  # the add of step last_step - largest + added - 1
        for w in self.windows:
            if self.added > self.largest - w:  # inside window w's last w steps
                if w not in self.means:
                    self.means[w] = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
                    self.counts[w] = 0
                self.counts[w] += 1
                for mean, p in zip(self.means[w], self.params):
                    mean.lerp_(p.float(), 1 / self.counts[w])

    @torch.no_grad()
    def apply(self):
        trainer = self.trainer
        final = trainer.last_step == trainer.schedule.total_steps
        trainer.log(f"average window:0 val_loss:{trainer.evaluate(trainer.last_step, final=final):.4f}")
        for w in self.windows:
            assert self.counts[w] == w, (w, self.counts[w])
            for mean, p in zip(self.means[w], self.params):
                p.copy_(mean)
            if w != self.largest:  # the run's own final validation scores the largest
                trainer.log(f"average window:{w} val_loss:{trainer.evaluate(trainer.last_step, final=final):.4f}")
        self.reset()


def main():
    hp = T.Hyperparameters.from_env()
    T.check_hyperparameters(hp)
    if hp.average_last_steps <= 0:
        raise SystemExit("set AVERAGE_LAST_STEPS to the largest window")
    windows = [int(w) for w in os.environ.get("AVERAGE_WINDOWS", "").split(",") if w]
    rank, world_size, device = T.init_process(hp)
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    runs = T.planned_runs(hp, world_size)
    log = T.open_run_log(runs[0], rank, world_size, device)
    trainer = T.Trainer(runs[0], rank, world_size, device, log)
    trainer.weight_average = WindowAverages(list(trainer.model.parameters()), windows, hp.average_last_steps, trainer)
    log(f"average windows: {trainer.weight_average.windows}")
    if hp.warmup:
        trainer.warmup()
    trainer.run()
    for run in runs[1:]:
        log = T.open_run_log(run, rank, world_size, device)
        trainer.start_over(run, log)
        trainer.run()


if __name__ == "__main__":
    main()
