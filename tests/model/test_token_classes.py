"""Token classes for the n-gram hashes (NGRAM_TOKEN_CLASSES=1, docs/TECHNIQUES.md T3.22, modded-nanogpt PR #375):
the map over GPT-2's vocabulary is #375's to the bit, its normalization on examples, the table hashing classes
instead of ids, and the trainer building the map from the tokenizer."""
import hashlib
import json
import os

import numpy as np
import pytest
import torch

import train_gpt as T
from helpers import ROOT, TINY

GPT2 = os.path.join(ROOT, "data", "gpt2")
# PR #375's check (track_1_short/token_norm.py): sha256 of the map's first 50,257 entries as little-endian int32
PR375_SHA256 = "79fb57ac259495ba36f1afb9b0d5da35f3048b5067fa59c101d5a3c1ed15c2a2"


def test_the_map_is_pr375s():
    """Over GPT-2's vocabulary: #375's sha256, its 32,980 classes over the 50,257 tokens and 17,277 ids remapped; the
    special token and the padding ids keep theirs; every class is named by its smallest id."""
    classes = T.token_classes(T.gpt2_token_bytes(GPT2), 50304)
    assert classes.dtype == torch.long and classes.shape == (50304,)
    head = classes[:50257].numpy()
    assert hashlib.sha256(head.astype("<i4").tobytes()).hexdigest() == PR375_SHA256
    assert len(np.unique(head)) == 32980 and (head != np.arange(50257)).sum() == 17277
    assert torch.equal(classes[50256:], torch.arange(50256, 50304))
    assert (classes <= torch.arange(50304)).all() and torch.equal(classes[classes], classes)


def test_the_normalization():
    token_bytes = T.gpt2_token_bytes(GPT2)
    id_of = {b: i for i, b in token_bytes.items()}
    classes = T.token_classes(token_bytes, 50304)
    same = [[" The", "THE", " the", "The", "the"], [" café", " cafe"], ["\n\n", " ", "\t"]]
    for group in same:
        ids = [id_of[text.encode()] for text in group if text.encode() in id_of]
        assert len(ids) >= 2 and len({int(classes[i]) for i in ids}) == 1, group
    assert classes[id_of[b" cat"]] != classes[id_of[b" car"]]
    assert T.token_class_text("  Hello\t\n".encode()) == "hello"
    assert T.token_class_text("ﬁ".encode()) == "fi"  # NFKC
    assert T.token_class_text(" \t\r\n ".encode()) == " "  # whitespace alone stays one space
    assert T.token_class_text(b"\xe2\x80") == ""  # not whole UTF-8: the token keeps its id
    assert T.token_class_text("\u0301".encode()) == ""  # a lone accent normalizes to nothing
    assert T.token_class_text("x\u3000".encode()) == "x"  # Unicode whitespace stripped, beyond str.strip's ASCII
    assert T.token_class_text("x\x1c".encode()) == "x\x1c"  # not White_Space (Python's isspace says it is)
    with pytest.raises(T.SetupError, match="VOCAB_SIZE"):
        T.token_classes({0: b"a", 9: b"b"}, 8)


def test_the_table_hashes_classes_where_the_switch_is_on():
    """With NGRAM_TOKEN_CLASSES=1 " The cat" and " the cat" read the same rows, without it not; the map is the model's
    buffer (moved with it, not in its state_dict) and only the hashes read it."""
    token_bytes = T.gpt2_token_bytes(GPT2)
    id_of = {b: i for i, b in token_bytes.items()}
    upper = torch.tensor([id_of[b" The"], id_of[b" cat"], id_of[b" sat"]])
    lower = torch.tensor([id_of[b" the"], id_of[b" cat"], id_of[b" sat"]])
    rows = {}
    for on in (False, True):
        cfg = T.ModelConfig(**{**{k: v for k, v in TINY.items() if k in T.ModelConfig.__dataclass_fields__},
                               "vocab_size": 50304, "ngram_rows": 3001, "ngram_token_classes": on})
        table = T.NgramTable(cfg, 16, 16).shard(T.Hyperparameters.of().optim)
        assert (table.token_class is not None) == on
        if on:
            assert "token_class" in dict(table.named_buffers()) and "token_class" not in table.state_dict()
            table.token_class.copy_(T.token_classes(token_bytes, 50304))
        rows[on] = [table.load(ids).clone() for ids in (upper, lower)]
        rows[on] = [torch.sort(r).values for r in rows[on]]
    assert not torch.equal(*rows[False]) and torch.equal(*rows[True])


def test_the_trainer_builds_the_map_from_the_tokenizer(corpus, tmp_path):
    """The trainer fills the table's map from TOKENIZER_DIR's encoder.json (the tiny corpus's, with ten of its tokens
    again in capitals: those share their lowercase token's class) and logs how many ids it merges; without the switch
    the table has no map."""
    encoder = json.loads((corpus / "encoder.json").read_text())
    encoder |= {chr(ord("A") + i): 1000 + i for i in range(10)}
    (tmp_path / "encoder.json").write_text(json.dumps(encoder))
    lines = []
    common = dict(TINY, ngram_rows=3001, rank_slice=True, train_files=str(corpus / "tiny_train_*.bin"),
                  val_files=str(corpus / "tiny_val_*.bin"), tokenizer_dir=str(tmp_path))
    hp = T.Hyperparameters.of(**common, ngram_token_classes=True)
    trainer = T.Trainer(hp, 0, 1, torch.device("cpu"), lines.append)
    want = torch.arange(trainer.hp.model.vocab_size)
    want[1000:1010] = torch.arange(10)
    assert torch.equal(trainer.ngram.token_class, want)
    assert any("10 ids hashed as their class's first (T3.22)" in line for line in lines), lines
    plain = T.Trainer(T.Hyperparameters.of(**common), 0, 1, torch.device("cpu"), lambda _: None)
    assert plain.ngram.token_class is None
