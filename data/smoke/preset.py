"""The smoke preset, `SMOKE=1 ./run.sh`: a tiny model trained for a minute or two on the repository's
Project Gutenberg sample, with train_gpt.py in one process, on the GPU if there is one, else on the
CPU (DEVICE=cpu COMPILE=0). Nothing is downloaded.

On first use the sample (gutenberg.jsonl.xz beside this file) is tokenized by data/tokenize_docs.py
with the repository's GPT-2 BPE files into --cache-dir (default: cache/ beside this file, ignored by
git); later runs reuse those shards while the sample is unchanged. Hyperparameter variables already
set in the environment win over the preset's (e.g. SMOKE=1 NUM_SCHEDULED_ITERATIONS=60 ./run.sh).

The preset's settings fit the repository's current train_gpt.py (--script runs another, e.g. a record's):
`<script> --check` sees them first, and a setting the script does not accept stops the run in one line.
Ctrl-C stops training as it stops train_gpt.py (its log ends with `interrupted at step N`; exit code 130).
"""
import argparse
import datetime
import hashlib
import lzma
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.dirname(HERE)
ROOT = os.path.dirname(DATA)
sys.path.insert(0, DATA)
import tokenize_docs  # noqa: E402

SAMPLE = os.path.join(HERE, "gutenberg.jsonl.xz")
TRAIN_GPT = os.path.join(ROOT, "train_gpt.py")  # the trainer the preset fits
PREFIX = "smoke"
VAL_TOKENS = 4096
SHARD_TOKENS = 100_000
STAMP = "sample.sha256"  # in the cache: the sha256 of the sample its shards were made from
# The tiny model of the CPU tests, 22 steps of 2,048 tokens (full batch: 8 micro-batches of 256; its time and
# loss: README.md beside this file). A step's cost grows with its tokens, so more steps of fewer tokens teach
# more per second.
PRESET = dict(MODEL_DIM=128, NUM_HEADS=2, HEAD_DIM=64, MLP_HIDDEN=256, NGRAM_ROWS=4001,
              STAGE_BATCH_TOKENS="2048,2048,2048,2048,2048", STAGE_MAX_SEQ_LEN="128,256,256,256,256", WINDOW_BLOCK_SIZE=16,
              NUM_SCHEDULED_ITERATIONS=21, NUM_EXTENSION_ITERATIONS=1, VAL_TOKENS=VAL_TOKENS, VAL_SEQ_LEN=1024,
              VAL_LOSS_EVERY=7, TRAIN_LOSS_EVERY=1, MUON_MOMENTUM_WARMUP_STEPS=7, MUON_MOMENTUM_COOLDOWN_STEPS=2,
              COMPILE=0, WARMUP=0, LOG_DIR="logs", ALLOW_REPEAT=1)  # longer runs on a small text repeat it
# On the CPU, glibc would map and zero the step's large tensors (vocabulary-sized gradients and logits)
# anew each time and unmap them after: 40 % of the run went to those page faults. Keep freed memory.
CPU_MALLOC = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184"


