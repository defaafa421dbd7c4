"""QK-norm + rotary + key offset in Triton kernels (docs/TECHNIQUES.md T6.4): the kernels through Triton's
CPU interpreter against the torch reference in float64, output and gradients (fp32 storage to rounding,
bf16 to bf16 precision; full-width and narrow Q/K heads, T3.18, with V full width), and the tiny model (all
layers wide, and with narrow layers) with them against its torch path;
compiled ahead of time for sm_90 (the backward at the launches the bench times); on a GPU (gpu-marked) at
the model's shapes, eager and traced by torch.compile, and the compiled model with them. The execution
plan's switch: tests/model/test_execution_plan.py."""

import textwrap

import pytest
import torch
from helpers import outputs_and_grads, rel_err, rope_tables, run_in_triton_interpreter

import train_gpt as T

cuda = pytest.mark.skipif(not torch.cuda.is_available() or T.triton is None, reason="needs a CUDA GPU and Triton")

# Every combination of the layers' switches (paired heads, key offset, extra value input), 2 and 6
# heads, ragged row counts (37 tokens: the last program's rows part empty), against the reference
# in float64 on the same rounded inputs. Then the tiny model (2 heads; paired, key-offset and value-input
# layers), all layers wide and with record #92's narrow layers, with the kernels against its torch path:
# the call site's tables and switches.
QK_ROPE_INTERPRETER_CHECK = textwrap.dedent("""
    import dataclasses, torch, train_gpt as T
    from helpers import cpu_execution, outputs_and_grads, random_batch, rel_err, rope_tables

    # (tokens, heads, head_dim, Q/K head width, paired, key offset, value input, V head width); Q/K head_dim/2
    # wide: narrow layers (T3.18), every dimension turning (no key offset there), v head_dim wide
    cases = [(37, 2, 64, 64, True, True, True, 64), (64, 6, 64, 64, False, True, False, 64),
             (37, 6, 64, 64, True, False, True, 64), (64, 2, 64, 64, False, False, False, 64),
             (37, 6, 32, 32, False, True, True, 32), (37, 6, 64, 32, True, False, True, 64),
             (37, 2, 64, 32, False, False, False, 64), (37, 2, 64, 32, True, False, False, 64),
             (64, 6, 64, 32, False, False, True, 64)]
    for (tokens, H, hd, qk_hd, paired, key_offset, value_input, vd) in cases:
        torch.manual_seed(tokens * H)
        cos, sin = rope_tables(tokens, hd, paired)
        scale = torch.tensor(0.12)
        S, heads = (2 * tokens, H // 2) if paired else (tokens, H)
        grads = [torch.randn(S, heads, width) for width in (qk_hd, qk_hd, vd)]
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            qkv = (torch.randn(tokens, H * (2 * qk_hd + vd)) * 0.5).to(dtype)
            v_extra = torch.randn(tokens, H, vd).to(dtype) if value_input else None
            args = cos, sin, scale, H, qk_hd, paired, key_offset
            want = outputs_and_grads(lambda a, b: T.qk_norm_rope_reference(a, b, *args),
                                     (qkv.double(), None if v_extra is None else v_extra.double()), grads)
            got = outputs_and_grads(lambda a, b: T.qk_norm_rope(a, b, *args, True), (qkv, v_extra), grads)
            errors = [rel_err(a, b) for a, b in zip(got, want)]
            print(tokens, H, hd, qk_hd, paired, key_offset, value_input, vd, dtype, ["%.1e" % e for e in errors])
            assert all(a.dtype == dtype and a.shape == b.shape for a, b in zip(got, want))
            assert max(errors) < tolerance, errors
            if dtype == torch.float32:  # v + v_extra exactly as torch adds (the interpreter truncates to bf16)
                assert torch.equal(got[2], T.qk_norm_rope_reference(qkv, v_extra, *args)[2])

    # one program per part in the model (the interpreter's time goes by programs; the cases above take the
    # kernels' own launches); all layers wide, then record #92's narrow layers (T3.18)
    T.QK_ROPE_FORWARD_LAUNCH = T.QK_ROPE_BACKWARD_LAUNCH = {"BLOCK": 512, "num_warps": 4}
    for narrow in ((), T.ModelConfig.narrow_qk_layers):
        hp = T.Hyperparameters.of(model_dim=128, num_heads=2, head_dim=64, mlp_hidden=256, vocab_size=1024,
                                  copy_pointer=False, ngram_rows=1001, narrow_qk_layers=narrow)
        torch.manual_seed(0)
        model = T.GPT(hp.model, 256).float()  # in fp32 the two paths agree to rounding (bf16: the cases above)
        with torch.no_grad():  # live MUDD value mix (the extra value input of layer 10)
            model.mudd.w2.normal_(0, 0.05)
        inputs, targets, cu = random_batch(vocab=1024)
        shape = T.ForwardShape(short_window=32, long_window=96, max_seq_len=256)
        plan = cpu_execution(hp)
        results = []
        for kernel in (False, True):
            model.zero_grad(set_to_none=True)
            kernel_plan = dataclasses.replace(plan, qk_rope_kernel=kernel)
            loss, _ = model.training_loss(inputs, targets, cu, shape, kernel_plan, torch.tensor([1.0]))
            loss.backward()
            banks = [bank.grad for bank, _ in model.qk_banks()] + [model.vo_bank.grad]
            results.append((loss, *banks, model.value_embeds.grad))
        errors = [rel_err(a, b) for a, b in zip(*results)]
        print("model", narrow, ["%.1e" % e for e in errors])
        assert len(errors) == 4 + bool(narrow)
        assert max(errors) < 1e-5, errors
""")


