"""bench/bench_head_dims.py: a --tile replaces FA4's SM90 backward tile for Q/K 64 wide with V/O 128
wide only, keeps the library's other fields, and is undone after its case; its fp32 reference is
causal attention within documents and windows. On a GPU with FlashAttention-4 the bench runs a
small problem: the widths it supports agree with the reference and each case gets a row."""
import dataclasses
import importlib.util
import os
import subprocess
import sys
import types

import pytest
import torch
from helpers import ROOT

import train_gpt as T

SCRIPT = os.path.join(ROOT, "bench", "bench_head_dims.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
SPEC = importlib.util.spec_from_file_location("bench_head_dims", SCRIPT)
B = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = B
SPEC.loader.exec_module(B)


@dataclasses.dataclass(frozen=True)
class FakeConfig:  # the fields of FA4's BwdConfig that a tile sets, and one it keeps
    m_block_size: int
    n_block_size: int
    num_stages_Q: int
    num_stages_dO: int
    num_stages_PdS: int


def library_tile(head_dim, head_dim_v, causal, local, sparse_block_size_q=None):
    return FakeConfig(128 if head_dim <= 64 else 64, 128, 2, 2, head_dim // 32)


def test_a_tile_replaces_only_the_narrow_pair_and_is_undone():
    fa4 = types.SimpleNamespace(_tile_size_bwd_sm90=library_tile)
    tile = B.Tile.parse("64/128,96,2,1")
    original = B.with_tile(fa4, tile)
    assert fa4._tile_size_bwd_sm90(64, 128, True, True) == FakeConfig(128, 96, 2, 1, 2)  # P/dS: the base's
    assert fa4._tile_size_bwd_sm90(64, 64, True, True) == library_tile(64, 64, True, True)
    assert fa4._tile_size_bwd_sm90(128, 128, True, True) == library_tile(128, 128, True, True)
    assert B.Tile.parse("128/64,128,2,2").config(library_tile, True, True) == FakeConfig(64, 128, 2, 2, 4)
    fa4._tile_size_bwd_sm90 = original
    assert fa4._tile_size_bwd_sm90 is library_tile
    with pytest.raises(SystemExit, match="give BASE/M,N,Q,DO"):
        B.Tile.parse("64,128,2,1")


def test_reference_attends_causally_within_documents_and_the_window():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(9, 2, 4, generator=g), torch.randn(9, 2, 4, generator=g)
    v = torch.randn(9, 2, 6, generator=g)
    cu = torch.tensor([0, 3, 9])
    out = B.reference(q, k, v, cu, window=2)
    # token 7 (position 4 of the second document) sees positions 2..4 of it: tokens 5, 6, 7
    scores = torch.einsum("hd,thd->ht", q[7], k[5:8])
    expected = torch.einsum("ht,thd->hd", scores.softmax(-1), v[5:8])
    torch.testing.assert_close(out[7], expected)
    torch.testing.assert_close(out[0], v[0])  # a document's first token sees only itself


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and T.fa4_runs_here("cuda")), reason="needs FA4 on a GPU")
def test_bench_runs_each_case_on_a_small_problem():
    out = subprocess.run([sys.executable, SCRIPT, "--tokens", "4096", "--max-seq-len", "1024", "--window", "384",
                          "--tile", "64/128,128,2,1"], check=False, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| 1", "| 6"))]
    assert len(rows) == 4, out.stdout
    for row in rows[:2]:  # (128, 128) and (64, 64): FA4's own tiles
        errors = [float(x) for x in row.strip("|").split("|")[5:9]]
        assert max(errors) < 2e-2, row