def sample_digest():
    with open(SAMPLE, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def prepare(cache_dir):
    """Tokenize the sample into cache_dir unless it holds the shards of this very sample (then silently);
    return cache_dir. A folder that cannot be made or written is one `error:` line."""
    stamp = os.path.join(cache_dir, STAMP)
    digest = sample_digest()
    if os.path.exists(stamp) and open(stamp).read().strip() == digest:
        return cache_dir
    text = os.path.join(cache_dir, "gutenberg.jsonl")
    try:
        os.makedirs(cache_dir, exist_ok=True)
        if os.path.exists(stamp):
            os.remove(stamp)  # the shards below are being replaced
        with lzma.open(SAMPLE) as src, open(text, "wb") as dst:  # the sample itself was read above
            dst.write(src.read())
    except OSError as error:
        raise SystemExit(f"error: --cache-dir {cache_dir}: cannot write the tokenized sample there "
                         f"({error.strerror or error}); give a folder you can write") from None
    try:
        status = tokenize_docs.main([text, "--prefix", PREFIX, "--out-dir", cache_dir, "--overwrite",
                                     "--val-tokens", str(VAL_TOKENS), "--shard-tokens", str(SHARD_TOKENS)])
    finally:
        os.remove(text)
    if status:
        raise SystemExit(f"error: could not tokenize {SAMPLE} (see above)")
    with open(stamp, "w") as f:
        f.write(digest + "\n")
    return cache_dir


def preset_env(cache_dir, cuda, environ):
    """The environment of the smoke run: the preset under the variables environ already sets."""
    env = {key: str(value) for key, value in PRESET.items()}
    if not cuda:
        env["GLIBC_TUNABLES"] = CPU_MALLOC
    env.update(DEVICE="cuda" if cuda else "cpu", TOKENIZER_DIR=os.path.join(DATA, "gpt2"),
               TRAIN_FILES=os.path.join(cache_dir, f"{PREFIX}_train_*.bin"),
               VAL_FILES=os.path.join(cache_dir, f"{PREFIX}_val_*.bin"),
               RUN_ID="smoke_" + datetime.datetime.now().strftime("%Y%m%d_%H%M%S"))
    env.update(environ)
    return env


def check(script, env, environ):
    """`script --check` under the run's environment: 0 when it passes, else its exit code after one line on why.
    A PRESET setting that its last line names, where it names none the user set, is one the script does not
    accept: the preset fits the repository's current train_gpt.py, not older ones (a record's)."""
    proc = subprocess.run([sys.executable, script, "--check"], env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode == 0:
        return 0
    lines = (proc.stderr.strip() or proc.stdout.strip() or f"exit code {proc.returncode}").splitlines()
    reason = lines[-1].removeprefix("error: ")  # train_gpt.py's one line, or a traceback's last
    named = sorted((name for name in env if name.isupper() and re.search(rf"\b{re.escape(name)}\b", reason)),
                   key=reason.index)
    ours = [] if any(name in environ for name in named) else [name for name in named if name in PRESET]
    shown = os.path.relpath(script, ROOT) if script.startswith(ROOT + os.sep) else script
    fits = "error: the smoke preset's settings fit the repository's current train_gpt.py; "
    if ours:
        print(fits + f"{shown} did not accept {', '.join(f'{name}={env[name]}' for name in ours)} ({reason})",
              file=sys.stderr)
    elif script != TRAIN_GPT:
        print(fits + f"{shown} --check failed: {reason}", file=sys.stderr)
    else:  # the user's setting or machine: train_gpt.py's own line says what to change
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr)
        print(f"smoke: failed (exit code {proc.returncode}); training stopped before writing a log")
    return proc.returncode


def log_paths(env) -> list[str]:
    """The logs train_gpt.py writes: LOG_DIR/RUN_ID.txt, or with SEEDS one per seed, LOG_DIR/RUN_ID_s<seed>.txt."""
    seeds = [seed.strip() for seed in env.get("SEEDS", "").split(",") if seed.strip()]
    names = [f"{env['RUN_ID']}_s{seed}" for seed in seeds] or [env["RUN_ID"]]
    return [os.path.join(env["LOG_DIR"], name + ".txt") for name in names]


def wait(child):
    """child's exit code (128 + the signal's number if one ended it). Ctrl-C reaches the child too (the
    terminal signals the whole process group) and train_gpt.py stops on its own, logging where: wait."""
    while True:
        try:
            status = child.wait()
            return 128 - status if status < 0 else status
        except KeyboardInterrupt:
            pass


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=os.path.join(HERE, "cache"),
                        help="folder for the tokenized sample (default: data/smoke/cache)")
    parser.add_argument("--script", default=TRAIN_GPT,
                        help="the trainer to run (default: the repository's train_gpt.py, which the preset fits)")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.script):
        raise SystemExit(f"error: --script {args.script}: no such file (default: the repository's train_gpt.py)")
    script = os.path.abspath(args.script)
    cache_dir = prepare(os.path.abspath(args.cache_dir))
    import torch  # after tokenizing: a bad sample or BPE file fails fast

    env = preset_env(cache_dir, torch.cuda.is_available(), os.environ)
    status = check(script, env, os.environ)
    if status:
        return status
    logs = log_paths(env)
    wheres = [log if os.path.isabs(log) else os.path.join(ROOT, log) for log in logs]
    sizes = [os.path.getsize(w) if os.path.exists(w) else None for w in wheres]  # a RUN_ID used before: appended to
    print(f"smoke: training a tiny model on {env['DEVICE']}; log{'s' * (len(logs) > 1)}: {', '.join(logs)}",
          flush=True)
    status = wait(subprocess.Popen([sys.executable, script], env=env, cwd=ROOT))
    outcome = "done" if status == 0 else "interrupted" if status == 130 else f"failed (exit code {status})"
    written = [w for w, size in zip(wheres, sizes) if os.path.exists(w) and os.path.getsize(w) != size]
    if written:
        print(f"smoke: {outcome}; the log{'s are' if len(written) > 1 else ' is'} {', '.join(written)}")
    else:
        print(f"smoke: {outcome}; training stopped before writing a log")
    return status


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # before training: tokenizing (redone next time) or checking
        print("smoke: interrupted before training", file=sys.stderr)
        sys.exit(130)
