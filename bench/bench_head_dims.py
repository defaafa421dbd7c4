"""Microbenchmark for narrow attention (issue #51 item 3): FlashAttention-4's varlen attention with
Q/K heads of width 64 instead of 128, V/O at 128 or 64, on one rank's slice of a stage-3 step
(49,152 tokens by default, 6 heads, causal, stage 3's short window of 640 keys back), as train_gpt.py calls it (FA4's
_flash_attn_fwd / _flash_attn_bwd, q pre-scaled). Per case: forward and backward medians (triton
do_bench), and the relative error of out, dq, dk, dv against an fp32 reference on a short problem.

FA4 4.0.0b36 picks its SM90 backward tile from the Q/K width alone (`_tile_size_bwd_sm90`): for
(64, 128) it takes the 64-wide tile (128 x 128, two stages of Q, dO and P/dS), whose shared memory
counts dO and V at 128 wide: ~240 KB against an H100's 227 KB, so the launch fails. Each --tile
BASE/M,N,Q,DO replaces that choice for (64, 128) with the library's tile for Q/K width BASE, its
block sizes M x N and its Q and dO stages set as given (the P/dS stages stay the library's: they
are not part of FA4's compile key, so two tiles differing only there would share one kernel).
A tile that fails prints its error and the rest go on.

Shared memory of the 64-wide tile with V/O at 128 (bf16; dQ accumulated in fp32; P kept in
registers): Q 2x128x64 (32 KB) + K 128x64 (16) + V 128x128 (32) + dO 2x128x128 (64) + dS 2x128x128
(64) + dQaccum 128x64x4 (32) = 240 KB. One dO stage: 208 KB; blocks of 64 query rows: 144 KB.

    python bench/bench_head_dims.py                         # every case and the default tiles
    python bench/bench_head_dims.py --tile 64/128,128,2,1 --tokens 16384 --window 384
"""
import argparse
import dataclasses
import itertools
import os
import sys

import numpy as np
import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import document_lengths, rel

import train_gpt as T

HEADS = 6
DEFAULT_TILES = ("64/128,128,2,1", "128/64,128,2,2", "64/128,96,2,2")


@dataclasses.dataclass(frozen=True)
class Tile:
    """The library's SM90 backward tile for Q/K width `base`, with these block sizes and stages."""
    base: int
    m: int
    n: int
    q_stages: int
    do_stages: int

    @classmethod
    def parse(cls, text: str) -> "Tile":
        try:
            base, rest = text.split("/")
            m, n, q, do = (int(x) for x in rest.split(","))
            return cls(int(base), m, n, q, do)
        except ValueError:
            raise SystemExit(f"error: --tile {text!r}: give BASE/M,N,Q,DO, e.g. 64/128,128,2,1") from None

    def config(self, library_tile, causal: bool, local: bool):
        cfg = library_tile(self.base, self.base, causal, local)
        return dataclasses.replace(cfg, m_block_size=self.m, n_block_size=self.n, num_stages_Q=self.q_stages,
                                   num_stages_dO=self.do_stages)

    def __str__(self):
        return f"{self.base}/{self.m},{self.n},{self.q_stages},{self.do_stages}"


def with_tile(fa4, tile: Tile | None):
    """FA4's backward tile choice, replaced by `tile` for Q/K 64 wide with V/O 128 wide; the
    original function (restore it with fa4._tile_size_bwd_sm90 = original)."""
    original = fa4._tile_size_bwd_sm90
    if tile is not None:
        def chosen(head_dim, head_dim_v, causal, local, sparse_block_size_q=None):
            if head_dim == 64 and head_dim_v == 128 and sparse_block_size_q is None:
                return tile.config(original, causal, local)
            return original(head_dim, head_dim_v, causal, local, sparse_block_size_q)
        fa4._tile_size_bwd_sm90 = chosen
    return original


