"""Validation masking's table (data/bpe_mask.py, train_gpt.banned_next_table; docs/TECHNIQUES.md T4.5):
it never bans a pair of GPT-2's encoding of real text, it bans what byte-pair encoding rules out, and
data/bpe_mask.py's command line reports and checks it. The table is built once per session
(conftest.gpt2_val_mask)."""
import os
import pathlib

import numpy as np
import pytest

import train_gpt as T
from helpers import ROOT, data_module, gutenberg_documents

GPT2_DIR = os.path.join(ROOT, "data", "gpt2")
bpe_mask = data_module("bpe_mask")

# Text that walks the pre-tokenizer's edges: contractions (also before more letters and in capitals),
# whitespace runs, digits, punctuation runs, accents and combining marks, other scripts, emoji, URLs.
EDGE_TEXT = ("It's O'Neil's; they'll say I'd've gone, 'tis 'twas rock 'n' roll, DON'T it'sa 'S 'LL. "
             "“Quoted” «guillemets» naïve café Ångström e\u0301 ﬁne ß İstanbul ǅ — … ——— ###$$%% x==y&&a||b "
             "3.14159 1,000,000 2nd 10x ½ ² Ⅻ ٣٤ double  spaces\ttab\n\n\nnewlines \r\n crlf\u00a0nbsp\u3000ideo "
             "日本語のテキストです。中文文本。한국어 텍스트 Ελληνικά русский текст עברית العربية हिन्दी "
             "😀👍🏽🇺🇸 zero\u200bwidth <tag attr=\"v\"/> https://example.com/a?q=1#f mail@example.com @user #tag\x1c\x85")


@pytest.fixture(scope="module")
def encoding():
    """GPT-2's encoding as data/tokenize_docs.py builds it (tiktoken, offline) from data/gpt2."""
    return data_module("tokenize_docs").load_gpt2(GPT2_DIR)


def test_real_text_has_no_banned_pair(gpt2_val_mask, encoding):
    """The mask never removes the true next token: no adjacent pair of the encoding of the repository's
    Project Gutenberg sample (1.5 MB of prose), of EDGE_TEXT, or of 5,000 seeded random strings of
    edge characters is banned. Without the pre-tokenizer condition (rule 1), 4,042 of the sample's
    pairs would be, most of them "\\n" "\\n" (see test_what_the_table_bans)."""
    _, table = gpt2_val_mask
    pairs = 0
    for text in [*gutenberg_documents(), EDGE_TEXT]:
        tokens = np.array(encoding.encode_ordinary(text))
        assert len(T.banned_positions(table, tokens)) == 0, text[:200]
        pairs += len(tokens) - 1
    assert pairs > 390_000
    pieces = [*"aster'd ", "'s", "'ll", "  ", "\n", "\t", "12", ".", ",", "-", "é", "日本", "😀", "\u200b", "\u00a0",
              "S", "the", " the", "ing", "½", "\u0301", "\x1c", "#", "\"", "’", "ok", " t", "Ω", "ß"]
    rng = np.random.default_rng(0)
    for _ in range(5000):
        text = "".join(rng.choice(pieces, rng.integers(2, 25)))
        assert len(T.banned_positions(table, np.array(encoding.encode_ordinary(text)))) == 0, repr(text)


