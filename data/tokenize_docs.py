"""Tokenize local text with the GPT-2 BPE into token shards (the format of the FineWeb shards).

Inputs are .txt files (one document each), .jsonl files (one JSON object per line, the text in
--text-field; blank lines are skipped) and folders, searched recursively for both kinds in sorted
path order. Every document is preceded by <|endoftext|> (50256, acting as BOS); there is no EOS.
The token stream is cut into consecutive slices, so documents may straddle shards: the first
--val-tokens + 1 tokens go to <prefix>_val_000000.bin (the extra token is the last target of
train_gpt.py's VAL_TOKENS=--val-tokens), the rest to <prefix>_train_000001.bin,
<prefix>_train_000002.bin, ... of --shard-tokens tokens each. The output does not depend on --workers.
GPT-2's BPE files come from --bpe-dir (default data/gpt2, kept in the repository), checked against
their known sha256; nothing is downloaded.
"""
import argparse
import glob
import json
import os
import sys
from itertools import islice
from multiprocessing import Pool

import numpy as np
import tiktoken
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # shards.py lies beside this file, whether it is run as a script or imported
import gpt2_files  # noqa: E402
import shards  # noqa: E402

EOT = 50256  # <|endoftext|>
# GPT-2's pre-tokenization regex (openai/gpt-2 encoder.py), as tiktoken's "gpt2" encoding uses it
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
SUFFIXES = (".txt", ".jsonl")
DEFAULT_VAL_TOKENS = 10_485_760  # train_gpt.py's default VAL_TOKENS (10 * 2**20)
DEFAULT_SHARD_TOKENS = 100_000_000
BATCH_PER_WORKER = 64  # documents in flight per worker; bounds memory on huge inputs

ENCODING = None  # per process, set by init_worker
TEXT_FIELD = None


class InputError(Exception):
    """Bad input or tokenizer files; the message names the file (and line)."""


def gpt2_byte_decoder():
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others for chr(256 + n)."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


def load_gpt2(bpe_dir):
    """Build the GPT-2 encoding from bpe_dir's encoder.json + vocab.bpe, after checking them against
    gpt2_files' sizes and sha256 (offline; tiktoken's own loader would download or need `blobfile`)."""
    defects = gpt2_files.defects(bpe_dir)
    if defects:
        found = "; ".join(f"{os.path.join(bpe_dir, name)} {reason}" for name, reason in defects.items())
        raise InputError(f"GPT-2's BPE files are not usable: {found}. Restore the repository's copy "
                         f"(git checkout -- data/gpt2) or pass --bpe-dir DIR holding GPT-2's encoder.json and vocab.bpe")
    decode = gpt2_byte_decoder()
    with open(os.path.join(bpe_dir, "encoder.json"), encoding="utf-8") as f:
        # the ranks of GPT-2's vocabulary follow merge priority: 256 single bytes, then one per merge
        ranks = {bytes(decode[ch] for ch in token): rank for token, rank in json.load(f).items() if rank != EOT}
    return tiktoken.Encoding(name="gpt2-local", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT})


def init_worker(bpe_dir, text_field):
    global ENCODING, TEXT_FIELD
    ENCODING, TEXT_FIELD = load_gpt2(bpe_dir), text_field


def find_files(inputs):
    files = []
    for path in inputs:
        if os.path.isdir(path):
            found = glob.glob(os.path.join(path, "**", "*"), recursive=True)
            files += sorted(p for p in found if p.endswith(SUFFIXES) and os.path.isfile(p))
        elif os.path.isfile(path) and path.endswith(SUFFIXES):
            files.append(path)
        else:
            raise InputError(f"{path}: not a folder, .txt file or .jsonl file")
    return files


def iter_items(files):
    """Work items (where, jsonl line or None for a whole .txt file, size in bytes), in input order."""
    for path in files:
        if path.endswith(".txt"):
            yield path, None, os.path.getsize(path)
        else:
            with open(path, "rb") as f:
                for lineno, line in enumerate(f, 1):
                    yield f"{path}:{lineno}", line, len(line)


def encode_item(item):
    """(tokens, input bytes consumed): tokens are [EOT] + the document's BPE ids as uint16,
    or None for a blank .jsonl line."""
    where, line, nbytes = item
    if line is None:
        try:
            with open(where, encoding="utf-8", newline="") as f:  # keep the text byte-exact
                text = f.read()
        except UnicodeDecodeError as err:
            raise InputError(f"{where}: not UTF-8 text ({err})") from None
    elif not line.strip():
        return None, nbytes
    else:
        try:
            record = json.loads(line)
        except ValueError as err:
            raise InputError(f"{where}: invalid JSON ({err})") from None
        text = record.get(TEXT_FIELD) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise InputError(f"{where}: no string field {TEXT_FIELD!r} (set --text-field)")
    # encode_ordinary: a literal "<|endoftext|>" inside a document is plain text, not token 50256
    tokens = np.array([EOT] + ENCODING.encode_ordinary(text), dtype=np.uint16)
    return tokens, nbytes


def encode_stream(items, workers, bpe_dir, text_field):
    """Yield encode_item results in input order, using `workers` processes."""
    if workers == 1:
        init_worker(bpe_dir, text_field)
        yield from map(encode_item, items)
        return
    with Pool(workers, initializer=init_worker, initargs=(bpe_dir, text_field)) as pool:
        # bounded batches: Pool.imap would otherwise read the whole input into its queue
        while batch := list(islice(items, workers * BATCH_PER_WORKER)):
            yield from pool.imap(encode_item, batch, chunksize=8)