def reference(q, k, v, cu_seqlens, window):
    """fp32 causal attention within each document, each query seeing keys at most `window` back,
    as the model's windows do; q pre-scaled."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
    bounds = cu_seqlens.tolist()
    for start, end in itertools.pairwise(bounds):
        if end <= start:
            continue
        qs, ks, vs = (t[start:end].float().transpose(0, 1) for t in (q, k, v))
        pos = torch.arange(end - start, device=q.device)
        allowed = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] <= window)
        scores = (qs @ ks.transpose(1, 2)).masked_fill(~allowed, float("-inf"))
        out[start:end] = (scores.softmax(-1) @ vs).transpose(0, 1)
    return out


def problem(tokens, max_seq_len, qk_dim, v_dim, seed, device):
    rng = np.random.default_rng(seed)
    lengths, max_docs = document_lengths(tokens, max_seq_len, 1000.0, rng)
    cu = torch.tensor(T.cu_seqlens_for(lengths, tokens, max_docs), device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(tokens, HEADS, qk_dim, device=device, generator=gen, dtype=torch.bfloat16) * qk_dim ** -0.5
    k = torch.randn(tokens, HEADS, qk_dim, device=device, generator=gen, dtype=torch.bfloat16)
    v = torch.randn(tokens, HEADS, v_dim, device=device, generator=gen, dtype=torch.bfloat16)
    grad = torch.randn(tokens, HEADS, v_dim, device=device, generator=gen, dtype=torch.bfloat16)
    return q, k, v, grad, cu, max_seq_len


def run_case(fa4, qk_dim, v_dim, args, device):
    """(forward ms, backward ms, errors of out/dq/dk/dv) of one head-width pair."""
    left, right = T._fa4_window_size(args.window)
    call = {"softmax_scale": 1.0, "causal": True, "window_size_left": left, "window_size_right": right}

    def forward(q, k, v, cu, max_len):
        out, lse, *_ = fa4._flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                           max_seqlen_k=max_len, return_lse=True, **call)
        return out, lse

    def backward(q, k, v, out, grad, lse, cu, max_len):
        return fa4._flash_attn_bwd(q, k, v, out, grad, lse, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                   max_seqlen_k=max_len, **call)

    # correctness on a short problem
    q, k, v, grad, cu, max_len = problem(2048, 1024, qk_dim, v_dim, args.seed + 1, device)
    out, lse = forward(q, k, v, cu, max_len)
    dq, dk, dv = backward(q, k, v, out, grad, lse, cu, max_len)[:3]
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    expected = reference(*leaves, cu, args.window)
    expected.backward(grad.float())
    errors = [rel(got, want) for got, want in zip((out, dq, dk, dv), (expected, *(t.grad for t in leaves)))]
    # time on the stage's shape
    q, k, v, grad, cu, max_len = problem(args.tokens, args.max_seq_len, qk_dim, v_dim, args.seed, device)
    out, lse = forward(q, k, v, cu, max_len)
    fwd = do_bench(lambda: forward(q, k, v, cu, max_len), warmup=25, rep=200, return_mode="median")
    bwd = do_bench(lambda: backward(q, k, v, out, grad, lse, cu, max_len), warmup=25, rep=200, return_mode="median")
    return fwd, bwd, errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=49152, help="tokens per forward (one rank's slice)")
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--window", type=int, default=640, help="keys at most this far back (stage 3's short window)")
    parser.add_argument("--tile", action="append", help="BASE/M,N,Q,DO: a backward tile for (64, 128) (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tiles = [Tile.parse(t) for t in (args.tile or DEFAULT_TILES)]
    if not T.fa4_runs_here("cuda"):
        raise SystemExit("error: needs FlashAttention-4 (flash_attn.cute) on a Hopper or Blackwell GPU")
    fa4, device = T.fa4_interface, torch.device("cuda")
    # the library's own choice: train_gpt.py wraps it with FA4_NARROW_BACKWARD_TILE (128/64,128,2,2) for (64, 128)
    fa4._tile_size_bwd_sm90 = fa4._tile_size_bwd_sm90.__wrapped__
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.tokens} tokens, {HEADS} heads, "
          f"max_seq_len {args.max_seq_len}, window {args.window}; ms (median), relative errors against fp32")
    print("| Q/K | V/O | backward tile | forward ms | backward ms | out | dq | dk | dv |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    cases = [(128, 128, None), (64, 64, None), (64, 128, None)] + [(64, 128, tile) for tile in tiles]
    for qk_dim, v_dim, tile in cases:
        original = with_tile(fa4, tile)
        label = str(tile) if tile else "library's"
        try:
            fwd, bwd, errors = run_case(fa4, qk_dim, v_dim, args, device)
            print(f"| {qk_dim} | {v_dim} | {label} | {fwd:.3f} | {bwd:.3f} | "
                  + " | ".join(f"{e:.1e}" for e in errors) + " |")
        except Exception as e:  # noqa: BLE001 (a tile the kernel refuses, whatever it raises: say so, go on)
            print(f"| {qk_dim} | {v_dim} | {label} | failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} |")
            torch.cuda.synchronize()
        finally:
            fa4._tile_size_bwd_sm90 = original


if __name__ == "__main__":
    main()
