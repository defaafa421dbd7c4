"""The token tables' gradients by row (docs/TECHNIQUES.md T6.6): token_order on the CPU; the Triton kernel through
Triton's CPU interpreter against the float64 sums (fp32 storage to rounding, bf16 to bf16 precision; a frequent id
over several chunks and row blocks, ids no token has, tables and widths off the launch's blocks), poisoned outputs,
TokenRows against autograd's table[ids] and traced whole by torch.compile; compiled ahead of time for sm_90; on a
GPU (gpu-marked) at the model's shapes with a Zipf-like id mix, eager, compiled and run twice. The plan's field:
tests/model/test_execution_plan.py."""

import textwrap

import pytest
import torch
from helpers import rel_err, run_in_triton_interpreter

import train_gpt as T

cuda = pytest.mark.skipif(not torch.cuda.is_available() or T.triton is None, reason="needs a CUDA GPU and Triton")


def test_token_order_sorts_the_positions_by_id_and_marks_where_each_id_starts():
    torch.manual_seed(0)
    ids = torch.randint(0, 40, (300,))
    ids[::4] = 7
    order, ordered, starts = T.token_order(ids, 50)
    assert order.dtype == ordered.dtype == starts.dtype == torch.int32
    assert sorted(order.tolist()) == list(range(300)) and torch.equal(ordered, ids[order.long()].int())
    assert torch.all(ordered[1:] >= ordered[:-1])
    assert starts.tolist() == [int((ids < r).sum()) for r in range(51)]


def id_mix(tokens: int, rows: int, generator: torch.Generator) -> torch.Tensor:
    """Ids like text's: a Zipf-like draw (the first ids each several per cent of the tokens), shuffled over the rows."""
    weights = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64)
    draw = torch.multinomial(weights, tokens, replacement=True, generator=generator)
    return torch.randperm(rows, generator=generator)[draw]


TOKEN_ROWS_INTERPRETER_CHECK = textwrap.dedent("""
    import torch, train_gpt as T
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from helpers import rel_err

    def sums(grad, ids, rows):
        return torch.zeros(rows, grad.size(1), dtype=torch.float64).index_add_(0, ids, grad.double())

    # (rows, width, tokens): 150 of 500 tokens on id 5 (three chunks of 64, over a block boundary); ids 40-69
    # absent; rows off the 16-row blocks; widths below, on and off the 256-column block; a single token
    torch.manual_seed(0)
    for rows, width, tokens in [(70, 80, 500), (41, 300, 200), (16, 16, 1)]:
        ids = torch.randint(0, min(rows, 40), (tokens,))
        ids[::10] = 5
        ids[: tokens // 5] = 5
        order = T.token_order(ids, rows)
        for dtype, tolerance in [(torch.float32, 1e-6), (torch.bfloat16, 5e-3)]:
            grad = torch.randn(tokens, width).to(dtype)
            got = T.token_rows_backward(grad, *order, dtype)
            want = sums(grad, ids, rows)
            print(rows, width, tokens, dtype, "%.1e" % rel_err(got, want))
            assert got.dtype == dtype and rel_err(got, want) < tolerance
            assert torch.all(got[want.abs().sum(1) == 0] == 0) and not got.isnan().any()

    # every element written: the launch on an output poisoned with NaN
    ids = torch.randint(0, 30, (400,))
    grad = torch.randn(400, 96)
    launch = dict(T.TOKEN_ROWS_LAUNCH, BLOCK_D=64)
    out = torch.full((37, 96), float("nan"))
    T._token_rows_backward_kernel[(T.triton.cdiv(37, launch["ROWS"]), 2)](
        grad, *T.token_order(ids, 37), out, 37, 96, UPCAST=True, **launch)
    assert rel_err(out, sums(grad, ids, 37)) < 1e-6 and not out.isnan().any()

    # TokenRows against autograd's table[ids]: the same rows, the same gradient; then fullgraph under aot_eager:
    # the custom op in the backward graph, the eager numbers exactly
    table = torch.randn(60, 48, requires_grad=True)
    ids = torch.randint(0, 50, (333,))
    ids[::3] = 2
    upstream = torch.randn(333, 48)

    def rows_and_grad(fn):
        out = fn(table, ids)
        return out, torch.autograd.grad(out, table, upstream)[0]

    kernel = lambda table, ids: T.token_rows(table, ids, T.token_order(ids, table.size(0))) * 2
    plain = rows_and_grad(lambda table, ids: T.token_rows(table, ids, None) * 2)
    eager = rows_and_grad(kernel)
    assert torch.equal(eager[0], plain[0]) and rel_err(eager[1], plain[1]) < 1e-6
    graphs = []
    def record(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)
    compiled = rows_and_grad(torch.compile(kernel, backend=aot_autograd(fw_compiler=record, bw_compiler=record),
                                           fullgraph=True))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    forward, backward = graphs
    assert "speedrun.token_rows_backward" in backward and "index_put" not in backward, backward

    # the n-gram cache (ids (N, 2), its orders summed; load's sorted rows): the same forward, and the cache's
    # gradient as the float64 sums over each position's two rows, zero on the rows no position read
    ngram = T.NgramTable(T.ModelConfig(model_dim=8, ngram_rows=40), 64, 64).shard(T.Hyperparameters.of().optim)
    ngram.weight.normal_()
    ngram.load(torch.randint(0, 30, (50,)))
    upstream = torch.randn(50, 8).bfloat16()
    plain, fast = (ngram(50, kernel) for kernel in (False, True))
    assert torch.equal(plain, fast)
    got = torch.autograd.grad(fast, ngram.cache, upstream)[0]
    want = torch.zeros(ngram.cache.shape, dtype=torch.float64).index_add_(
        0, ngram.inverse[:50].flatten(), upstream.double().repeat_interleave(2, 0))
    print("n-gram cache", "%.1e" % rel_err(got, want))
    assert got.dtype == torch.bfloat16 and rel_err(got, want) < 5e-3 and torch.all(got[want.abs().sum(1) == 0] == 0)

    # the table's optimizer step: the kept parts' bf16 gradients summed per row in fp32 by the kernel (CUDA's path)
    # as by the atomic index_add (the CPU's): the same rows, the sums to fp32 rounding
    parts = []
    for count in (30, 17, 1):
        ids = torch.cat([torch.randperm(30)[:count].sort().values, torch.full((5,), 40)])
        parts.append((ids, torch.randn(ids.numel(), 300).bfloat16()))
    rows, grads = zip(*parts)
    distinct, sums = T.summed_row_gradients(rows, grads, 40, row_kernel=True)
    want_distinct, want_sums = T.summed_row_gradients(rows, grads, 40)
    print("row sums", "%.1e" % rel_err(sums, want_sums))
    assert sums.dtype == torch.float32 and torch.equal(distinct, want_distinct) and rel_err(sums, want_sums) < 1e-6
""")


