"""The hashed n-gram table (T3.19), model.ngram: its hashing, its lazy row-wise RMSprop against the dense one, the
compact exchange against a dense all-reduce on gloo ranks, a tiny model training with it, its sizes' checks and
its reset by the warm-up."""
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import TINY, free_port

import train_gpt as T

DIM = 8
# The rows of ngram_ids(GOLDEN_IDS, 1000) (the table's orders, 2 and 3): the same in every process, on every device
# and rank
GOLDEN_IDS = torch.tensor([50256, 11, 0, 50303, 464, 11, 0, 50303])
GOLDEN_ROWS = [[998, 999], [275, 999], [217, 441], [86, 727], [783, 6], [28, 917], [217, 471], [86, 727]]


def python_ngram_row(tokens: list[int], hashed_rows: int) -> int:
    """The hash's definition in Python integers: Horner's rule modulo 2^31 - 1 from the order, then scattered."""
    h = len(tokens)
    for token in tokens:
        h = (h * T.NGRAM_BASE + token + 1) % T.NGRAM_PRIME
    return h * T.NGRAM_SCATTER % T.NGRAM_PRIME % hashed_rows


def table(rows: int = 40, rank: int = 0, world: int = 1, tokens: int = 64, device="cpu", compile: bool = False,
          dtype=torch.float32) -> T.NgramTable:
    """A table of `rows` rows of DIM values whose row cache serves forwards of up to `tokens` tokens, sharded for
    (rank, world): as GPT builds it and the trainer shards it."""
    cfg = T.ModelConfig(model_dim=DIM, ngram_rows=rows)
    return T.NgramTable(cfg, tokens, tokens).to(device).shard(T.Hyperparameters.of().optim, rank, world,
                                                              compile=compile, dtype=dtype)


def dense_rowwise_step(W: torch.Tensor, v: torch.Tensor, dense: torch.Tensor, step_size: float, beta2: float,
                       eps: float):
    """Row-wise RMSprop on the whole table, in place: every row's second moment takes the mean square of its
    gradient (zero on rows the step left out), every row moves by its gradient over the moment's root."""
    v.mul_(beta2).add_((1 - beta2) * dense.square().mean(dim=1))
    W.sub_(step_size * dense / (v.sqrt() + eps)[:, None])


def test_ngram_rows_are_fixed_in_range_and_reserved_at_the_batch_start():
    assert T.NGRAM_ORDERS == (2, 3) and T.ngram_ids(GOLDEN_IDS, 1000).tolist() == GOLDEN_ROWS
    tokens = GOLDEN_IDS.tolist()
    assert GOLDEN_ROWS[2:] == [[python_ngram_row(tokens[t - n + 1: t + 1], 998) for n in (2, 3)] for t in range(2, 8)]
    ids = torch.randint(0, 50304, (4096,))
    rows = T.ngram_ids(ids, 5003, (2, 3, 4))
    assert rows.shape == (4096, 3) and rows.dtype == torch.long
    for k, n in enumerate((2, 3, 4)):
        assert (rows[: n - 1, k] == 5000 + k).all()  # the first n - 1 positions: the order's reserved row
        assert ((rows[n - 1:, k] >= 0) & (rows[n - 1:, k] < 5000)).all()
        assert rows[n - 1:, k].unique().numel() > 0.5 * 5000  # spread over the hashed rows
    # an n-gram's row depends on its n tokens only, not on where it sits
    shifted = T.ngram_ids(torch.cat([ids[:7], ids]), 5003, (2, 3, 4))[7:]
    assert torch.equal(shifted[3:], rows[3:])
    assert not torch.equal(rows[3:, 0], rows[3:, 1])  # the orders hash apart


def test_padded_unique_is_torch_unique_with_a_static_shape():
    values = torch.randint(0, 30, (50,))
    distinct, inverse = T.padded_unique(values, 99)
    expected, expected_inverse = values.unique(return_inverse=True)
    assert distinct.shape == values.shape
    assert torch.equal(distinct[: expected.numel()], expected) and (distinct[expected.numel():] == 99).all()
    assert torch.equal(inverse, expected_inverse)


def summed_parts(parts: list[tuple[torch.Tensor, torch.Tensor]], fill: int) -> dict[int, torch.Tensor]:
    """Each row id's gradient summed over the (row ids, gradients) parts in float64, the padding `fill` left out."""
    sums: dict[int, torch.Tensor] = {}
    for rows, grads in parts:
        for row, grad in zip(rows.tolist(), grads.double().cpu()):
            if row != fill:
                sums[row] = sums.get(row, 0) + grad
    return sums