@pytest.mark.skipif(T.triton is None, reason="Triton not installed")
def test_qk_rope_kernels_match_the_reference_in_the_triton_interpreter():
    run_in_triton_interpreter(QK_ROPE_INTERPRETER_CHECK, timeout=300)


# The backward's launches that records/experiments/2026-11-27_QkRopeBackward/queue.sh times besides its own
TIMED_BACKWARD_LAUNCHES = ({"BLOCK": 16, "num_warps": 4}, {"BLOCK": 32, "num_warps": 8}, {"BLOCK": 64, "num_warps": 8})


@pytest.mark.skipif(T.triton is None or T.TRITON_INTERPRETER, reason="needs Triton's compiler")
@pytest.mark.parametrize("paired, key_offset, value_input", [(False, True, True), (True, False, False)])
def test_qk_rope_kernels_compile_for_hopper(paired, key_offset, value_input):
    """Both kernels, compiled ahead of time for sm_90 (no GPU needed) at the model's shapes with their
    launches' options and aligned pointers, as the launcher passes them (no extra value input: None); with
    the key offset (the backward's every branch) the backward at the launches the bench times too. Neither
    uses shared memory (no layout moves through it)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bf16 = "*bf16"
    constants = {"H": 6, "HD": 128, "VD": 128, "PAIRS": 32, "SEQ_HEADS": 3 if paired else 6, "KEY_OFFSET": key_offset,
                 "EPS": torch.finfo(torch.float32).eps}
    tables = {"cos_ptr": bf16, "sin_ptr": bf16, "scale_ptr": "*fp32"}
    forward = {"qkv_ptr": bf16, "v_extra_ptr": bf16 if value_input else None, **tables, "q_ptr": bf16, "k_ptr": bf16,
               "v_ptr": bf16}
    backward = {"qkv_ptr": bf16, "grad_q_ptr": bf16, "grad_k_ptr": bf16, "grad_v_ptr": bf16, **tables,
                "grad_qkv_ptr": bf16}
    backward_launches = (T.QK_ROPE_BACKWARD_LAUNCH, *(TIMED_BACKWARD_LAUNCHES if key_offset else ()))
    kernels = [(T._qk_norm_rope_forward_kernel, forward, T.QK_ROPE_FORWARD_LAUNCH),
               *((T._qk_norm_rope_backward_kernel, backward, launch) for launch in backward_launches)]
    for kernel, pointers, launch in kernels:
        index = kernel.arg_names.index
        fixed = {**constants, "BLOCK": launch["BLOCK"],
                 **{name: None for name, kind in pointers.items() if kind is None}}
        pointers = {name: kind for name, kind in pointers.items() if kind is not None}
        source = ASTSource(kernel, signature={**pointers, "n_rows": "i32", **dict.fromkeys(fixed, "constexpr")},
                           constexprs={(index(name),): value for name, value in fixed.items()},
                           attrs={(index(name),): [["tt.divisibility", 16]] for name in pointers})
        compiled = T.triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": launch["num_warps"]})
        # no shared memory: the rotation tables load in the layout the rotation's pairs take (_rope_tables)
        assert compiled.metadata.shared == 0, (kernel.__name__, launch, compiled.metadata.shared)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("paired, key_offset, value_input",
                         [(False, False, False), (True, False, True), (False, True, True), (True, True, False)])
def test_qk_rope_kernels_on_gpu(paired, key_offset, value_input):
    """At the model's shapes (49,152 + 17 tokens, 6 heads of 128), eager and compiled (fullgraph: dynamo
    traces the launches): output and gradients against the float64 reference to bf16 precision, v + v_extra
    bit for bit as torch adds, and the compiled kernels bit for bit as the eager ones."""
    tokens, H, hd = 49152 + 17, 6, 128
    torch.manual_seed(0)
    S, heads = (2 * tokens, H // 2) if paired else (tokens, H)
    args = (*rope_tables(tokens, hd, paired, "cuda"), torch.tensor(0.12, device="cuda"), H, hd, paired, key_offset)
    qkv = (torch.randn(tokens, 3 * H * hd, device="cuda") * 0.5).bfloat16()
    v_extra = torch.randn(tokens, H, hd, device="cuda").bfloat16() if value_input else None
    grads = [torch.randn(S, heads, hd, device="cuda").bfloat16() for _ in range(3)]

    def kernel(qkv, v_extra):
        return T.qk_norm_rope(qkv, v_extra, *args, kernels=True)

    eager = outputs_and_grads(kernel, (qkv, v_extra), grads)
    torch._dynamo.reset()
    compiled = outputs_and_grads(torch.compile(kernel, dynamic=False, fullgraph=True), (qkv, v_extra), grads)
    want = outputs_and_grads(lambda a, b: T.qk_norm_rope_reference(a, b, *args),
                             (qkv.double(), None if v_extra is None else v_extra.double()), grads)
    for got, traced, reference in zip(eager, compiled, want):
        assert got.dtype == torch.bfloat16 and rel_err(got, reference) < 1e-2
        torch.testing.assert_close(traced, got, rtol=0, atol=0)
    assert torch.equal(eager[2], T.qk_norm_rope_reference(qkv, v_extra, *args)[2])


def training_step(training_loss, batch) -> torch.Tensor:
    loss, _ = training_loss(*batch, torch.tensor([1.0, 0.5], device="cuda"))
    loss.backward()
    return loss.detach()


@cuda
@pytest.mark.gpu
def test_compiled_model_with_the_qk_rope_kernels_matches_the_torch_path_on_gpu():
    """The whole model compiled (fullgraph, as in training; 6 heads: paired layers of 3) with QK_ROPE_KERNEL
    0 and 1: inductor launches the kernels it is given (both, or neither), and the loss and gradients agree
    with the torch path's to bf16 precision."""
    from torch._inductor.utils import run_and_get_code
    tokens = 1024
    torch.manual_seed(0)
    ids = torch.randint(0, 50000, (tokens + 1,))
    ids[[0, 300, 301, 700]] = T.BOS_ID
    cu = torch.from_numpy(T.cu_seqlens_for([300, 1, 399, tokens + 1 - 700], tokens, 16)).cuda()
    inputs, targets = ids[:-1].int().cuda(), ids[1:].int().cuda()
    shape = T.ForwardShape(short_window=128, long_window=384, max_seq_len=512, n_predict=2)
    results = []
    for setting in (False, True):
        hp = T.Hyperparameters.of(model_dim=384, num_heads=6, head_dim=64, mlp_hidden=1024, ngram_rows=1001,
                                  val_seq_len=1024, qk_rope_kernel=setting)
        torch.manual_seed(0)
        model = T.GPT(hp.model, T.longest_forward(hp)).cuda()
        with torch.no_grad():  # live MUDD value mix (the extra value input of layer 10)
            model.mudd.w2.normal_(0, 0.05)
        plan = T.resolve_execution(hp.execution, hp.model, torch.device("cuda"), tokens, training=True)
        assert plan.qk_rope_kernel == setting
        torch._dynamo.reset()
        compiled = torch.compile(model.training_loss, dynamic=False, fullgraph=True)
        loss, codes = run_and_get_code(training_step, compiled, (inputs, targets, cu, shape, plan))
        code = "\n".join(codes)
        launched = ["_qk_norm_rope_forward_kernel" in code, "_qk_norm_rope_backward_kernel" in code]
        assert launched == [setting, setting], (setting, launched)
        results.append((loss, model.qk_bank.grad, model.vo_bank.grad, model.value_embeds.grad))
    (ref_loss, *ref_grads), (loss, *grads) = results
    assert rel_err(loss, ref_loss) < 1e-2
    assert all(rel_err(got, want) < 3e-2 for got, want in zip(grads, ref_grads))  # bf16 through 11 layers
