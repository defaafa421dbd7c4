"""Build the smoke preset's text sample from a token shard of the proxy corpus (run once, by hand).

    python data/smoke/make_sample.py PATH/proxy_val_000000.bin.xz [--max-bytes 1500000]

Decodes the shard's documents (each starts with <|endoftext|>) with the repository's GPT-2 BPE and
keeps those that are plainly Project Gutenberg book prose: the proxy corpus keeps Gutenberg's hard
line wrapping (~70 characters), while its Wikipedia articles and IMDB reviews have one paragraph
per line. The kept documents, in shard order up to --max-bytes of text, are cut at blank lines into
pieces of at most --piece-chars characters (the smoke run truncates documents at 256 tokens, about
1,000 characters, so whole 1,500-6,000-character documents would waste most of their text) and written
as .jsonl ({"text": ...} per line), xz-compressed, to gutenberg.jsonl.xz beside this file. README.md
there says where the text comes from and under which terms.
"""
import argparse
import json
import lzma
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # data/: shards.py, tokenize_docs.py
import shards  # noqa: E402
import tokenize_docs  # noqa: E402

SAMPLE = os.path.join(HERE, "gutenberg.jsonl.xz")
MIN_LINES = 10  # a short document says too little about its wrapping
WRAP_MIN, WRAP_MAX = 50, 80  # the length of a hard-wrapped prose line
WRAPPED_SHARE = 0.6  # of the non-blank lines; verse, plays and lists fall below it


def is_wrapped_prose(text):
    """True for hard-wrapped prose: no line longer than WRAP_MAX, and most lines about as long as the wrap."""
    lengths = [len(line) for line in text.split("\n") if line.strip()]
    if len(lengths) < MIN_LINES or max(lengths) > WRAP_MAX:
        return False
    return sum(WRAP_MIN <= n for n in lengths) >= WRAPPED_SHARE * len(lengths)


def read_tokens(path):
    """The tokens of a shard, or of an xz-compressed shard (.bin.xz)."""
    if not path.endswith(".xz"):
        return shards.read_tokens(path)
    with lzma.open(path) as f:
        raw = f.read()
    header = np.frombuffer(raw, dtype="<i4", count=shards.HEADER_INTS)
    if header[0] != shards.MAGIC or len(raw) != shards.HEADER_BYTES + shards.TOKEN_BYTES * int(header[2]):
        raise SystemExit(f"error: {path} is not an xz-compressed token shard")
    return np.frombuffer(raw, dtype="<u2", offset=shards.HEADER_BYTES)


def documents(tokens, encoding):
    """The decoded documents that start in `tokens` (the text after each <|endoftext|>)."""
    starts = np.flatnonzero(tokens == tokenize_docs.EOT)
    for start, end in zip(starts, [*starts[1:], len(tokens)]):
        yield encoding.decode(tokens[start + 1:end].tolist())


def select(texts, max_bytes):
    """The wrapped-prose texts, in order, while their UTF-8 size stays within max_bytes."""
    kept, size = [], 0
    for text in filter(is_wrapped_prose, texts):
        size += len(text.encode("utf-8"))
        if size > max_bytes:
            break
        kept.append(text)
    return kept


def pieces(text, limit):
    """`text` cut at blank lines into pieces of at most `limit` characters (a longer paragraph stays whole)."""
    out, current = [], ""
    for paragraph in text.split("\n\n"):
        if current and len(current) + 2 + len(paragraph) > limit:
            out.append(current)
            current = paragraph
        else:
            current = f"{current}\n\n{paragraph}" if current else paragraph
    return out + [current]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shard", help="a proxy corpus shard (.bin or .bin.xz)")
    parser.add_argument("--max-bytes", type=int, default=1_500_000, help="text size limit (default 1,500,000)")
    parser.add_argument("--piece-chars", type=int, default=1000, help="piece size limit (default 1000)")
    parser.add_argument("--out", default=SAMPLE, help="output file (default: gutenberg.jsonl.xz beside this script)")
    args = parser.parse_args(argv)
    encoding = tokenize_docs.load_gpt2(tokenize_docs.gpt2_files.DEFAULT_DIR)
    texts = select(documents(read_tokens(args.shard), encoding), args.max_bytes)
    if not texts:
        raise SystemExit(f"error: no hard-wrapped prose documents in {args.shard}")
    texts = [piece for text in texts for piece in pieces(text, args.piece_chars)]
    with lzma.open(args.out, "wt", encoding="utf-8", preset=9 | lzma.PRESET_EXTREME) as f:
        f.writelines(json.dumps({"text": text}, ensure_ascii=False) + "\n" for text in texts)
    total = sum(len(text.encode("utf-8")) for text in texts)
    print(f"{len(texts)} pieces, {total:,} bytes of text -> {args.out} ({os.path.getsize(args.out):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