def random_parts(count: int, rows: int, fill: int, dtype: torch.dtype, device="cpu"):
    """`count` parts as the table keeps them: each a load's distinct row ids (then `fill`) and their gradients."""
    parts = []
    for _ in range(count):
        distinct = torch.randperm(rows)[: int(torch.randint(1, rows, ()))].sort().values
        ids = torch.cat([distinct, torch.full((5,), fill)])
        parts.append((ids.to(device), torch.randn(ids.numel(), DIM).to(device, dtype)))
    return parts


@pytest.mark.parametrize("count", [1, 2, 5])
def test_summed_row_gradients_adds_each_rows_pairs_across_parts_in_fp32(count):
    """The kept parts of an optimizer step (rows repeat across parts, padding in each): every distinct row once, in
    increasing order, then the padding; its bf16 gradients summed in fp32 over the parts, as a float64 sum has them."""
    torch.manual_seed(count)
    parts = random_parts(count, 30, 40, torch.bfloat16)
    distinct, sums = T.summed_row_gradients(*zip(*parts), fill=40)
    expected = summed_parts(parts, 40)
    n = len(expected)
    assert sums.dtype == torch.float32 and distinct.numel() == sums.size(0) == sum(r.numel() for r, _ in parts)
    assert distinct[:n].tolist() == sorted(expected) and (distinct[n:] == 40).all()
    torch.testing.assert_close(sums[:n].double(), torch.stack([expected[r] for r in sorted(expected)]),
                               rtol=1e-6, atol=1e-6)


def test_the_table_compiles_its_update_only_on_the_gpu():
    """Decided once, when shard allocates the rows: on the CPU the table runs rowwise_rmsprop_rows and
    summed_row_gradients as they are."""
    cpu = table(compile=True)
    assert cpu._rows_fn is T.rowwise_rmsprop_rows and cpu._summed is T.summed_row_gradients


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_compiled_lazy_update_equals_the_eager_one_on_the_gpu():
    """The compiled update (one graph for a fixed row count) gives the eager function's rows, optimizer state and
    steps over ten steps of random row sets with repeats and padding."""
    torch.manual_seed(0)
    cuda = torch.device("cuda")
    eager, fused = (table(device=cuda, compile=c) for c in (False, True))
    assert fused._rows_fn is not eager._rows_fn and fused._summed is not eager._summed
    start = torch.randn(40, DIM, device=cuda)
    for tab in (eager, fused):
        tab.weight[:40].copy_(start)
    for t in range(10):
        ids = torch.cat([torch.randint(0, 30, (27,)), torch.full((3,), 40)]).to(cuda)
        grads = torch.randn(30, DIM, device=cuda)
        for tab in (eager, fused):
            tab.update(*tab.owner_sums([(ids, grads)]), 1.0 - 0.08 * t)
    torch.testing.assert_close(fused.weight[:40], eager.weight[:40], rtol=1e-5, atol=1e-6)
    assert torch.equal(fused.last_step, eager.last_step)
    parts = random_parts(3, 40, 40, torch.bfloat16, cuda)  # the compiled sums of bf16 parts, as a run keeps them
    distinct, sums = fused.owner_sums(parts)
    expected = summed_parts(parts, 40)
    assert distinct[: len(expected)].tolist() == sorted(expected)
    torch.testing.assert_close(sums[: len(expected)].double().cpu(), torch.stack([expected[r] for r in sorted(expected)]),
                               rtol=1e-6, atol=1e-6)
    # per row (but the scratch row 40)
    torch.testing.assert_close(fused.row_sq[:40], eager.row_sq[:40], rtol=1e-5, atol=1e-9)


