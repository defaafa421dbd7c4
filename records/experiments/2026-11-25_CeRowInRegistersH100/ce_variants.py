"""Cross-entropy kernel variants at T=49152, V=50304 (2026-11-25, H100; the experiment behind the
row-in-registers kernel). Prints ms (median), registers/spills and errors against the float64 reference on a
row slice. The main() loop was edited between runs (ce_variants_1.txt: configs of the earlier kernel, a
two-sweep copy with/without the second sweep and with software exp2, row-in-registers variants;
ce_variants_2.txt: two-sweep cache hints; this version, prefetch variants, failed to compile its inline asm)."""
import sys, os, itertools
import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, os.getcwd())
import train_gpt as T

V = 50304
LOG2E = 1.4426950408889634
P0, P1, P2, P3 = 0.9999281093641536, 0.6932609856052576, 0.24261054228172133, 0.05517132143403311


@triton.jit
def _tanh(x):
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _exp2_fma(x):
    # 2^x (x <= 0) without the MUFU unit: n = round(x) by the 1.5*2^23 trick, 2^f (|f| <= 1/2) by a cubic
    x = tl.maximum(x, -125.0)
    r = x + 12582912.0
    f = x - (r - 12582912.0)
    p = 0.9999281093641536 + f * (0.6932609856052576 + f * (0.24261054228172133 + f * 0.05517132143403311))
    return (p.to(tl.int32, bitcast=True) + (r.to(tl.int32, bitcast=True) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _t_of(u_row, offs, V, MASKED: tl.constexpr, EV: tl.constexpr = ""):
    if MASKED:
        u = tl.load(u_row + offs, mask=offs < V, other=0.0, eviction_policy=EV).to(tl.float32)
    else:
        u = tl.load(u_row + offs, eviction_policy=EV).to(tl.float32)
    return _tanh((u + 5.0) * (0.5 / 7.5))


@triton.jit
def _store_g(g_row, offs, V, t, scale, bias, MASKED: tl.constexpr, POLY: tl.constexpr, SEV: tl.constexpr = "",
             SCM: tl.constexpr = ""):
    HALF: tl.constexpr = 11.5
    x = t * (HALF * 1.4426950408889634) + bias
    if POLY:
        ex = _exp2_fma(x)
    else:
        ex = tl.exp2(x)
    g = scale * (1 - t * t) * ex
    g = tl.minimum(tl.maximum(g, -57344.0), 57344.0)
    if MASKED:
        tl.store(g_row + offs, g.to(g_row.dtype.element_ty), mask=offs < V, eviction_policy=SEV, cache_modifier=SCM)
    else:
        tl.store(g_row + offs, g.to(g_row.dtype.element_ty), eviction_policy=SEV, cache_modifier=SCM)


@triton.jit
def _targets_tail(row, lse, u_row, g_row, targets_ptr, weights_ptr, loss_ptr, ce0_ptr, stride_targets, coef,
                  N_TARGETS: tl.constexpr, N_PAD: tl.constexpr, WRITE: tl.constexpr):
    HALF: tl.constexpr = 11.5
    k = tl.arange(0, N_PAD)
    weights = tl.load(weights_ptr + k, mask=k < N_TARGETS, other=0.0).to(tl.float32)
    ys = tl.load(targets_ptr + row * stride_targets + k, mask=k < N_TARGETS, other=-1).to(tl.int32)
    valid = ys >= 0
    u_y = tl.load(u_row + tl.maximum(ys, 0)).to(tl.float32)
    ce = lse - 23.0 * tl.sigmoid((u_y + 5.0) / 7.5)
    w_valid = tl.where(valid, weights, 0.0)
    tl.store(loss_ptr + row, tl.sum(w_valid * ce, axis=0))
    tl.store(ce0_ptr + row, tl.sum(tl.where((k == 0) & valid, ce, 0.0), axis=0))
    weight_sum = tl.sum(w_valid, axis=0)
    bias = (HALF - lse) * 1.4426950408889634
    if WRITE:
        tl.debug_barrier()
        t_y = _tanh((u_y + 5.0) * (0.5 / 7.5))
        same_target = tl.sum(tl.where(ys[:, None] == ys[None, :], w_valid[None, :], 0.0), axis=1)
        g_y = coef * (1 - t_y * t_y) * (weight_sum * tl.exp2(t_y * (HALF * 1.4426950408889634) + bias) - same_target)
        g_y = tl.minimum(tl.maximum(g_y, -57344.0), 57344.0)
        tl.store(g_row + ys, g_y.to(g_row.dtype.element_ty), mask=valid)
    return weight_sum, bias


@triton.jit
def _two_sweep(logits_ptr, targets_ptr, weights_ptr, loss_ptr, ce0_ptr, grad_ptr, n_rows, V, stride_logits,
               stride_targets, stride_grad, grad_mul, N_TARGETS: tl.constexpr, N_PAD: tl.constexpr,
               BLOCK_V: tl.constexpr, POLY: tl.constexpr, SWEEP2: tl.constexpr, EV1: tl.constexpr = "",
               EV2: tl.constexpr = "", SEV: tl.constexpr = "", SCM: tl.constexpr = ""):
    HALF: tl.constexpr = 11.5
    cols = tl.arange(0, BLOCK_V)
    full_chunks = V // BLOCK_V
    tail = full_chunks * BLOCK_V + cols
    coef = grad_mul * (23.0 / 30.0)
    first_row, programs = tl.program_id(0).to(tl.int64), tl.num_programs(0)
    for i in range(0, tl.cdiv(n_rows - first_row, programs)):
        row = first_row + i * programs
        u_row = logits_ptr + row * stride_logits
        g_row = grad_ptr + row * stride_grad
        acc = tl.where(tail < V, tl.exp2((_t_of(u_row, tail, V, True, EV1) - 1) * (HALF * 1.4426950408889634)), 0.0)
        for c in range(full_chunks):
            acc += tl.exp2((_t_of(u_row, c * BLOCK_V + cols, V, False, EV1) - 1) * (HALF * 1.4426950408889634))
        lse = 23.0 + tl.log(tl.sum(acc, axis=0))
        weight_sum, bias = _targets_tail(row, lse, u_row, g_row, targets_ptr, weights_ptr, loss_ptr, ce0_ptr,
                                         stride_targets, coef, N_TARGETS, N_PAD, False)
        if SWEEP2:
            for c in range(full_chunks):
                offs = (full_chunks - 1 - c) * BLOCK_V + cols
                _store_g(g_row, offs, V, _t_of(u_row, offs, V, False, EV2), coef * weight_sum, bias, False, POLY, SEV, SCM)
            _store_g(g_row, tail, V, _t_of(u_row, tail, V, True, EV2), coef * weight_sum, bias, True, POLY, SEV, SCM)
            _targets_tail(row, lse, u_row, g_row, targets_ptr, weights_ptr, loss_ptr, ce0_ptr,
                          stride_targets, coef, N_TARGETS, N_PAD, True)


@triton.jit
def _prefetch_l2(ptrs):
    return tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _part_sum(u, offs, V, MASKED: tl.constexpr):
    t = _tanh((u.to(tl.float32) + 5.0) * (0.5 / 7.5))
    e = tl.exp2((t - 1) * (11.5 * 1.4426950408889634))
    if MASKED:
        e = tl.where(offs < V, e, 0.0)
    return t, tl.sum(e, axis=0)


@triton.jit
def _part_store(kept, g_row, offs, V, scale, bias, MASKED: tl.constexpr, KEEP_T: tl.constexpr, POLY: tl.constexpr,
                SEV: tl.constexpr = ""):
    if KEEP_T:
        t = kept.to(tl.float32)
    else:
        t = _tanh((kept.to(tl.float32) + 5.0) * (0.5 / 7.5))
    _store_g(g_row, offs, V, t, scale, bias, MASKED, POLY, SEV)


@triton.jit
def _row_in_registers(logits_ptr, targets_ptr, weights_ptr, loss_ptr, ce0_ptr, grad_ptr, n_rows, V, stride_logits,
                      stride_targets, stride_grad, grad_mul, N_TARGETS: tl.constexpr, N_PAD: tl.constexpr,
                      A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, KEEP_T: tl.constexpr, POLY: tl.constexpr,
                      PF: tl.constexpr = 0, SEV: tl.constexpr = ""):
    coef = grad_mul * (23.0 / 30.0)
    oa = tl.arange(0, A)
    ob = A + tl.arange(0, B)
    oc = A + B + tl.arange(0, C)
    first_row, programs = tl.program_id(0).to(tl.int64), tl.num_programs(0)
    for i in range(0, tl.cdiv(n_rows - first_row, programs)):
        row = first_row + i * programs
        u_row = logits_ptr + row * stride_logits
        g_row = grad_ptr + row * stride_grad
        ua = tl.load(u_row + oa)
        ub = tl.load(u_row + ob)
        uc = tl.load(u_row + oc, mask=oc < V, other=0.0)
        if PF > 0:
            nxt = tl.minimum(row + programs, n_rows - 1)
            lines = tl.arange(0, PF) * 64
            _prefetch_l2(logits_ptr + nxt * stride_logits + tl.minimum(lines, V - 1))
        ta, sa = _part_sum(ua, oa, V, False)
        tb, sb = _part_sum(ub, ob, V, False)
        tc, sc = _part_sum(uc, oc, V, True)
        if KEEP_T:
            ka, kb, kc = ta.to(tl.float16), tb.to(tl.float16), tc.to(tl.float16)
        else:
            ka, kb, kc = ua, ub, uc
        lse = 23.0 + tl.log(sa + sb + sc)
        weight_sum, bias = _targets_tail(row, lse, u_row, g_row, targets_ptr, weights_ptr, loss_ptr, ce0_ptr,
                                         stride_targets, coef, N_TARGETS, N_PAD, False)
        _part_store(kc, g_row, oc, V, coef * weight_sum, bias, True, KEEP_T, POLY, SEV)
        _part_store(kb, g_row, ob, V, coef * weight_sum, bias, False, KEEP_T, POLY, SEV)
        _part_store(ka, g_row, oa, V, coef * weight_sum, bias, False, KEEP_T, POLY, SEV)
        _targets_tail(row, lse, u_row, g_row, targets_ptr, weights_ptr, loss_ptr, ce0_ptr,
                      stride_targets, coef, N_TARGETS, N_PAD, True)


def run_variant(kind, logits, targets, weights, grad_mul, per_sm, warps, **flags):
    Tn = logits.size(0)
    loss = torch.empty(Tn, device="cuda")
    ce0 = torch.empty(Tn, device="cuda")
    grad = torch.empty((Tn, V), dtype=torch.float8_e5m2, device="cuda")
    grid = (per_sm * T._sm_count(logits.device),)
    N = targets.size(1)
    common = (logits, targets, weights, loss, ce0, grad, Tn, V, logits.stride(0), targets.stride(0), grad.stride(0),
              float(grad_mul))
    if kind == "two":
        k = _two_sweep[grid](*common, N_TARGETS=N, N_PAD=max(2, triton.next_power_of_2(N)),
                             num_warps=warps, **flags)
    else:
        k = _row_in_registers[grid](*common, N_TARGETS=N, N_PAD=max(2, triton.next_power_of_2(N)), A=32768, B=16384,
                                    C=2048, num_warps=warps, **flags)
    return (loss, ce0, grad), k


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    torch.manual_seed(0)
    tokens = int(os.environ.get("TOKENS", 49152))
    N = {16384: 3, 32768: 2, 49152: 1}[tokens]
    logits = (torch.randn(tokens, V, device="cuda") * 3).bfloat16()
    ids = torch.randint(0, 50257, (tokens,), device="cuda")
    ahead = torch.arange(tokens, device="cuda")[:, None] + torch.arange(N, device="cuda")
    targets = torch.where(ahead < tokens, ids[ahead.clamp_max(tokens - 1)], -1)
    weights = torch.tensor([1.0, 0.5, 0.125][:N], device="cuda")
    grad_mul = 1 / T.FP8_GRAD_SCALE
    check = slice(0, 1024)
    ref = T.softcap_ce_reference(logits[check].double(), targets[check], weights, grad_mul, torch.float64)
    ref_grad = ref[2].clamp(-57344, 57344)
    rows = []

    def record(name, fn, kernel=None, full=True):
        out = fn()
        torch.cuda.synchronize()
        errs = [rel(out[0][check], ref[0]), rel(out[1][check], ref[1])]
        errs.append(rel(out[2][check].float(), ref_grad) if full else float("nan"))
        ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
        regs = (kernel.n_regs, kernel.n_spills) if kernel is not None else ("-", "-")
        rows.append((name, ms, *regs, *errs))
        print(f"{name:>44} {ms:7.3f} ms regs {regs[0]} spills {regs[1]} err {errs[0]:.1e} {errs[1]:.1e} {errs[2]:.1e}",
              flush=True)

    record("production (row in registers)", lambda: T.softcap_ce(logits, targets, weights, grad_mul, torch.float8_e5m2))
    flags0 = dict(POLY=False, SWEEP2=True, BLOCK_V=8192)
    _, k = run_variant("two", logits, targets, weights, grad_mul, 2, 16, **flags0)
    record("previous two-sweep 2/SM 16w", lambda: run_variant("two", logits, targets, weights, grad_mul, 2, 16, **flags0)[0], k)
    for h in (dict(), dict(PF=1024), dict(SEV="evict_first"), dict(PF=1024, SEV="evict_first"), dict(PF=512)):
        for per_sm, warps in ((1, 16), (1, 32)):
            flags = dict(KEEP_T=False, POLY=False, **h)
            _, k = run_variant("rows", logits, targets, weights, grad_mul, per_sm, warps, **flags)
            record(f"rows {h} {per_sm}/SM {warps}w",
                   lambda: run_variant("rows", logits, targets, weights, grad_mul, per_sm, warps, **flags)[0], k)
    floor = tokens * V * 3 / 3.0e9
    print(f"bytes floor at 3.0 TB/s: {floor:.3f} ms")


if __name__ == "__main__":
    main()
