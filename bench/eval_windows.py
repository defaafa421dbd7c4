"""Final-validation attention windows, tried on the models a run trains: train exactly as train_gpt.py
does (same environment, SEEDS included, one compile), then evaluate each run's final model under
several window settings besides the run's own final validation.

    python bench/eval_windows.py [--windows 6:32,6:20,6:48,6:32y,8:32,6:32x1.05] [--out FILE.json]
    torchrun --standalone --nproc_per_node=N bench/eval_windows.py ...      # several GPUs

A setting is SHORT:LONG in blocks of WINDOW_BLOCK_SIZE tokens (SHORT for the short-window layers,
LONG for the long-window ones); a trailing `y` also moves the rotary tables and softmax scale by one
YaRN update from the last stage's long window to LONG (train_gpt.py's final validation does not:
FINAL_LONG_WINDOW keeps the extension's tables, #48); a trailing `xF` multiplies the softmax scale
by F (YaRN's temperature without its rotary change: the final validation attends further than any
training step, over documents that training truncated); a trailing `cW` (with COPY_POINTER=1) gives the copy
pointer a window of W tokens at validation (T4.8; PR #379 validates with 8192, trains with 2048). The schedule's own
final setting is
`<last stage short>:<FINAL_LONG_WINDOW>` (6:32 by default): listing it checks that the sweep
reproduces the run's number.

Each run's log gets one line per setting after its training lines,
`final_windows short:6 long:20 yarn:0 val_loss:3.6331` (`... yarn:0 scale:1.05 val_loss:...` with a
factor), and --out (rank 0) collects them per run
as JSON. Quality only. The settings compile after the warm-up, after which train_gpt.py has dynamo check only
the guards that tell its graphs apart (T5.2), so that a new window setting would run a graph of another: the
sweep checks every guard (torch.compiler.set_stance), the training steps run as train_gpt.py runs them.
"""
import argparse
import dataclasses
import json
import os
import re
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt  # noqa: E402


@dataclasses.dataclass(frozen=True)
class WindowSetting:
    short_blocks: int
    long_blocks: int
    yarn_update: bool
    scale_factor: float = 1.0  # on the softmax scale the rotary tables come with
    copy_window: int = 0  # the copy pointer's window at validation; 0: FINAL_COPY_WINDOW

    def label(self) -> str:
        scale = f" scale:{self.scale_factor:g}" if self.scale_factor != 1.0 else ""
        copy = f" copy:{self.copy_window}" if self.copy_window else ""
        return f"short:{self.short_blocks} long:{self.long_blocks} yarn:{int(self.yarn_update)}{scale}{copy}"


SETTING = re.compile(r"(\d+):(\d+)(y?)(?:x(\d+(?:\.\d*)?|\.\d+))?(?:c(\d+))?")


def parse_settings(text: str) -> list[WindowSetting]:
    settings = []
    for item in text.split(","):
        item = item.strip()
        match = SETTING.fullmatch(item)
        if match is None:
            raise SystemExit(f"error: window setting {item!r} is not SHORT:LONG[y][xF][cW] in blocks, e.g. 6:20, "
                             "6:32y, 6:32x1.05 or 6:32c8192")
        short, long, yarn_update, factor = int(match[1]), int(match[2]), match[3] == "y", float(match[4] or 1)
        copy_window = int(match[5] or 0)
        if short < 1 or long < 1:
            raise SystemExit(f"error: window setting {item!r}: windows are at least one block")
        if factor <= 0:
            raise SystemExit(f"error: window setting {item!r}: the softmax scale factor must be positive")
        if match[5] is not None and copy_window < 1:
            raise SystemExit(f"error: window setting {item!r}: the copy pointer's window is at least one token")
        settings.append(WindowSetting(short, long, yarn_update, factor, copy_window))
    return settings


def setting_shape(trainer: "train_gpt.Trainer", setting: WindowSetting):
    """(forward shape, long windows for the rotary tables) of the final validation under `setting`."""
    block = trainer.hp.schedule.window_block_size
    shape, long_windows = trainer.validation_shape(trainer.schedule.total_steps, final=True)
    shape = dataclasses.replace(shape, short_window=setting.short_blocks * block,
                                long_window=setting.long_blocks * block)
    if setting.copy_window:
        shape = dataclasses.replace(shape, copy_window=setting.copy_window)
    if setting.yarn_update:
        long_windows = long_windows + (setting.long_blocks * block,)
    return shape, long_windows


def evaluate_settings(trainer: "train_gpt.Trainer", settings: list[WindowSetting]) -> dict[str, float]:
    losses = {}
    for setting in settings:
        label, (shape, long_windows) = setting.label(), setting_shape(trainer, setting)
        trainer.set_long_windows(long_windows)  # the tables and softmax scales; validation_loss keeps them
        # buffers the compiled graphs read, so no recompile: the wide Q/K layers' scale and the narrow ones' (T3.18)
        scales = (trainer.model.attn_scale, trainer.model.narrow_attn_scale)
        schedule_scales = [scale.item() for scale in scales]
        for scale, value in zip(scales, schedule_scales):
            scale.fill_(value * setting.scale_factor)
        try:
            with torch.compiler.set_stance(skip_guard_eval_unsafe=False):  # a new shape compiles (see above)
                losses[label] = trainer.validation_loss(shape, long_windows)
        finally:
            for scale, value in zip(scales, schedule_scales):
                scale.fill_(value)
        trainer.log(train_gpt.final_windows_line(label, losses[label]))
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", default="6:32,6:20,6:24,6:48,5:32,8:32,6:32y",
                        help="comma-separated SHORT:LONG[y][xF][cW] settings in blocks, F a softmax scale factor, W "
                             "the copy pointer's window in tokens (default: %(default)s)")
    parser.add_argument("--out", default="", help="JSON of every run's losses per setting (rank 0)")
    args = parser.parse_args()
    settings = parse_settings(args.windows)
    hp = train_gpt.Hyperparameters.from_env()
    train_gpt.check_hyperparameters(hp)
    if any(setting.copy_window for setting in settings) and not hp.model.copy_pointer:
        raise SystemExit("error: a setting's cW (the copy pointer's window) needs COPY_POINTER=1")
    rank, world_size, device = train_gpt.init_process(hp)
    train_gpt.allow_graph_per_shape()
    runs = train_gpt.planned_runs(hp, world_size)
    trainer = train_gpt.Trainer(runs[0], rank, world_size, device,
                                train_gpt.open_run_log(runs[0], rank, world_size, device))
    results = {}
    for run, val_loss in trainer.run_each(runs):
        results[run.run.run_id] = {"seed": run.run.seed, "run_val_loss": val_loss,
                                   "settings": evaluate_settings(trainer, settings)}
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
