"""bench/profile_comm.py's pieces on the CPU: the touched-rows exchange of the bigram gradient against
a dense reduction over gloo ranks, the 8-rank scaling, and the NCCL trace breakdown."""
import json
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import ROOT, free_port

sys.path.insert(0, os.path.join(ROOT, "bench"))
import profile_comm as C  # noqa: E402

ROWS, DIM = 1001, 8


def rank_ids(rank: int, tokens: int = 300) -> torch.Tensor:
    """A rank's hashed ids: Zipf-like (hot rows repeated), different on every rank."""
    g = torch.Generator().manual_seed(100 + rank)
    hot = torch.randint(0, 5, (tokens // 2,), generator=g)
    cold = torch.randint(0, ROWS, (tokens - tokens // 2,), generator=g)
    return torch.cat([hot, cold])


def rank_grad(rank: int, ids: torch.Tensor, padded_rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    grad = torch.zeros((padded_rows, DIM))
    grad[ids] = torch.randn((ids.numel(), DIM), generator=g)
    return grad


def _worker(rank, world, port, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows_per_rank = -(-ROWS // world)
        ids = rank_ids(rank)
        local, touched = C.sparse_reduce_scatter(rank_grad(rank, ids, rows_per_rank * world), ids,
                                                 rows_per_rank, world, rank)
        torch.save((local, touched), f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 3])
def test_touched_rows_exchange_equals_dense_reduction(world, tmp_path):
    out_path = str(tmp_path / "shard")
    mp.spawn(_worker, args=(world, free_port(), out_path), nprocs=world, join=True)
    rows_per_rank = -(-ROWS // world)
    dense = sum(rank_grad(r, rank_ids(r), rows_per_rank * world) for r in range(world))
    for r in range(world):
        local, touched = torch.load(f"{out_path}.{r}")
        assert touched == rank_ids(r).unique().numel()
        torch.testing.assert_close(local, dense[r * rows_per_rank:(r + 1) * rows_per_rank], rtol=1e-6, atol=1e-6)


def test_owner_counts_split_sorted_ids_by_shard():
    ids = torch.tensor([0, 3, 4, 9, 10, 11])
    assert C.owner_counts(ids, 5, 3).tolist() == [3, 1, 2]


def test_eight_rank_model():
    assert C.scale_to(2) == pytest.approx(1.75)
    assert C.scale_to(8) == pytest.approx(1.0)
    assert C.scale_to(4) == pytest.approx((7 / 8) / (3 / 4))
    comm8, low, high = C.eight_rank_model(comm_ms=4.0, exposed_ms=1.0, world=2)
    assert (comm8, low, high) == pytest.approx((7.0, 1.0, 4.0))


def test_nccl_by_kind(tmp_path):
    events = [
        {"cat": "kernel", "name": "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(x)", "ts": 0, "dur": 3000},
        {"cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL(x)", "ts": 5000, "dur": 1000},
        {"cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", "ts": 7000, "dur": 500},
        {"cat": "kernel", "name": "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(x)", "ts": 9000, "dur": 1000},
        {"cat": "kernel", "name": "triton_per_fused_add_0", "ts": 0, "dur": 9000},
        {"cat": "cpu_op", "name": "nccl:all_reduce", "ts": 0, "dur": 9000},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert C.nccl_by_kind(str(path), steps=2) == pytest.approx({"ReduceScatter": 2.0, "AllGather": 0.5, "AllReduce": 0.25})