def mirrored_exchange(world: int):
    """dist.all_to_all_single of equal splits as rank 0 of `world` ranks that all send what rank 0 sends: the
    exchange's kernels and shapes on one device without a process group (NCCL's own all_to_all_single of equal
    splits makes no host sync)."""
    def all_to_all_single(out, t):
        out.view(world, -1, *t.shape[1:]).copy_(t[: t.size(0) // world])
    return all_to_all_single


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_above_world_size_1_the_loads_and_steps_make_no_host_sync_and_a_load_replays_in_a_cuda_graph(monkeypatch):
    """Rank 0 of 4 (mirrored_exchange), the compiled update and sums: loads, kept gradients and Adam every other
    step under torch.cuda.set_sync_debug_mode("error") once the first round compiled them; then a load captured in
    a CUDA graph and replayed on other tokens fills the row cache as the eager load does."""
    monkeypatch.setattr(T.dist, "all_to_all_single", mirrored_exchange(4))
    torch.manual_seed(3)
    cuda = torch.device("cuda")
    tab = table(rows=4000, rank=0, world=4, tokens=512, device=cuda, compile=True, dtype=torch.bfloat16)
    batches = [torch.randint(0, 50257, (512,), device=cuda) for _ in range(4)]

    def round_of_steps():
        for step, ids in enumerate(batches[:3]):
            distinct = tab.load(ids)
            tab.keep_gradient(distinct, torch.randn(tab.cache.shape, device=cuda, dtype=torch.bfloat16))
            tab.step(1.0, adam=step != 1)

    round_of_steps()  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        round_of_steps()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert tab.step_count == 4 and tab.overflow.item() == 0 and (tab.weight[: tab.shard_rows] != 0).any()
    static = batches[0].clone()
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tab.load(static)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph, stream=stream):
        distinct = tab.load(static)
    static.copy_(batches[3])
    tab.cache.detach().zero_()
    graph.replay()
    replayed, replayed_distinct = tab.cache.detach().clone(), distinct.clone()
    assert torch.equal(replayed_distinct, tab.load(batches[3]))
    assert torch.equal(replayed, tab.cache.detach()) and replayed.abs().sum() > 0


def test_lazy_rowwise_rmsprop_equals_the_dense_one():
    """Random row sets (repeats, padding, rows left out for many steps, rows never touched), a varying lr: the
    touched rows move and their moments take every step's decay as the dense optimizer's do, the others stay put;
    its state is one value per row."""
    torch.manual_seed(1)
    lazy = table(rows=40)
    assert set(lazy.tensors()) == {"weight", "last_step", "row_sq", "overflow"} and lazy.row_sq.shape == (41,)
    lazy.weight[:40].normal_()
    W, v = lazy.weight[:40].clone(), torch.zeros(40)
    initial = W.clone()
    _, beta2 = lazy.spec.betas
    for t in range(1, 11):
        n = int(torch.randint(1, 30, ()))
        ids = torch.cat([torch.randint(0, 30, (n,)), torch.full((3,), 40)])  # rows 30..39: never; 40: padding
        grads, lr_multiplier = torch.randn(n + 3, DIM), 1.0 - 0.08 * t
        lazy.update(*lazy.owner_sums([(ids, grads)]), lr_multiplier)
        dense = torch.zeros(41, DIM).index_add_(0, ids, grads)[:40]
        lr = lazy.optim.adam_lr * 75.0 * lr_multiplier
        dense_rowwise_step(W, v, dense, lr * math.sqrt(1 - beta2 ** t), beta2, lazy.optim.adam_eps)
    rows = torch.arange(40)
    torch.testing.assert_close(lazy.weight[rows], W, rtol=1e-6, atol=1e-6)
    missed = (lazy.step_count - lazy.last_step[rows]).float()
    torch.testing.assert_close(lazy.row_sq[rows] * beta2 ** missed, v, rtol=1e-5, atol=1e-12)
    assert (lazy.weight[:30] != initial[:30]).any(1).sum() > 20
    assert torch.equal(lazy.weight[30:40], initial[30:40]) and (lazy.last_step[30:40] == 0).all()


def exchange_worker(rank: int, world: int, port: int, out_path: str):
    # forked after earlier tests ran torch's OpenMP pool, which a forked child cannot use: one thread, no pool
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = {"golden": T.ngram_ids(GOLDEN_IDS, 1000).tolist()}
        # (row id, gradient) pairs with repeats and padding; gradients multiples of 1/8: exact sums in any order
        g = torch.Generator().manual_seed(rank)
        rows = torch.cat([torch.randint(0, 37, (25,), generator=g), torch.full((4,), 37)])
        grads = torch.randint(-8, 9, (29, DIM), generator=g) / 8
        tab = table(rows=37, rank=rank, world=world)
        local, sums = tab.owner_sums([(rows, grads)])
        dense = torch.zeros(38, DIM).index_add_(0, rows, grads)[:37]
        dist.all_reduce(dense)
        owned = local < tab.shard_rows
        result["exchanged"] = (local[owned], sums[owned], dense[tab.start: tab.start + tab.shard_rows])
        # three steps of the sharded table, each rank loading its own ids: the rows it reads, what it adds
        tab.weight[: tab.shard_rows] = (torch.arange(tab.shard_rows)[:, None] + tab.start + torch.arange(DIM)) / 64
        result["steps"] = []
        for step in range(3):
            ids = torch.randint(0, 500, (64,), generator=g)
            distinct = tab.load(ids)  # into the table's row cache (bf16) and inverse
            cache_grad = torch.randint(-8, 9, (128, DIM), generator=g) / 8
            result["steps"].append((ids, tab.cache.detach()[tab.inverse], cache_grad))
            tab.keep_gradient(distinct, cache_grad)
            tab.step(1.0 - 0.2 * step, adam=step != 1)  # Adam every other step: step 2 sums two steps' pairs
        result["shard"] = tab.weight[: tab.shard_rows].clone()
        result["overflow"] = [tab.overflow.item()]
        T.NGRAM_EXCHANGE_SIGMAS = -10**6  # one slot per owner: a load of many rows overflows, and says so
        tab.load(torch.randint(0, 500, (64,), generator=g))
        result["overflow"].append(tab.overflow.item())
        torch.save(result, f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4, 8])
