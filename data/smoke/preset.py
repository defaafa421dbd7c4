"""The smoke preset, `SMOKE=1 ./run.sh`: a tiny model trained for a minute or two on the repository's
Project Gutenberg sample, with train_gpt.py in one process, on the GPU if there is one, else on the
CPU (DEVICE=cpu COMPILE=0). Nothing is downloaded.

On first use the sample (gutenberg.jsonl.xz beside this file) is tokenized by data/tokenize_docs.py
with the repository's GPT-2 BPE files into --cache-dir (default: cache/ beside this file, ignored by
git); later runs reuse those shards while the sample is unchanged. Hyperparameter variables already
set in the environment win over the preset's (e.g. SMOKE=1 NUM_SCHEDULED_ITERATIONS=60 ./run.sh).
"""
import argparse
import datetime
import hashlib
import lzma
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.dirname(HERE)
ROOT = os.path.dirname(DATA)
sys.path.insert(0, DATA)
import tokenize_docs  # noqa: E402

SAMPLE = os.path.join(HERE, "gutenberg.jsonl.xz")
PREFIX = "smoke"
VAL_TOKENS = 4096
SHARD_TOKENS = 100_000
STAMP = "sample.sha256"  # in the cache: the sha256 of the sample its shards were made from
# The tiny model of the CPU tests, 22 steps of 2,048 tokens (full batch: 8 micro-batches of 256; its time and
# loss: README.md beside this file). A step's cost grows with its tokens, so more steps of fewer tokens teach
# more per second.
PRESET = dict(MODEL_DIM=128, NUM_HEADS=2, HEAD_DIM=64, MLP_HIDDEN=256, BIGRAM_ROWS=1001, NGRAM_ROWS=4001,
              STAGE_BATCH_TOKENS="2048,2048,2048,2048,2048", STAGE_MAX_SEQ_LEN="128,256,256,256,256", WINDOW_BLOCK_SIZE=16,
              NUM_SCHEDULED_ITERATIONS=21, NUM_EXTENSION_ITERATIONS=1, VAL_TOKENS=VAL_TOKENS, VAL_SEQ_LEN=1024,
              VAL_LOSS_EVERY=7, TRAIN_LOSS_EVERY=1, MUON_MOMENTUM_WARMUP_STEPS=7, MUON_MOMENTUM_COOLDOWN_STEPS=2,
              COMPILE=0, WARMUP=0, LOG_DIR="logs")
# On the CPU, glibc would map and zero the step's large tensors (vocabulary-sized gradients and logits)
# anew each time and unmap them after: 40 % of the run went to those page faults. Keep freed memory.
CPU_MALLOC = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184"


def sample_digest():
    with open(SAMPLE, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def prepare(cache_dir):
    """Tokenize the sample into cache_dir unless it holds the shards of this very sample; return cache_dir."""
    stamp = os.path.join(cache_dir, STAMP)
    digest = sample_digest()
    if os.path.exists(stamp) and open(stamp).read().strip() == digest:
        print(f"smoke: reusing the tokenized sample in {cache_dir}")
        return cache_dir
    os.makedirs(cache_dir, exist_ok=True)
    if os.path.exists(stamp):
        os.remove(stamp)  # the shards below are being replaced
    text = os.path.join(cache_dir, "gutenberg.jsonl")
    with lzma.open(SAMPLE) as src, open(text, "wb") as dst:
        dst.write(src.read())
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=os.path.join(HERE, "cache"),
                        help="folder for the tokenized sample (default: data/smoke/cache)")
    args = parser.parse_args(argv)
    cache_dir = prepare(args.cache_dir)
    import torch  # after tokenizing: a bad sample or BPE file fails fast

    env = preset_env(cache_dir, torch.cuda.is_available(), os.environ)
    log = os.path.join(env["LOG_DIR"], env["RUN_ID"] + ".txt")
    print(f"smoke: training a tiny model on {env['DEVICE']}; log: {log}", flush=True)
    status = subprocess.run([sys.executable, os.path.join(ROOT, "train_gpt.py")], env=env, cwd=ROOT).returncode
    where = log if os.path.isabs(log) else os.path.join(ROOT, log)
    print(f"smoke: {'done' if status == 0 else f'failed (exit code {status})'}; the log is {where}")
    return status


if __name__ == "__main__":
    sys.exit(main())