class ShardWriter:
    """Cuts the token stream into consecutive shards: the val shard first, then train shards."""

    def __init__(self, out_dir, prefix, val_tokens, shard_tokens):
        self.out_dir, self.prefix, self.shard_tokens = out_dir, prefix, shard_tokens
        # size of the val shard still to be written (0 once it is written): VAL_TOKENS=val_tokens
        # predicts val_tokens targets, the last of which is token val_tokens + 1
        self.val_size = val_tokens + 1 if val_tokens else 0
        self.buffer = np.empty(max(self.val_size, shard_tokens), dtype=np.uint16)
        self.fill = 0
        self.train_shards = 0
        self.written = []  # (path, number of tokens)

    def capacity(self):
        return self.val_size or self.shard_tokens

    def add(self, tokens):
        while tokens.size:
            take = min(tokens.size, self.capacity() - self.fill)
            self.buffer[self.fill:self.fill + take] = tokens[:take]
            self.fill += take
            tokens = tokens[take:]
            if self.fill == self.capacity():
                self.flush()

    def flush(self):
        if self.val_size:
            name, self.val_size = f"{self.prefix}_val_000000.bin", 0
        else:
            self.train_shards += 1
            name = f"{self.prefix}_train_{self.train_shards:06d}.bin"
        path = os.path.join(self.out_dir, name)
        shards.write_shard(path, self.buffer[:self.fill])
        self.written.append((path, self.fill))
        self.fill = 0

    def close(self):
        if self.fill:
            self.flush()

    def discard(self):
        for path, _ in self.written:
            os.remove(path)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help=".txt files, .jsonl files or folders containing them")
    parser.add_argument("--prefix", required=True,
                        help="shard name prefix, e.g. mydata -> mydata_train_000001.bin")
    parser.add_argument("--out-dir", help="output folder (default: data/<prefix> beside this script)")
    parser.add_argument("--text-field", default="text",
                        help="JSON field holding the text in .jsonl files (default text)")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                        help=f"tokens per train shard (default {DEFAULT_SHARD_TOKENS:_})")
    parser.add_argument("--val-tokens", type=int, default=DEFAULT_VAL_TOKENS,
                        help=f"validation size N: the val shard holds the first N + 1 tokens of the stream, so that "
                             f"train_gpt.py's VAL_TOKENS=N can use it (N inputs, and the N-th input's target is token "
                             f"N + 1); 0 = no val shard (default {DEFAULT_VAL_TOKENS:_}, train_gpt.py's VAL_TOKENS)")
    parser.add_argument("--bpe-dir", default=gpt2_files.DEFAULT_DIR,
                        help="folder with GPT-2's encoder.json and vocab.bpe, checked against their sha256 "
                             "(default: data/gpt2 in this repository); nothing is downloaded")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="tokenizer processes (default: all CPUs); the output is the same for any value")
    parser.add_argument("--overwrite", action="store_true",
                        help="delete existing <prefix>_val/_train shards in the output folder first")
    args = parser.parse_args(argv)
    if args.shard_tokens < 1 or args.val_tokens < 0 or args.workers < 1:
        parser.error("--shard-tokens and --workers must be >= 1, --val-tokens >= 0")
    if not args.prefix or os.sep in args.prefix:
        parser.error("--prefix must be a plain file name prefix")
    return args


def tokenize(args):
    out_dir = args.out_dir or os.path.join(HERE, args.prefix)
    load_gpt2(args.bpe_dir)  # fail early on missing or damaged BPE files
    files = find_files(args.inputs)
    if not files:
        raise InputError(f"no .txt or .jsonl files in {', '.join(args.inputs)}")
    os.makedirs(out_dir, exist_ok=True)
    existing = sorted(path for kind in ("val", "train")
                      for path in glob.glob(os.path.join(out_dir, f"{glob.escape(args.prefix)}_{kind}_*.bin")))
    if existing and not args.overwrite:
        raise InputError(f"{out_dir} already has {len(existing)} {args.prefix} shards (e.g. {existing[0]}); "
                         f"pass --overwrite to replace them")
    for path in existing:
        os.remove(path)
    writer = ShardWriter(out_dir, args.prefix, args.val_tokens, args.shard_tokens)
    documents = tokens = 0
    try:
        with tqdm(total=sum(os.path.getsize(p) for p in files), unit="B", unit_scale=True, desc="tokenize") as bar:
            for doc, nbytes in encode_stream(iter_items(files), args.workers, args.bpe_dir, args.text_field):
                bar.update(nbytes)
                if doc is not None:
                    writer.add(doc)
                    documents += 1
                    tokens += doc.size
        if not documents:
            raise InputError(f"no documents in {', '.join(args.inputs)} (only blank .jsonl lines)")
        writer.close()
    except BaseException:
        writer.discard()  # never leave a partial data set behind
        raise
    print(f"{documents:,} documents, {tokens:,} tokens from {len(files)} input files -> "
          f"{len(writer.written)} shards in {out_dir}:")
    for path, count in writer.written:
        print(f"  {os.path.basename(path)}  {count:,} tokens")
    if not writer.train_shards:
        print(f"warning: no train shard: the corpus ({tokens:,} tokens) is not longer than the val shard "
              f"(--val-tokens {args.val_tokens:,} + 1); lower --val-tokens", file=sys.stderr)


def main(argv=None):
    args = parse_args(argv)
    try:
        tokenize(args)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