def test_the_exchange_equals_the_dense_all_reduce_and_one_process(world, tmp_path):
    """Each rank's rows get exactly the dense all-reduce's sums; a sharded table reads and updates bit for bit
    as one process fed every rank's pairs; every rank hashes alike; no exchange overflowed its slots until a
    test made them too few."""
    out_path = str(tmp_path / "ngram.pt")
    # forked, the ranks start without importing torch again (a spawned rank takes seconds on two cores)
    mp.start_processes(exchange_worker, args=(world, free_port(), out_path), nprocs=world, start_method="fork")
    results = [torch.load(f"{out_path}.{rank}") for rank in range(world)]
    for result in results:
        assert result["golden"] == GOLDEN_ROWS
        assert result["overflow"][0] == 0 and result["overflow"][1] > 0
        local, sums, dense = result["exchanged"]
        assert local.unique().numel() == local.numel()  # each owned row once
        expected = torch.zeros_like(dense).index_copy_(0, local, sums)
        assert torch.equal(expected, dense)
    single = table(rows=37)
    single.weight[:37] = (torch.arange(37)[:, None] + torch.arange(DIM)) / 64
    for step in range(3):
        for rank, result in enumerate(results):
            ids, rows_read, cache_grad = result["steps"][step]
            distinct = single.load(ids)
            assert torch.equal(single.cache.detach()[single.inverse], rows_read), (rank, step)
            single.keep_gradient(distinct, cache_grad / world)  # the ranks' sum is scaled by 1/world
        single.step(1.0 - 0.2 * step, adam=step != 1)
    sharded = torch.cat([result["shard"] for result in results])[:37]
    assert torch.equal(sharded, single.weight[:37]) and sharded.abs().sum() > 0


