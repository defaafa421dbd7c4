"""Tokenize local text with the GPT-2 BPE into token shards (the format of the FineWeb shards).

Inputs are .txt files (one document each), .jsonl files (one JSON object per line, the text in
--text-field; blank lines are skipped) and folders, searched recursively for both kinds in sorted
path order. Every document is preceded by <|endoftext|> (50256, acting as BOS); there is no EOS.
<prefix>_val_000000.bin holds a seeded random sample (--seed) of whole documents drawn from all the
inputs, in the sample's order, cut at exactly --val-tokens + 1 tokens (the extra token is the last
target of train_gpt.py's VAL_TOKENS=--val-tokens): only its last document is truncated, and the rest
of that document is dropped, so no val text is in train. The other documents, in input order, are
cut into consecutive slices <prefix>_train_000001.bin, <prefix>_train_000002.bin, ... of
--shard-tokens tokens each, so documents may straddle train shards. The tokens first go to a
temporary file in the output folder (2 bytes per token), removed at the end. The output depends on
--seed, not on --workers. A corpus too small to leave any train tokens is an error, and a failed run
leaves no shards (and no folder it created) behind.
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
DEFAULT_SEED = 1337
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
    """Cuts a token stream into consecutive train shards of shard_tokens tokens."""

    def __init__(self, out_dir, prefix, shard_tokens):
        self.out_dir, self.prefix, self.shard_tokens = out_dir, prefix, shard_tokens
        self.buffer = np.empty(shard_tokens, dtype=np.uint16)
        self.fill = 0
        self.train_shards = 0
        self.written = []  # (path, number of tokens)

    def add(self, tokens):
        while tokens.size:
            take = min(tokens.size, self.shard_tokens - self.fill)
            self.buffer[self.fill:self.fill + take] = tokens[:take]
            self.fill += take
            tokens = tokens[take:]
            if self.fill == self.shard_tokens:
                self.flush()

    def flush(self):
        self.train_shards += 1
        self.write(f"{self.prefix}_train_{self.train_shards:06d}.bin", self.buffer[:self.fill])
        self.fill = 0

    def write(self, name, tokens):
        path = os.path.join(self.out_dir, name)
        shards.write_shard(path, tokens)
        self.written.append((path, tokens.size))

    def close(self):
        if self.fill:
            self.flush()

    def discard(self):
        for path, _ in self.written:
            os.remove(path)


class TokenSpool:
    """The documents' tokens (BOS included) in input order, in a temporary file; lengths[i] is document i's."""

    def __init__(self, path):
        self.path, self.lengths = path, []
        self.file = open(path, "wb")

    def add(self, tokens):
        self.file.write(tokens.astype("<u2", copy=False).tobytes())
        self.lengths.append(tokens.size)

    def tokens(self):
        """All tokens as a read-only array on the file, and each document's offset into it."""
        self.file.close()
        offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=offsets[1:])
        return np.memmap(self.path, dtype="<u2", mode="r", shape=(int(offsets[-1]),)), offsets

    def remove(self):
        self.file.close()
        if os.path.exists(self.path):
            os.remove(self.path)


def val_sample(lengths, val_size, seed):
    """Indices of the val documents: a seeded random order of all documents, taken until they hold
    val_size tokens (the last one is then cut); empty when val_size is 0. The order stays the same
    across numpy versions (RandomState's stream is frozen)."""
    if not val_size:
        return np.zeros(0, dtype=np.int64)
    order = np.random.RandomState(seed).permutation(len(lengths))
    needed = int(np.searchsorted(np.cumsum(np.asarray(lengths)[order]), val_size)) + 1
    return order[:needed]


def train_runs(ndocs, val_docs):
    """(first, end) ranges of consecutive documents not in val_docs, in input order."""
    runs, first = [], 0
    for i in sorted(int(i) for i in val_docs):
        if i > first:
            runs.append((first, i))
        first = i + 1
    return runs + ([(first, ndocs)] if first < ndocs else [])


def write_splits(writer, spool, val_size, seed):
    """Write the val sample's shard, then the other documents as train shards."""
    tokens, offsets = spool.tokens()
    val_docs = val_sample(spool.lengths, val_size, seed)
    runs = train_runs(len(spool.lengths), val_docs)
    if not runs:
        total = int(offsets[-1])
        raise InputError(f"the corpus ({total:,} tokens in {len(spool.lengths):,} documents) is too small: the val "
                         f"sample (--val-tokens {val_size - 1:,} + 1) takes every document and leaves no train shard; "
                         f"lower --val-tokens")
    if val_size:
        val = np.concatenate([tokens[offsets[i]:offsets[i + 1]] for i in val_docs])[:val_size]
        writer.write(f"{writer.prefix}_val_000000.bin", val)
    for first, end in runs:
        writer.add(np.asarray(tokens[offsets[first]:offsets[end]]))
    writer.close()
    del tokens  # release the file before it is removed


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
                        help=f"validation size N: the val shard holds N + 1 tokens of randomly drawn whole "
                             f"documents (the last one cut), so that train_gpt.py's VAL_TOKENS=N can use it (N "
                             f"inputs, and the N-th input's target is token N + 1); 0 = no val shard (default "
                             f"{DEFAULT_VAL_TOKENS:_}, train_gpt.py's VAL_TOKENS)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED,
                        help=f"seed of the val sample, the documents drawn for the val shard (default {DEFAULT_SEED})")
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


def new_folders(path):
    """The folders that creating `path` would make, deepest first."""
    folders = []
    path = os.path.abspath(path)
    while not os.path.exists(path):
        folders.append(path)
        path = os.path.dirname(path)
    return folders


def tokenize(args):
    out_dir = args.out_dir or os.path.join(HERE, args.prefix)
    load_gpt2(args.bpe_dir)  # fail early on missing or damaged BPE files
    files = find_files(args.inputs)
    if not files:
        raise InputError(f"no .txt or .jsonl files in {', '.join(args.inputs)}")
    existing = sorted(path for kind in ("val", "train")
                      for path in glob.glob(os.path.join(out_dir, f"{glob.escape(args.prefix)}_{kind}_*.bin")))
    if existing and not args.overwrite:
        raise InputError(f"{out_dir} already has {len(existing)} {args.prefix} shards (e.g. {existing[0]}); "
                         f"pass --overwrite to replace them")
    created = new_folders(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    for path in existing:
        os.remove(path)
    writer = ShardWriter(out_dir, args.prefix, args.shard_tokens)
    spool = TokenSpool(os.path.join(out_dir, f".{args.prefix}_tokens.tmp"))
    try:
        with tqdm(total=sum(os.path.getsize(p) for p in files), unit="B", unit_scale=True, desc="tokenize") as bar:
            for doc, nbytes in encode_stream(iter_items(files), args.workers, args.bpe_dir, args.text_field):
                bar.update(nbytes)
                if doc is not None:
                    spool.add(doc)
        if not spool.lengths:
            raise InputError(f"no documents in {', '.join(args.inputs)} (only blank .jsonl lines)")
        write_splits(writer, spool, args.val_tokens + 1 if args.val_tokens else 0, args.seed)
    except BaseException:
        writer.discard()  # never leave a partial data set behind
        spool.remove()
        for folder in created:  # deepest first
            if not os.listdir(folder):
                os.rmdir(folder)
        raise
    spool.remove()
    print(f"{len(spool.lengths):,} documents, {sum(spool.lengths):,} tokens from {len(files)} input files -> "
          f"{len(writer.written)} shards in {out_dir}:")
    for path, count in writer.written:
        print(f"  {os.path.basename(path)}  {count:,} tokens")


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
