"""Validation masking's table: the next tokens GPT-2's tokenizer never emits right after a given token.

    python data/bpe_mask.py [--tokenizer-dir data/gpt2] [--vocab-size 50304] [--out TABLE.npy] [--verify PATTERN]

prints what the table bans, how long it took and where it came from (train_gpt.py's cache in
TOKENIZER_DIR/cache/, which this fills when empty), writes it as .npy with --out, and with --verify
checks that no adjacent pair of the token shards PATTERN names is banned (e.g.
--verify 'data/fineweb10B/fineweb_val_*.bin'); exit code 1 if one is. `VAL_MASK=1` runs of train_gpt.py
give those tokens probability 0 in the validation loss (docs/TECHNIQUES.md T4.5) and check their own
validation tokens the same way at start-up. The code lives in train_gpt.py, since records copy that one
file and it builds the table itself; this module re-exports it.

The rule. GPT-2's tokenizer, as tiktoken applies it (FineWeb's shards and this repository's are made
so), cuts text into pieces with a regex (a contraction 's 't 're 've 'm 'll 'd; a run of letters, of
numbers or of other characters, each with one optional leading space; whitespace) and encodes each
piece alone: a piece that is a token stays whole, any other is byte-pair encoded -- from its bytes,
repeatedly join the adjacent pair whose concatenation is the lowest-ranked token (the leftmost of equal
ones) until no adjacent pair's is a token. Token x is banned after token p when both hold:

1. their seam lies inside one piece in any text: p ends and x starts with letters (unless p can end a
   contraction piece: for GPT-2, one of the seven contraction tokens), with numbers, or with other
   characters; or p ends with a space (U+0020) and x starts with a letter, number or other character;
   or the seam splits a character's UTF-8 bytes. Classes come from Python's Unicode tables; a character
   they do not know, or bytes that do not show their character, bans nothing.
2. byte-pair encoding p's bytes followed by x's does not give [p, x].

Why a banned pair never occurs: were p and x adjacent in some text's encoding, by 1 they would share a
piece, which then was byte-pair encoded (it holds two tokens). No join crossed their seam or their
outer ends, so the parts of their bytes saw exactly the joins they would alone, in the same relative
order (lowest rank first, then leftmost): encoding p's bytes followed by x's replays them and ends in
[p, x], against 2.

Deciding 2 for 2.5 billion pairs without encoding each. Encoded alone, every GPT-2 token ends as itself
and joins in nondecreasing rank (checked per token; one that did not would ban nothing). Follow p's last
part L: made by a join of rank α (-1 for a byte), absorbed into a longer last part at rank β (never for
p itself); and x's first part F, made at γ, absorbed at δ. If L + F is a token of rank c, the seam pair
(L, F) joins before either is absorbed iff β > max(c, γ) and δ ≥ max(c, α): it exists once both do,
lower ranks join first, and among equal ranks p's joins come before the seam and the seam before x's.
So every token T = L + F bans the rows p whose L has β above one threshold against the columns x whose
F has δ at or above another; train_gpt.banned_next_table takes these unions, rows in order of β
taking growing unions. Checked against tiktoken when written, on all pairs of ids 0-1999 and a million
random ones: exactly the pairs whose encoding differs (tests/data/test_bpe_mask.py repeats it on letters).

For GPT-2 (50,257 tokens) 70,924,173 pairs fail 2 and 70,890,683 (2.81 % of all) are banned. One bit
per pair: 316 MB for the model's 50,304 ids, far too large for the repository, so train_gpt.py builds
it at start-up from encoder.json and vocab.bpe (about 5 s of one CPU core) and caches it.

Source: record #91 of the NanoGPT speedrun (modded-nanogpt PR #350, "canonical token masking"), the
local-conditioning variant of arXiv 2506.07956 applied at validation only. That record derives its
table from merge trajectories with tiktoken's ranks and the pre-tokenizer's character classes; the
criterion, its argument and the code here are this repository's own.
"""
import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # shards.py lies beside this file
sys.path.insert(0, os.path.dirname(HERE))  # the repository root: train_gpt.py
import shards  # noqa: E402
from train_gpt import (ModelConfig, SetupError, banned_next_table, banned_positions, find_shards,  # noqa: E402,F401
                       gpt2_merge_ranks, gpt2_token_bytes, validation_mask)


def is_banned(table: np.ndarray, previous: int, following: int) -> bool:
    """Whether the table bans token `following` right after token `previous`."""
    return bool((table[previous, following >> 3] >> (following & 7)) & 1)


def verify(table: np.ndarray, pattern: str, tokenizer_dir: str) -> int:
    """Print, per shard, how many of its adjacent pairs the table bans (the first few spelled out); the total."""
    spelled = gpt2_token_bytes(tokenizer_dir, "VAL_MASK")
    total = 0
    for path in find_shards(pattern):
        tokens = shards.read_tokens(path)
        banned = banned_positions(table, tokens)
        total += len(banned)
        examples = ", ".join(f"{spelled[tokens[t]]!r} {spelled[tokens[t + 1]]!r} at {t}" for t in banned[:5])
        print(f"{path}: {len(banned):,} of {len(tokens) - 1:,} adjacent pairs banned"
              + (f" ({examples})" if examples else ""))
    return total


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer-dir", default=os.path.join(HERE, "gpt2"),
                        help="folder with GPT-2's encoder.json and vocab.bpe (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=ModelConfig.vocab_size,
                        help="the model's vocabulary, rows and columns of the table (default: %(default)s)")
    parser.add_argument("--out", help="write the table here as .npy: (vocab_size, ceil(vocab_size / 8)) uint8, bit "
                                      "x %% 8 of byte x // 8 of row p set when x is banned after p")
    parser.add_argument("--verify", metavar="PATTERN", help="token shards to check: exit 1 if any adjacent pair is banned")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    try:
        table, summary = validation_mask(args.tokenizer_dir, args.vocab_size)
        print(f"{summary} ({time.perf_counter() - start:.1f}s in all)")
        if args.out:
            np.save(args.out, table)
            print(f"wrote {args.out}")
        banned = verify(table, args.verify, args.tokenizer_dir) if args.verify else 0
    except (SetupError, FileNotFoundError) as error:
        raise SystemExit(f"error: {error}") from None
    return 1 if banned else 0


if __name__ == "__main__":
    sys.exit(main())