def test_a_tiny_model_trains_with_the_table_as_the_dense_optimizer_would_without_a_dense_gradient(corpus):
    """Four CPU steps (Adam on odd ones): the table is no parameter and gets no gradient of its own; every row the
    batches touched moves, each as the dense row-wise RMSprop on the steps' summed row gradients moves it (zero
    gradient where a step left it out); rows never touched stay zero."""
    hp = T.Hyperparameters.of(**dict(TINY, ngram_rows=3001, rank_slice=True),
                              train_files=str(corpus / "tiny_train_*.bin"), val_files=str(corpus / "tiny_val_*.bin"),
                              tokenizer_dir=str(corpus))
    T.check_hyperparameters(hp)
    trainer = T.Trainer(hp, 0, 1, torch.device("cpu"), T.RunLog(None))
    model, tab = trainer.model, trainer.ngram
    assert tab is model.ngram and isinstance(tab, T.NgramTable)
    assert not any(p.numel() % 3001 == 0 or "ngram" in name for name, p in model.named_parameters())
    assert "ngram_table" not in trainer.optimizer.params
    assert not tab.weight.requires_grad and tab.weight.grad is None
    updates, update = [], tab.update
    tab.update = lambda local, sums, lr_multiplier: (updates.append((local.clone(), sums.clone(), lr_multiplier)),
                                                     update(local, sums, lr_multiplier))
    loader = T.TrainLoader(hp.data.train_files, 0, 1, torch.device("cpu"), log=lambda _: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on two cores, beside other tests' processes, take twice as long
    try:
        for step in range(4):
            trainer.train_step(trainer.schedule.plan(step), loader)
        val_loss = trainer.evaluate(4, max_batches=1)  # validation reads the table through the cache too
    finally:
        torch.set_num_threads(threads)
    assert math.isfinite(val_loss) and len(updates) == 2 and tab.weight.grad is None and tab.cache.grad is None
    # the cache a backward fills is the longest training forward's (512 tokens, 2 orders); validation's longer
    # forward (1024) reads its own, without a gradient, which the evaluation's load filled
    assert tab.cache.shape[0] == 2 * T.longest_training_forward(hp) == 2 * 512 and tab.cache.is_leaf
    assert tab.eval_cache.shape[0] == 2 * 1024 and not tab.eval_cache.requires_grad
    assert tab.cache_for(512) is tab.cache and tab.cache_for(1024) is tab.eval_cache
    assert (tab.eval_cache[:1024] != 0).any(1).sum() > 100
    W, row_sq = torch.zeros(3001, 128), torch.zeros(3001)
    _, beta2 = tab.spec.betas
    touched = torch.zeros(3001, dtype=torch.bool)
    for t, (local, sums, lr_multiplier) in enumerate(updates, 1):
        real = local < 3001
        touched[local[real]] = True
        dense = torch.zeros(3001, 128).index_add_(0, local[real], sums[real])
        lr = hp.optim.adam_lr * 75.0 * lr_multiplier
        dense_rowwise_step(W, row_sq, dense, lr * math.sqrt(1 - beta2 ** t), beta2, hp.optim.adam_eps)
    assert 100 < touched.sum() < 3001
    weight = tab.weight[:3001].float()
    assert (weight[touched] != 0).any(1).all()  # every touched row moved
    torch.testing.assert_close(weight, W, rtol=1e-2, atol=1e-3 * W.abs().max().item())
    assert (weight[~touched] == 0).all() and (tab.row_sq[:3001][~touched] == 0).all() and (tab.row_sq != 0).any()
    assert torch.isfinite(trainer.losses[:4]).all()


@pytest.mark.parametrize("rows", [2, T.NGRAM_PRIME + 1])
def test_row_counts_the_table_cannot_take_are_one_line(rows):
    """More rows than orders (one reserved row each), and hashable."""
    with pytest.raises(T.SetupError, match=f"^NGRAM_ROWS={rows}: give more than 2 rows .* at most {T.NGRAM_PRIME}$") \
            as error:
        T.check_ngram_rows(T.Hyperparameters.of(ngram_rows=rows), 1)
    assert "\n" not in str(error.value)
    T.check_ngram_rows(T.Hyperparameters.of(ngram_rows=3), 1)


def test_a_table_too_large_for_a_process_names_the_largest_that_fits():
    row_bytes = T.ngram_bytes_per_row(768)
    largest = T.NGRAM_STATE_GIB * 2**30 // row_bytes
    T.check_ngram_rows(T.Hyperparameters.of(ngram_rows=largest, rank_slice=True), 1)
    with pytest.raises(T.SetupError, match=f"^NGRAM_ROWS={largest + 1} does not fit: 1544 bytes per row .*"
                                           f"rank-slice mode holds the whole table.*NGRAM_ROWS={largest}$"):
        T.check_ngram_rows(T.Hyperparameters.of(ngram_rows=largest + 1, rank_slice=True), 1)
    # the bf16 weight and 8 bytes a row (row-wise state), so rank-slice holds record #92's 10,575,360 rows per rank
    assert row_bytes == 2 * 768 + 4 + 4 and largest > 10_575_360
    T.check_ngram_rows(T.Hyperparameters.of(ngram_rows=8 * largest), 8)  # one eighth per rank
    with pytest.raises(T.SetupError, match=rf"\(world size 8\); the largest that fits: NGRAM_ROWS={8 * largest}$"):
        T.check_ngram_rows(T.Hyperparameters.of(ngram_rows=8 * largest + 1), 8)


def test_the_warm_up_leaves_the_table_reset_and_takes_no_copy_of_it(corpus, monkeypatch):
    """After the warm-up's steps the table is as shard left it: rows and moments zero, no step taken, no gradient kept
    or left on the cache. It is reset, not restored from a copy (one as large as the table: 28 GiB at 3.9M rows,
    which beside the model overflowed an 80 GB GPU)."""
    hp = T.Hyperparameters.of(**dict(TINY, ngram_rows=3001, rank_slice=True),
                              train_files=str(corpus / "tiny_train_*.bin"), val_files=str(corpus / "tiny_val_*.bin"),
                              tokenizer_dir=str(corpus))
    trainer = T.Trainer(hp, 0, 1, torch.device("cpu"), T.RunLog(None))
    tab, steps = trainer.ngram, []

    def fake_step(plan, loader, forward_backward=None):  # what a step leaves in the table
        steps.append(plan.step)
        tab.weight.add_(1.0), tab.row_sq.add_(2.0), tab.last_step.fill_(3)
        tab.step_count += 1
        tab.kept.append((torch.arange(2), torch.ones(2, 128)))
        tab.cache.grad = torch.ones_like(tab.cache)

    monkeypatch.setattr(trainer, "train_step", fake_step)
    monkeypatch.setattr(trainer, "evaluate", lambda *args, **kwargs: 0.0)
    trainer.warmup()
    assert steps and trainer.ngram is tab and trainer.model.ngram is tab
    assert tab.step_count == 0 and tab.kept == [] and tab.cache.grad is None
    assert set(tab.tensors()) == {"weight", "last_step", "row_sq", "overflow"}
    assert all((t == 0).all() for t in tab.tensors().values())


def test_an_exchange_gives_each_owner_its_binomial_share_with_room_and_never_more_than_it_can_hold():
    """exchange_capacity: the mean share plus NGRAM_EXCHANGE_SIGMAS deviations (rank-slice's stage 3 at 8 ranks:
    98,304 ids, 12,288 a rank on average), bounded by the ids and by an owner's rows."""
    assert T.exchange_capacity(98_304, 8, 1_321_920) == 12_288 + math.ceil(8 * math.sqrt(12_288)) + 8
    assert T.exchange_capacity(128, 4, 10) == 10 and T.exchange_capacity(3, 2, 100) == 3
    assert T.exchange_capacity(0, 8, 100) == 1


def test_an_overflowing_exchange_stops_the_run_at_the_periodic_check(corpus):
    """The slots an owner lacked are counted on the device (no host sync) and read with the non-finite check:
    one line naming the constant."""
    hp = T.Hyperparameters.of(**dict(TINY, ngram_rows=3001, rank_slice=True),
                              train_files=str(corpus / "tiny_train_*.bin"), val_files=str(corpus / "tiny_val_*.bin"),
                              tokenizer_dir=str(corpus))
    trainer = T.Trainer(hp, 0, 1, torch.device("cpu"), T.RunLog(None))
    trainer.check_finite(2)
    trainer.ngram.overflow.fill_(3)
    with pytest.raises(T.ExchangeOverflow, match=r"^an n-gram table exchange sent an owner 3 more rows than its slots "
                                                 r"\(detected at step 4\): raise NGRAM_EXCHANGE_SIGMAS"):
        trainer.check_finite(4)
    trainer.ngram.reset()
    assert trainer.ngram.overflow.item() == 0


def test_rows_per_rank_make_the_table_grow_with_the_world_size():
    """NGRAM_ROWS_PER_RANK: 8 GPUs hold record #92's 84.6M rows, rank-slice (one process) one rank's 10.6M; with
    NGRAM_ROWS too it is one line."""
    hp = T.Hyperparameters.of(ngram_rows_per_rank=10_575_360)
    assert T.rows_for_world(hp, 8).model.ngram_rows == 84_602_880
    assert T.rows_for_world(hp, 1).model.ngram_rows == 10_575_360
    assert T.rows_for_world(T.Hyperparameters.of(ngram_rows=5000), 8).model.ngram_rows == 5000
    with pytest.raises(T.SetupError, match="^NGRAM_ROWS=5000 and NGRAM_ROWS_PER_RANK=3000: give one of them$"):
        T.rows_for_world(T.Hyperparameters.of(ngram_rows=5000, ngram_rows_per_rank=3000), 2)
    T.check_ngram_rows(T.rows_for_world(hp, 8), 8)