def test_what_the_table_bans(gpt2_val_mask, encoding):
    """Hand-derived pairs (ids from data/gpt2; a lower id is an earlier merge):
    - " t"(256) "ok"(482) is banned though " tok" is no token: encoded alone, " tok" joins " t" first, then
      " to"(284) beats "ok"(482), giving " to" "k" (allowed). So after " t" the text " tok..." never
      continues as "ok".
    - "i" "ng"(782): "in"(259) joins first, then "ing"(278): banned. "123" "4" is banned, "12" "34" allowed.
    - b"\\xc3" b"\\xa9" (the two bytes of "é", token 2634): the seam splits a character, so both lie in one
      piece, which encodes as "é": banned.
    - Pairs whose seam can be a piece boundary ban nothing, even where encoding the two alone differs:
      "'s" "t" ("it'st" is cut "it", "'s", "t"), "\\n" "\\n" ("\\n\\nA" is cut "\\n", "\\n", "A"), " the" " cat"."""
    _, table = gpt2_val_mask
    ranks = T.gpt2_merge_ranks(GPT2_DIR)

    def banned(previous: bytes, following: bytes) -> bool:
        return bpe_mask.is_banned(table, ranks[previous], ranks[following])

    assert (ranks[b" t"], ranks[b"ok"], ranks[b" to"], ranks[b"in"], ranks[b"ing"], ranks[b"ng"]) == (256, 482, 284, 259, 278, 782)
    assert b" tok" not in ranks and encoding.decode_tokens_bytes(encoding.encode_ordinary(" tok")) == [b" to", b"k"]
    assert banned(b" t", b"ok") and not banned(b" to", b"k")
    assert banned(b"i", b"ng") and banned(b"123", b"4") and not banned(b"12", b"34")
    assert banned(b"\xc3", b"\xa9") and ranks["é".encode()] == 2634
    assert encoding.decode_tokens_bytes(encoding._encode_single_piece(b"'st")) == [b"'", b"st"]  # one piece
    assert not banned(b"'s", b"t") and not banned(b"\n", b"\n") and not banned(b" the", b" cat")
    assert encoding.decode_tokens_bytes(encoding.encode_ordinary("it'st\n\nA")) == [b"it", b"'s", b"t", b"\n", b"\n", b"A"]
    assert T.banned_pair_count(table) == 70_890_683  # 2.81 % of 50,257² (Python 3.11's Unicode tables)
    assert not table[T.BOS_ID].any() and not table[:, T.BOS_ID // 8].any()  # the special token: never


def test_letter_seams_ban_exactly_what_byte_pair_encoding_rules_out(gpt2_val_mask, encoding):
    """Between two tokens of ASCII letters (rule 1 always holds: no contraction ends such a token) a pair is
    banned iff tiktoken encodes the two tokens' bytes as one piece otherwise than as the pair: every pair of
    the first 300 such tokens and 20,000 random ones."""
    _, table = gpt2_val_mask
    spelled = T.gpt2_token_bytes(GPT2_DIR)
    letters = np.array([i for i, b in spelled.items() if b.isascii() and b.isalpha()])
    first = np.repeat(letters[:300], 300), np.tile(letters[:300], 300)
    previous, following = (np.concatenate([a, np.random.default_rng(1).choice(letters, 20_000)]) for a in first)
    banned = (table[previous, following >> 3] >> (following & 7)) & 1
    for p, x, ban in zip(previous.tolist(), following.tolist(), banned.tolist()):
        encoded_alone = encoding._encode_single_piece(spelled[p] + spelled[x])  # one piece, no regex split
        assert bool(ban) == (encoded_alone != [p, x]), (spelled[p], spelled[x])


def test_command_line_reports_writes_and_verifies(gpt2_val_mask, shards, tmp_path, capsys):
    """data/bpe_mask.py: the summary (from the session's cache), --out's table, --verify's verdict per shard
    and its exit code."""
    folder, table = gpt2_val_mask
    shards.write_shard(str(tmp_path / "a_val_000000.bin"), [T.BOS_ID, 464, 3797, 3332, 13])  # "The cat sat."
    shards.write_shard(str(tmp_path / "b_val_000000.bin"), [T.BOS_ID, 256, 482, 13])  # " t" "ok" "."
    verify = ["--tokenizer-dir", str(folder), "--out", str(tmp_path / "t.npy"), "--verify", str(tmp_path / "*_val_*.bin")]
    assert bpe_mask.main(verify) == 1
    out = capsys.readouterr().out
    assert "70,890,683 (previous, next) token pairs banned, 2.81% of 50,257²" in out and "loaded from" in out
    assert f"{tmp_path / 'a_val_000000.bin'}: 0 of 4 adjacent pairs banned\n" in out
    assert f"{tmp_path / 'b_val_000000.bin'}: 1 of 3 adjacent pairs banned (b' t' b'ok' at 1)" in out
    assert np.array_equal(np.load(tmp_path / "t.npy", mmap_mode="r"), table)
    with pytest.raises(SystemExit, match="error: validation masking .*no_tokenizer/encoder.json.*VAL_MASK=0"):
        bpe_mask.main(["--tokenizer-dir", str(tmp_path / "no_tokenizer")])


def test_tokenizer_files_that_disagree_name_the_fix(tmp_path):
    """vocab.bpe's n-th merge must make token 256 + n of encoder.json: two merges swapped, or a file
    missing, stop validation masking with one line naming the fix."""
    lines = pathlib.Path(GPT2_DIR, "vocab.bpe").read_text(encoding="utf-8").splitlines()
    lines[5], lines[6] = lines[6], lines[5]  # merges 5 and 6, "r e" and "o n": tokens 260 and 261
    (tmp_path / "vocab.bpe").write_text("\n".join(lines), encoding="utf-8")
    (tmp_path / "encoder.json").write_bytes(pathlib.Path(GPT2_DIR, "encoder.json").read_bytes())
    with pytest.raises(T.SetupError, match=r"merge 5 \('o n'\) does not join two tokens into 260\. .*VAL_MASK=0"):
        T.gpt2_merge_ranks(str(tmp_path))
    (tmp_path / "vocab.bpe").unlink()
    with pytest.raises(FileNotFoundError, match="validation masking .VAL_MASK=1. needs .*vocab.bpe.*data/gpt2"):
        T.gpt2_merge_ranks(str(tmp_path))