@pytest.mark.skipif(T.triton is None, reason="Triton not installed")
def test_token_rows_kernel_sums_each_rows_tokens_in_the_triton_interpreter():
    run_in_triton_interpreter(TOKEN_ROWS_INTERPRETER_CHECK, timeout=600)


@pytest.mark.skipif(T.triton is None or T.TRITON_INTERPRETER, reason="needs Triton's compiler")
@pytest.mark.parametrize("width, grad, out", [(768, "bf16", "bf16"), (3072, "bf16", "bf16"), (768, "bf16", "fp32"),
                                              (768, "fp32", "fp32")])
def test_token_rows_kernel_compiles_for_hopper(width, grad, out):
    """The kernel compiled ahead of time for sm_90 (no GPU needed) with the launch's constants and aligned pointers,
    as token_rows_backward launches it for embed (768 wide), value_embeds (3,072) and the n-gram table's sums (fp32
    out; fp32 in above world size 1): within the 227 KB of shared memory an H100/H200 block may use."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, launch = T._token_rows_backward_kernel, dict(T.TOKEN_ROWS_LAUNCH)
    num_warps = launch.pop("num_warps")
    launch["BLOCK_D"] = min(launch["BLOCK_D"], T.triton.next_power_of_2(width))
    pointers = {"grad_ptr": f"*{grad}", "order_ptr": "*i32", "ordered_ptr": "*i32", "starts_ptr": "*i32",
                "out_ptr": f"*{out}"}
    fixed = {**launch, "UPCAST": False}
    index = kernel.arg_names.index
    source = ASTSource(kernel, signature={**pointers, "V": "i32", "D": "i32", **dict.fromkeys(fixed, "constexpr")},
                       constexprs={(index(name),): value for name, value in fixed.items()},
                       attrs={(index(name),): [["tt.divisibility", 16]] for name in pointers})
    compiled = T.triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    assert compiled.metadata.shared <= 227 * 1024, compiled.metadata.shared


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("width", [768, 3072])
def test_token_rows_kernel_on_gpu(width):
    """At a stage-3 forward (49,152 tokens over GPT-2's 50,304 rows, ids like text's: the most frequent ~9 % of the
    tokens), embed's and value_embeds' widths: the gradient against the float64 sums to bf16 precision, rows no token
    has exactly zero, through TokenRows eager and compiled (fullgraph), and the same bits on every run."""
    tokens, rows = 49152, 50304
    generator = torch.Generator().manual_seed(width)
    ids = id_mix(tokens, rows, generator).cuda()
    grad = torch.randn(tokens, width, generator=generator).bfloat16().cuda()
    table = torch.randn(rows, width, generator=generator).bfloat16().cuda().requires_grad_()
    want = torch.zeros(rows, width, dtype=torch.float64, device="cuda").index_add_(0, ids, grad.double())

    def gradient(fn):
        table.grad = None
        fn(table, ids).backward(grad)
        return table.grad

    def kernel(table, ids):
        return T.token_rows(table, ids, T.token_order(ids, rows))

    eager = gradient(kernel)
    assert torch.bincount(ids).max() > tokens // 20
    assert eager.dtype == torch.bfloat16 and rel_err(eager, want) < 5e-3
    assert torch.all(eager[want.abs().sum(1) == 0] == 0)
    assert torch.equal(gradient(kernel), eager)
    torch._dynamo.reset()
    assert torch.equal(gradient(torch.compile(kernel, dynamic=False, fullgraph=True)), eager)


@cuda
@pytest.mark.gpu
def test_compiled_model_with_the_token_rows_kernel_matches_index_put_on_gpu():
    """The whole model compiled (fullgraph, as in training) with the plan's token_rows_kernel on and off: inductor
    launches the kernel only when on, and the loss and the gradients of embed, value_embeds and the n-gram cache
    agree to bf16 precision."""
    import dataclasses

    from torch._inductor.utils import run_and_get_code
    tokens = 1024
    torch.manual_seed(0)
    ids = torch.randint(0, 500, (tokens + 1,))  # ids repeat, as text's do
    ids[[0, 300, 301, 700]] = T.BOS_ID
    cu = torch.from_numpy(T.cu_seqlens_for([300, 1, 399, tokens + 1 - 700], tokens, 16)).cuda()
    inputs, targets = ids[:-1].int().cuda(), ids[1:].int().cuda()
    shape = T.ForwardShape(short_window=128, long_window=384, max_seq_len=512, n_predict=2)
    hp = T.Hyperparameters.of(model_dim=384, num_heads=6, head_dim=64, mlp_hidden=1024, ngram_rows=1001,
                              val_seq_len=1024)
    plan = T.resolve_execution(hp.execution, hp.model, torch.device("cuda"), tokens, training=True)
    assert plan.token_rows_kernel
    results = []
    for setting in (False, True):
        torch.manual_seed(0)
        model = T.GPT(hp.model, T.longest_forward(hp)).cuda()
        model.ngram.shard(hp.optim).weight.normal_()
        model.ngram.load(inputs)
        torch._dynamo.reset()
        compiled = torch.compile(model.training_loss, dynamic=False, fullgraph=True)

        def step():
            loss, _ = compiled(inputs, targets, cu, shape, dataclasses.replace(plan, token_rows_kernel=setting),
                               torch.tensor([1.0, 0.5], device="cuda"))
            loss.backward()
            return loss.detach()

        loss, codes = run_and_get_code(step)
        assert ("_token_rows_backward_kernel" in "\n".join(codes)) == setting
        results.append((loss, model.embed.grad, model.value_embeds.grad, model.ngram.cache.grad))
    (ref_loss, *ref_grads), (loss, *grads) = results
    assert rel_err(loss, ref_loss) < 1e-2  # the same gather forward; inductor may fuse the rest apart
    assert all(rel_err(got, want) < 3e-2 for got, want in zip(grads, ref_grads))  # bf16 through 11 layers


@cuda
@pytest.mark.gpu
def test_the_ngram_tables_row_sums_by_the_kernel_on_gpu():
    """On CUDA the n-gram table sums its kept gradients by the kernel (decided when shard allocates the rows); at
    a stage-3 step's two kept parts (98,304 rows of 768 each, a third of the rows in both) its sums match the atomic
    index_add's to fp32 rounding, compiled as the table compiles it."""
    cuda = torch.device("cuda")
    ngram = T.NgramTable(T.ModelConfig(ngram_rows=1000), 64, 64).to(cuda).shard(T.Hyperparameters.of().optim)
    assert ngram._summed.keywords == {"row_kernel": True}
    generator = torch.Generator().manual_seed(0)
    shared = torch.randperm(10_000_000, generator=generator)[:32768]
    parts = []
    for _ in range(2):
        own = torch.randperm(10_000_000, generator=generator)[:65536] + 10_000_000
        ids = torch.cat([shared, own]).sort().values
        parts.append((ids.cuda(), torch.randn(ids.numel(), 768, generator=generator).bfloat16().cuda()))
    rows, grads = zip(*parts)
    fill = 30_000_000
    torch._dynamo.reset()
    compiled = torch.compile(T.summed_row_gradients, dynamic=False, fullgraph=True)
    distinct, sums = compiled(rows, grads, fill, row_kernel=True)
    want_distinct, want_sums = T.summed_row_gradients(rows, grads, fill)
    assert torch.equal(distinct, want_distinct) and sums.dtype == torch.float32
    assert rel_err(sums, want_sums) < 1e-6
    # fp32 parts (the owners' sums above world size 1) summed in fp32, not tf32 (~1e-4 off)
    grads = tuple(g.float() * (1 + torch.rand_like(g.float())) for g in grads)
    distinct, sums = compiled(rows, grads, fill, row_kernel=True)
    assert rel_err(sums, T.summed_row_gradients(rows, grads, fill)[1]) < 1e-6
