"""bench/profile_stages.py: the kernel-name rules on realistic names (torch 2.11 inductor, cuBLAS,
FlashAttention, NCCL), the attribution of kernels to optimizer.step() through the profiler's
correlation ids, the side-by-side table, source resolution (paths, labels, git revisions), and one
real child run on the tiny configuration (CPU: timings and optimizer ranges, no kernels). On a GPU
the child profiles the tiny configuration and every main group must receive real kernels."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, tiny_env

SCRIPT = os.path.join(ROOT, "bench", "profile_stages.py")
SPEC = importlib.util.spec_from_file_location("profile_stages", SCRIPT)
P = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = P  # dataclasses look their module up in sys.modules
SPEC.loader.exec_module(P)

GEMM, ATTENTION, CE, RELU2, NORM = ("cuBLAS/cutlass GEMM", "attention (flash fwd+bwd)", "softcapped CE fwd+bwd",
                                    "ReLU² elementwise", "RMSNorm/residual fusions")
FP8, COPIES, EMBED, GATES, NCCL = ("FP8 quantize/transpose", "copies/memset", "embeddings (index, index_put)",
                                   "gates (sigmoid)", "NCCL communication")
KERNELS = [
    # cuBLAS / cuBLASLt / cutlass GEMMs (bf16, FP8 _scaled_mm, split-K), an inductor matmul template
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas", GEMM),
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x256x128_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas", GEMM),
    ("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_NTN", GEMM),
    ("cutlass3x_sm90_tensorop_gemm_bf16_bf16_f32_bf16_bf16_128x256x64_1x2x1_0_tnn_align8_warpspecialized_cooperative_epi_tma", GEMM),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>"
     "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8::Params)", GEMM),
    ("void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>"
     "(cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*, float const*)", GEMM),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", GEMM),
    ("triton_tem_fused_mm_0", GEMM),
    # attention: FA2 inside PyTorch (varlen), FA3 (cutlass-named), mem-efficient, cuDNN, flex, math SDPA
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t, "
     "Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, false, false>"
     "(pytorch_flash::Flash_fwd_params)", ATTENTION),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, "
     "false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t> >, false, true, false, "
     "false, false, true, false, false>(pytorch_flash::Flash_bwd_params)", ATTENTION),
    ("void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, false, false, "
     "cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t> > >(pytorch_flash::Flash_bwd_params)", ATTENTION),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90<2, "
     "cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, cute::tuple<cute::C<128>, cute::C<128>, cute::C<128> >, 128, "
     "cutlass::bfloat16_t, float, cutlass::arch::Sm90, true, false> > > >(flash::FlashAttnFwdSm90<>::Params)", ATTENTION),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
     "cutlass::arch::Sm80, true, 64, 128, 128, true, true>::Params)", ATTENTION),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", ATTENTION),
    ("triton_tem_fused_0", ATTENTION),
    ("triton_per_fused__safe_softmax_add_arange_bitwise_and_eq_ge_le_scalar_tensor_sub_unsqueeze_where_38", ATTENTION),
    # soft-capped cross-entropy: lse, target gather, backward (also fused with the e5m2 quantization)
    ("triton_red_fused__to_copy_add_div_logsumexp_mul_sigmoid_41", CE),
    ("triton_per_fused_gather_mul_sub_sum_unsqueeze_43", CE),
    ("triton_per_fused_gather_mean_select_sub_unsqueeze_44", CE),
    ("triton_poi_fused__to_copy_add_div_exp_expand_mul_sigmoid_sigmoid_backward_squeeze_sub_sum_unsqueeze_3", CE),
    ("triton_poi_fused__scaled_mm__to_copy_add_clamp_div_exp_expand_mul_sigmoid_sigmoid_backward_squeeze_sub_sum_unsqueeze_2", CE),
    ("triton_poi_fused_expand_mul_neg_new_zeros_scatter_add_1", CE),
    ("softcapped_cross_entropy_fwd_kernel", CE),
    # ReLU² around the cuBLAS MLP matmuls, and a fused MLP Triton GEMM
    ("triton_poi_fused_pow_relu_26", RELU2),
    ("triton_poi_fused_mul_pow_relu_scalar_tensor_threshold_backward_12", RELU2),
    ("_mlp_up_relu_square_kernel", "MLP Triton GEMM (+ReLU²)"),
    # RMSNorm (fused CUDA op decomposed by inductor, or plain mean/rsqrt) with residual updates
    ("triton_per_fused__fused_rms_norm__to_copy_add_mul_select_unsqueeze_1", NORM),
    ("triton_red_fused__fused_rms_norm_0", NORM),
    ("triton_per_fused__fused_rms_norm_backward__to_copy_mul_view_2", NORM),
    ("triton_per_fused__to_copy_add_mean_pow_rsqrt_split_view_12", NORM),
    ("triton_per_fused__to_copy_add_div_expand_mul_pow_sum_7", NORM),
    # FP8 lm_head: operand quantization, the column-major e4m3 weight of the backward
    ("triton_poi_fused__scaled_mm__to_copy_clamp_div_t_0", FP8),
    ("triton_poi_fused__to_copy_clamp_clone_div_t_5", FP8),
    # optimizer kernels recognisable by name (the rest is attributed by launch range)
    ("_aat_kernel", P.OPTIMIZER),
    ("_ata_kernel", P.OPTIMIZER),
    ("triton_poi_fused__to_copy_copy__lerp_mul_rsub_0", P.OPTIMIZER),
    # embeddings, gates
    ("triton_poi_fused_cat_index_select_slice_view_31", EMBED),
    ("triton_poi_fused__to_copy_add_index_put_mul_new_zeros_slice_slice_backward_transpose_unsqueeze_view_4", EMBED),
    ("void at::native::(anonymous namespace)::indexing_backward_kernel<c10::BFloat16, 4>(long const*, long const*, "
     "c10::BFloat16 const*, c10::BFloat16*, long, long, long, long, bool)", EMBED),
    ("triton_poi_fused__to_copy_clone_mul_sigmoid_transpose_unsqueeze_40", GATES),
    ("triton_per_fused__to_copy_mul_sigmoid_sigmoid_backward_squeeze_sum_transpose_view_9", GATES),
    # copies, casts, fills
    ("Memcpy HtoD (Pinned -> Device)", COPIES),
    ("Memset (Device)", COPIES),
    ("triton_poi_fused__to_copy_39", COPIES),
    ("triton_poi_fused_cat_select_unbind_view_90", COPIES),
    ("triton_poi_fused__to_copy__unsafe_view_clone_split_transpose_view_7", COPIES),
    ("triton_poi_fused_new_zeros_3", COPIES),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >"
     "(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)", COPIES),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda"
     "(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}>"
     "(at::TensorIteratorBase&, ...)::{lambda(int)#1}>(int, ...)", COPIES),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy_contig<at::native::(anonymous namespace)::OpaqueType<2u>, "
     "unsigned int, 2, 128, 1>(...)", COPIES),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", NCCL),
    # rotary, weight scaling, eager adds: unclassified
    ("triton_poi_fused__to_copy_cat_mul_slice_split_view_15", P.OTHER),
    ("triton_poi_fused_mul_select_slice_t_view_92", P.OTHER),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >"
     "(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)", P.OTHER),
]


@pytest.mark.parametrize("name,group", KERNELS, ids=[f"{g}:{n[:50]}" for n, g in KERNELS])
def test_kernel_names_fall_into_their_group(name, group):
    assert group in P.GROUP_ORDER
    assert P.classify(name) == group


def test_launches_inside_optimizer_step_go_to_the_optimizer_except_communication():
    assert P.classify(KERNELS[0][0], in_optimizer=True) == P.OPTIMIZER
    assert P.classify("triton_per_fused__fused_rms_norm_0", in_optimizer=True) == P.OPTIMIZER
    assert P.classify("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", in_optimizer=True) == NCCL


def _event(cat, name, ts, dur=1.0, pid=1, tid=10, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def test_trace_totals_attribute_kernels_by_launch_range_thread_and_correlation():
    gemm = "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT"
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}},
        _event("user_annotation", P.OPTIMIZER_RANGE, 100.0, 50.0),
        _event("cpu_op", "aten::mm", 19.0, 3.0),
        _event("cuda_runtime", "cudaLaunchKernel", 20.0, correlation=1),  # before the range: model
        _event("cuda_driver", "cuLaunchKernelEx", 120.0, correlation=2),  # inside the range
        _event("cuda_runtime", "cudaLaunchKernel", 130.0, tid=11, correlation=3),  # inside in time, other thread
        _event("cuda_runtime", "cudaMemsetAsync", 140.0, correlation=4),  # inside
        _event("cuda_runtime", "cudaLaunchKernel", 151.0, correlation=6),  # just after the range
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": 1, "tid": 10, "ts": 20.0},
        _event("kernel", gemm, 200.0, 5.0, pid=0, tid=7, correlation=1),
        _event("kernel", gemm, 210.0, 7.0, pid=0, tid=7, correlation=2),
        _event("kernel", "triton_poi_fused_pow_relu_3", 220.0, 2.0, pid=0, tid=7, correlation=3),
        _event("gpu_memset", "Memset (Device)", 230.0, 0.5, pid=0, tid=7, correlation=4),
        _event("kernel", "triton_poi_fused_pow_relu_3", 240.0, 3.0, pid=0, tid=7, correlation=6),
        _event("kernel", gemm, 250.0, 11.0, pid=0, tid=7, correlation=5),  # no launch event: unlinked
    ]
    totals, ranges, unlinked = P.kernel_totals(events)
    assert totals == {(gemm, "kernel", False): [16.0, 2], (gemm, "kernel", True): [7.0, 1],
                      ("triton_poi_fused_pow_relu_3", "kernel", False): [5.0, 2],
                      ("Memset (Device)", "memset", True): [0.5, 1]}
    assert ranges == 1 and unlinked == 1


def test_gpu_idle_splits_gaps_into_host_bound_and_optimizer_parts():
    """Overlapping activities (two streams) are one busy stretch; a gap counts as host-bound up to the
    next activity's launch; gaps before work launched inside optimizer.step() are the optimizer's."""
    events = [
        _event("user_annotation", P.OPTIMIZER_RANGE, 100.0, 50.0),
        _event("cuda_runtime", "cudaLaunchKernel", 10.0, correlation=1),
        _event("cuda_runtime", "cudaLaunchKernel", 15.0, correlation=4),
        _event("cuda_runtime", "cudaLaunchKernel", 120.0, correlation=2),  # inside the optimizer range
        _event("cuda_runtime", "cudaMemsetAsync", 226.0, correlation=3),  # 6 µs after the GPU ran dry
        _event("cuda_runtime", "cudaLaunchKernel", 260.0, correlation=6),  # later than the gap: all host
        _event("kernel", "A", 200.0, 5.0, pid=0, tid=7, correlation=1),
        _event("kernel", "B", 204.0, 8.0, pid=0, tid=8, correlation=4),  # other stream, overlaps A
        _event("kernel", "C", 215.0, 5.0, pid=0, tid=7, correlation=2),
        _event("gpu_memset", "D", 230.0, 1.0, pid=0, tid=7, correlation=3),
        _event("kernel", "E", 231.0, 9.0, pid=0, tid=7, correlation=5),  # back to back, no launch event
        _event("kernel", "F", 250.0, 1.0, pid=0, tid=7, correlation=6),
    ]
    idle = P.gpu_idle(events)
    assert idle["idle"] == 23.0 and idle["host"] == 16.0 and idle["optimizer"] == 3.0 and idle["gaps"] == 3
    assert idle["largest"] == [[10.0, "C", "D"], [10.0, "E", "F"], [3.0, "B", "C"]]


def test_host_time_ranks_cpu_ops_by_exclusive_time_per_thread():
    """Nested ops count their own time less their children's; each thread's top-level ops make the
    busy time; inductor's launches and the graph wrappers (hash in the name) fold into one entry;
    GPU events do not count."""
    graph = "## Call CompiledFxGraph fabc123 ##"
    events = [
        _event("cpu_op", "Torch-Compiled Region: 0/0", 0.0, 100.0),
        _event("cpu_op", graph, 1.0, 98.0),
        _event("cpu_op", "speedrun::fa4_varlen_attention", 10.0, 40.0),
        _event("cpu_op", "FlashAttnFwd", 12.0, 30.0),
        _event("cuda_driver", "cuLaunchKernelEx", 20.0, 5.0),
        _event("cpu_op", "triton_poi_fused_add_0", 60.0, 6.0),
        _event("cuda_driver", "cuLaunchKernel", 62.0, 2.0),
        _event("cpu_op", "triton_red_fused_sum_1", 70.0, 4.0),
        _event("cpu_op", "autograd::engine::evaluate_function: CompiledFunctionBackward", 200.0, 50.0, tid=11),
        _event("cpu_op", "## Call CompiledFxGraph fdef456 ##", 201.0, 45.0, tid=11),
        _event("kernel", "triton_poi_fused_add_0", 300.0, 500.0, pid=0, tid=7),
    ]
    host = P.host_time(events, top=10)
    assert host["busy"] == 150.0
    ranked = {name: (us, calls) for name, us, calls in host["self"]}
    # the wrappers: 98 - 40 - 6 - 4 = 48 in the forward's, 45 in the backward's
    assert ranked["compiled graph wrapper code"] == (93.0, 2)
    assert ranked["inductor Triton launches"] == (8.0, 2)  # 6 - 2 and 4
    assert ranked["CUDA launch API"] == (7.0, 2)
    assert ranked["speedrun::fa4_varlen_attention"] == (10.0, 1) and ranked["FlashAttnFwd"] == (25.0, 1)
    assert ranked["Torch-Compiled Region: 0/0"] == (2.0, 1)
    assert host["self"][0][0] == "compiled graph wrapper code" and "kernel" not in str(host["self"])


def _stage(stage, wall, kernels, loss=3.5, ranges=2, steps=2):
    return dict(stage=stage, step=10 * stage, tokens_per_step=16384, max_seq_len=896, adam_steps=steps // 2,
                wall_ms=wall, loss=loss, optimizer_ranges=ranges, unlinked_gpu_events=0, peak_memory_gib=1.5,
                kernels=[dict(name=n, kind=kind, optimizer=opt, ms=ms, calls=calls) for n, kind, opt, ms, calls in kernels])


def _result(label, stages, steps=2):
    return dict(label=label, source=f"{label}.py", steps=steps, device="NVIDIA H100 80GB HBM3", torch="2.11.0",
                rank_slice=True, stages=stages)


def _rows(table):
    return {line.split(" | ")[0].strip("| "): [c.strip() for c in line.strip("|").split("|")[1:]]
            for line in table.splitlines()[2:]}


def test_table_for_one_source():
    gemm, relu, memcpy = KERNELS[2][0], "triton_poi_fused_pow_relu_26", "Memcpy HtoD (Pinned -> Device)"
    result = _result("ours", [
        _stage(1, 12.34, [(gemm, "kernel", False, 4.0, 10), (KERNELS[3][0], "kernel", False, 2.06, 3),
                          (gemm, "kernel", True, 1.5, 12), (relu, "kernel", False, 0.7, 11),
                          (memcpy, "memcpy", False, 0.01, 2)]),
        _stage(2, 20.0, [(gemm, "kernel", False, 9.0, 10), (memcpy, "memcpy", False, 0.02, 2)]),
    ])
    table = P.format_table([result])
    lines = table.splitlines()
    assert lines[0] == "| kernel group (ms/step) | ours st1 | ours st2 |"
    assert lines[1] == "|---|---:|---:|"
    rows = _rows(table)
    assert list(rows) == [P.OPTIMIZER, GEMM, RELU2, COPIES, "all kernels", "wall", "launches/step"]
    assert rows[GEMM] == ["6.1", "9.0"] and rows[P.OPTIMIZER] == ["1.5", "—"] and rows[RELU2] == ["0.7", "—"]
    assert rows[COPIES] == ["0.0", "0.0"]
    assert rows["all kernels"] == ["8.3", "9.0"] and rows["wall"] == ["12.3", "20.0"]
    assert rows["launches/step"] == ["36", "10"]  # memcpys are not kernel launches
    assert "GPU idle between activities" not in rows  # profiles without the idle analysis
    result["stages"][1]["idle"] = dict(ms=1.25, host_ms=0.5, optimizer_ms=0.75, gaps=120.0, largest=[[40.0, "a", "b"]])
    rows = _rows(P.format_table([result]))
    assert rows["GPU idle between activities"] == ["—", "1.2"] and rows["of it, next one not yet launched"] == ["—", "0.5"]
    assert rows["of it, before optimizer work"] == ["—", "0.8"] and rows["gaps/step"] == ["—", "120"]
    assert "idle     40.0 µs after a before b" in P.describe([result])


def test_table_for_two_sources_interleaves_stages_and_skips_missing_ones():
    gemm, ce = KERNELS[2][0], "triton_red_fused__to_copy_add_div_logsumexp_mul_sigmoid_41"
    a = _result("ours", [_stage(1, 30.0, [(gemm, "kernel", False, 15.2, 100), (ce, "kernel", False, 3.3, 2)]),
                         _stage(3, 90.0, [(gemm, "kernel", False, 43.4, 100)])])
    b = _result("ref", [_stage(1, 29.0, [(gemm, "kernel", False, 11.1, 90), (ce, "kernel", False, 1.1, 1)]),
                        _stage(2, 60.0, [(gemm, "kernel", False, 21.1, 90)]),
                        _stage(3, 80.0, [(gemm, "kernel", False, 29.9, 90)])])
    table = P.format_table([a, b])
    assert table.splitlines()[0] == "| kernel group (ms/step) | ours st1 | ref st1 | ref st2 | ours st3 | ref st3 |"
    rows = _rows(table)
    assert rows[GEMM] == ["15.2", "11.1", "21.1", "43.4", "29.9"]
    assert rows[CE] == ["3.3", "1.1", "—", "—", "—"]
    assert rows["wall"] == ["30.0", "29.0", "60.0", "90.0", "80.0"]


def test_description_flags_missing_optimizer_ranges_unlinked_events_and_non_finite_losses():
    stage = _stage(1, 10.0, [], loss="nan", ranges=1)
    stage["unlinked_gpu_events"] = 3
    text = P.describe([_result("ours", [stage, _stage(2, 10.0, [])])])
    first, second = text.splitlines()[1:3]
    assert "1 optimizer ranges in the trace, expected 2" in first and "3 GPU events without a CPU launch" in first
    assert "non-finite loss nan" in first and "warning" not in second and "loss 3.500" in second
    stage["host"] = dict(busy_ms=61.5, top=[["speedrun::fa4_varlen_attention", 3.25, 10.0]])
    lines = P.describe([_result("ours", [stage])]).splitlines()
    assert "host (profiled): 61.5 ms/step in CPU ops" in lines[2]
    assert lines[3].split() == ["3.25", "ms/step", "10.0", "calls", "speedrun::fa4_varlen_attention"]


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                   check=True, capture_output=True)


def test_sources_resolve_paths_labels_and_git_revisions(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    for version in ("v1", "v2"):
        (repo / "train_gpt.py").write_text(f"VERSION = {version!r}\n")
        _git(repo, "add", "train_gpt.py")
        _git(repo, "commit", "-q", "-m", version)
    (repo / "train_gpt.py").write_text("VERSION = 'working'\n")
    record = tmp_path / "2026-01-01_Record"
    record.mkdir()
    (record / "train_gpt.py").write_text("VERSION = 'record'\n")
    (tmp_path / "candidate.py").write_text("VERSION = 'candidate'\n")
    out = tmp_path / "tmp"
    out.mkdir()
    specs = [str(repo / "train_gpt.py"), "HEAD", "base=HEAD~1", str(record / "train_gpt.py"),
             str(tmp_path / "candidate.py"), "HEAD", "mine=" + str(tmp_path / "candidate.py")]
    sources = P.resolve_sources(specs, str(repo), str(out))
    assert [s.label for s in sources] == ["working", "HEAD", "base", "2026-01-01_Record", "candidate", "HEAD#2", "mine"]
    assert [open(s.path).read().split("'")[1] for s in sources] == ["working", "v2", "v1", "record", "candidate", "v2", "candidate"]
    assert sources[1].description.startswith("git HEAD (") and sources[2].description.startswith("git HEAD~1 (")
    for bad in ("no_such_revision", str(tmp_path / "missing.py")):
        with pytest.raises(SystemExit, match="neither a file nor a git revision"):
            P.resolve_sources([bad], str(repo), str(out))


def test_child_runs_the_tiny_configuration_on_the_cpu_and_merge_reprints_its_table(tmp_path, corpus):
    # bf16 matmuls are slow on CPUs: one step per stage, 128 tokens, one value-embedding plane (the fewest)
    env = tiny_env(tmp_path, corpus, rank_slice=True, stage_batch_tokens=(1024,) * 5, value_embed_layers=(1,))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, SCRIPT, "--steps", "1", "--warmup-steps", "0", "--stages", "3,1",
                           "--out", str(out), "tiny=" + os.path.join(ROOT, "train_gpt.py")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout.rstrip("\n").splitlines()
    assert printed[-1].startswith("| launches/step |")
    result = json.loads((out / "tiny.json").read_text())
    assert result["label"] == "tiny" and result["device"] == "cpu" and result["rank_slice"] is True
    assert result["cuda_graphs"] is False  # graphs are planned on CUDA only
    # stages of 2 steps: the middle of stage 1 is step 1; that of stage 3 (step 5) is the untie step, so 4
    # and the optimizer's step count restarts there: Adam on odd counts
    assert [(s["stage"], s["step"], s["adam_steps"]) for s in result["stages"]] == [(1, 1, 1), (3, 4, 0)]
    for s in result["stages"]:
        assert s["tokens_per_step"] == 128 and s["optimizer_ranges"] == 1 and s["wall_ms"] > 0
        assert isinstance(s["loss"], float) and 0 < s["loss"] < 20
        assert s["kernels"] == [] and s["idle"] is None  # the CPU profile has no GPU kernels
    table = (out / "table.md").read_text().rstrip("\n")
    assert "\n".join(printed[-len(table.splitlines()):]) == table
    assert table.splitlines()[0] == "| kernel group (ms/step) | tiny st1 | tiny st3 |"
    assert _rows(table)["all kernels"] == ["—", "—"]
    assert (out / "kernels.csv").read_text().startswith("label,stage,group,kernel,")
    merged = subprocess.run([sys.executable, SCRIPT, "--merge", str(out / "tiny.json")], capture_output=True, text=True)
    assert merged.returncode == 0 and merged.stdout.rstrip("\n").endswith(table)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("label", ["working", "working eager"])  # the step's CUDA graphs replayed; eager steps
def test_child_profiles_real_kernels_into_every_main_group_on_the_gpu(tmp_path, corpus, label):
    env = tiny_env(tmp_path, corpus, rank_slice=True, device="cuda", compile=True)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, SCRIPT, "--steps", "2", "--warmup-steps", "2", "--stages", "1,3", "--verbose",
                           "--graphs", "planned" if label == "working" else "off", "--out", str(out)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "working.json").read_text())
    assert result["cuda_graphs"] is (label == "working")
    expected = [GEMM, ATTENTION, CE, RELU2, NORM, P.OPTIMIZER]
    if torch.cuda.get_device_capability() >= (8, 9):
        expected.append(FP8)
    for s in result["stages"]:
        groups = P.group_totals(s)
        missing = [g for g in expected if groups.get(g, [0.0])[0] <= 0]
        assert not missing, (s["stage"], missing, sorted(groups))
        assert s["optimizer_ranges"] == 2 and s["unlinked_gpu_events"] == 0
        all_ms = sum(k["ms"] for k in s["kernels"])
        assert 0 < all_ms < 2 * s["wall_ms"]  # GPU time fits in the wall time (units right)
        assert sum(k["calls"] for k in s["kernels"] if k["kind"] == "kernel") > 100
        assert isinstance(s["loss"], float)
        idle = s["idle"]  # the tiny model's steps are launch-bound: the GPU waits, mostly for the host
        assert 0 < idle["host_ms"] <= idle["ms"] < s["wall_ms"] and idle["optimizer_ms"] <= idle["ms"] and idle["gaps"] > 10
