"""bench/profile_comm.py's pieces on the CPU: the 8-rank scaling and the NCCL trace breakdown."""
import json
import os
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import profile_comm as C  # noqa: E402


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
        {"cat": "kernel", "name": "ncclDevKernel_SendRecv(x)", "ts": 11000, "dur": 2000},
        {"cat": "kernel", "name": "triton_per_fused_add_0", "ts": 0, "dur": 9000},
        {"cat": "cpu_op", "name": "nccl:all_reduce", "ts": 0, "dur": 9000},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    expected = {"ReduceScatter": 2.0, "AllGather": 0.5, "AllReduce": 0.25, "SendRecv": 1.0}  # SendRecv: all_to_all
    assert C.nccl_by_kind(str(path), steps=2) == pytest.approx(expected)
