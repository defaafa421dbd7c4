"""The sparse value embeddings (VALUE_EMBED_SPARSE, T3.20): the lazy sparse Adam against the dense optimizer's
value_embeds (NorMuonAdam), micro-batches and Adam every other step included; where weight decay makes them
differ; the compact exchange on gloo ranks; a tiny model training with it; the settings it refuses."""
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import TINY, free_port

import train_gpt as T

V, WIDTH, LATE, NEVER = 40, 8, range(20, 25), range(30, 40)  # LATE: rows first read at step 5; NEVER: never read


def token_batches(steps: int = 8, micro_batches: int = 2, tokens: int = 16, seed: int = 0) -> list:
    """Per step, per micro-batch: (ids, the upstream gradient of each position's row). Ids repeat within a
    batch; rows LATE are left out of the first five steps, rows NEVER out of all."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([row for row in range(30) if row not in LATE])
    batches = []
    for step in range(steps):
        choices = torch.arange(30) if step >= 5 else allowed
        batches.append([(choices[torch.randint(0, choices.numel(), (tokens,), generator=g)],
                         torch.randn(tokens, WIDTH, generator=g)) for _ in range(micro_batches)])
    return batches


def train_both(optim: T.OptimConfig, batches: list) -> tuple:
    """The same batches through the dense parameter (NorMuonAdam, the default path) and a ValueEmbedTable, in
    fp32, Adam on odd steps (T2.7); (table, dense weight, the largest difference of the rows a forward read,
    the rows each Adam step updated)."""
    cfg = T.ModelConfig(vocab_size=V, value_embed_sparse=True)
    initial = torch.randn(V, WIDTH, generator=torch.Generator().manual_seed(1))
    table = T.ValueEmbedTable(cfg, optim, len(batches), initial, torch.device("cpu"), dtype=torch.float32)
    dense = torch.nn.Parameter(initial.clone())
    spec = T.param_table(T.ModelConfig())["value_embeds"]
    optimizer = T.NorMuonAdam({"value_embeds": dense}, {"value_embeds": spec}, optim)
    cache = torch.zeros(16, WIDTH, requires_grad=True)  # min(tokens per forward, V) rows, as GPT sizes it
    inverse = torch.zeros(16, 1, dtype=torch.long)
    read_difference, touched, pending = 0.0, [], torch.zeros(V, dtype=torch.bool)
    for step, micro_batches in enumerate(batches):
        for ids, upstream in micro_batches:
            distinct = table.load(ids, cache, inverse)
            rows = cache[inverse[:, 0]]
            read_difference = max(read_difference, (rows - dense[ids]).abs().max().item())
            (rows * upstream).sum().backward()
            (dense[ids] * upstream).sum().backward()
            table.add_gradient(distinct, cache.grad)
            cache.grad = None
            pending[ids] = True
        adam, lr_multiplier = step % 2 == 1, 1.0 - 0.07 * step
        optimizer.step(lr_multiplier, 0.95, adam)
        table.step(lr_multiplier, adam)
        if adam:
            touched.append(pending.clone())
            pending.zero_()
    return table, dense.detach(), read_difference, touched


def test_lazy_sparse_value_embeddings_equal_the_dense_path_without_weight_decay():
    """Every forward reads dense Adam's rows, and the table ends as the dense parameter: rows read every step,
    rows left out for five steps then read, rows never read. Tolerance 2e-6 as the n-gram table's (T3.19):
    fp32 rounding of up to eight replayed steps and the step sizes (fp64 here, fp32 scalars in NorMuonAdam)."""
    optim = T.Hyperparameters.of(adam_weight_decay=0.0).optim
    table, dense, read_difference, _ = train_both(optim, token_batches())
    rows = torch.arange(V)
    assert read_difference < 2e-6
    torch.testing.assert_close(table.replayed(rows), dense, rtol=2e-6, atol=2e-6)
    assert torch.equal(table.weight[list(NEVER)], dense[list(NEVER)]) and (table.last_step[list(NEVER)] == 0).all()


def test_with_weight_decay_the_sparse_path_skips_only_the_decay_of_the_steps_a_row_misses():
    """Dense Adam decays (cautiously, T2.5) every row whose update has the weight's sign, read or not; the sparse
    path decays the rows an Adam step updates, as dense Adam does then, and no others. It equals, to the same
    2e-6, a dense Adam whose decay is masked to each Adam step's rows; the dense path differs exactly on the
    rows some Adam step missed after their first read, by about the decay they missed."""
    optim = T.Hyperparameters.of().optim  # ADAM_WEIGHT_DECAY=0.005: lr² · 0.005 · 5 = 0.009 per step at lr 0.6
    batches = token_batches()
    table, dense, _, touched = train_both(optim, batches)
    spec, rows = T.param_table(T.ModelConfig())["value_embeds"], torch.arange(V)
    beta1, beta2 = spec.betas
    W = torch.randn(V, WIDTH, generator=torch.Generator().manual_seed(1))
    m, v, g = torch.zeros(V, WIDTH), torch.zeros(V, WIDTH), torch.zeros(V, WIDTH)
    for step, micro_batches in enumerate(batches):  # the masked reference: adam_update on two row sets
        for ids, upstream in micro_batches:
            g.index_add_(0, ids, upstream)
        if step % 2 == 0:
            continue
        t, lr = (step + 1) // 2, optim.adam_lr * spec.lr_mul * (1.0 - 0.07 * step)
        step_size = torch.tensor(lr * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t))
        for subset, wd_lr2 in ((touched[t - 1], lr * lr * optim.adam_weight_decay * spec.wd_mul),
                               (~touched[t - 1], 0.0)):
            w, mm, vv = W[subset], m[subset], v[subset]
            T.adam_update(g[subset], None, w, mm, vv, step_size, torch.tensor(wd_lr2), beta1, beta2, optim.adam_eps, 1.0)
            W[subset], m[subset], v[subset] = w, mm, vv
        g.zero_()
    torch.testing.assert_close(table.replayed(rows), W, rtol=2e-6, atol=2e-6)
    first_read = torch.stack(touched).float().argmax(0)
    missed = torch.stack([~hit & (first_read < t) for t, hit in enumerate(touched)]).any(0) & torch.stack(touched).any(0)
    difference = (table.replayed(rows) - dense).abs().amax(1)
    assert missed.sum() >= 5 and (difference[missed] > 1e-4).all()  # measured: the skipped decay
    torch.testing.assert_close(table.replayed(rows)[~missed], dense[~missed], rtol=2e-6, atol=2e-6)
    assert difference.max() < 0.02 * dense.abs().max()  # at most a few steps' 0.9% decay


def exchange_worker(rank: int, world: int, port: int, out_path: str):
    # forked after earlier tests ran torch's OpenMP pool, which a forked child cannot use: one thread, no pool
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(rank)
        cfg = T.ModelConfig(vocab_size=V, value_embed_sparse=True)
        initial = (torch.arange(V)[:, None] + torch.arange(WIDTH)) / 64
        tab = T.ValueEmbedTable(cfg, T.Hyperparameters.of().optim, 3, initial, torch.device("cpu"), rank, world,
                                dtype=torch.float32)
        cache, inverse = torch.zeros(V, WIDTH), torch.zeros(64, 1, dtype=torch.long)
        result = {"steps": []}
        for step in range(3):  # each rank its own ids; gradients multiples of 1/8: exact sums in any order
            ids = torch.randint(0, 30, (64,), generator=g)
            distinct = tab.load(ids, cache, inverse)
            cache_grad = torch.randint(-8, 9, (V, WIDTH), generator=g) / 8
            result["steps"].append((ids, cache[inverse[:, 0]].clone(), cache_grad))
            dense = torch.zeros(V + 1, WIDTH).index_add_(0, distinct, cache_grad[: distinct.numel()])[:V]
            dist.all_reduce(dense)
            local, sums = tab.owner_sums(distinct, cache_grad[: distinct.numel()])
            owned = local < tab.shard_rows
            expected = torch.zeros(tab.shard_rows, WIDTH).index_copy_(0, local[owned], sums[owned])
            result[f"exchange{step}"] = torch.equal(expected, dense[tab.start: tab.start + tab.shard_rows])
            tab.add_gradient(distinct, cache_grad)
            tab.step(1.0 - 0.2 * step, adam=step != 1)  # Adam every other step: step 2 sums two steps' pairs
        result["shard"] = tab.replayed(torch.arange(tab.shard_rows))
        torch.save(result, f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_two_ranks_exchange_the_dense_sums_and_train_as_one_process(tmp_path):
    """On 2 gloo ranks each owner gets exactly the dense all-reduce's row sums, and the sharded table reads and
    updates (decay included) bit for bit as one process fed both ranks' pairs."""
    world, out_path = 2, str(tmp_path / "ve.pt")
    mp.start_processes(exchange_worker, args=(world, free_port(), out_path), nprocs=world, start_method="fork")
    results = [torch.load(f"{out_path}.{rank}") for rank in range(world)]
    assert all(result[f"exchange{step}"] for result in results for step in range(3))
    cfg = T.ModelConfig(vocab_size=V, value_embed_sparse=True)
    single = T.ValueEmbedTable(cfg, T.Hyperparameters.of().optim, 3, (torch.arange(V)[:, None] + torch.arange(WIDTH)) / 64,
                               torch.device("cpu"), dtype=torch.float32)
    cache, inverse = torch.zeros(V, WIDTH), torch.zeros(64, 1, dtype=torch.long)
    for step in range(3):
        for rank, result in enumerate(results):
            ids, rows_read, cache_grad = result["steps"][step]
            distinct = single.load(ids, cache, inverse)
            assert torch.equal(cache[inverse[:, 0]], rows_read), (rank, step)
            single.add_gradient(distinct, cache_grad / world)  # the ranks' sum is scaled by 1/world
        single.step(1.0 - 0.2 * step, adam=step != 1)
    sharded = torch.cat([result["shard"] for result in results])[:V]
    assert torch.equal(sharded, single.replayed(torch.arange(V)))


def tiny_trainer(corpus, **settings) -> T.Trainer:
    hp = T.Hyperparameters.of(**dict(TINY, rank_slice=True, **settings), train_files=str(corpus / "tiny_train_*.bin"),
                              val_files=str(corpus / "tiny_val_*.bin"), tokenizer_dir=str(corpus))
    T.check_hyperparameters(hp)
    return T.Trainer(hp, 0, 1, torch.device("cpu"), T.RunLog(None))


def test_a_tiny_model_trains_with_sparse_value_embeddings_from_the_dense_initialization(corpus):
    """Two CPU steps (Adam on step 1) and a validation with VALUE_EMBED_SPARSE=1: the table starts as the dense
    parameter would (the same draw of the same seed), is no parameter and gets no dense gradient; the rows the
    batches read move; the warm-up's restore (load_state_dict) brings its clocks back."""
    trainer = tiny_trainer(corpus, value_embed_sparse=True)
    tab, initial = trainer.value_table, trainer.value_table.state_dict()
    torch.manual_seed(trainer.hp.run.seed)
    dense = T.GPT(T.Hyperparameters.of(**TINY).model, 64)
    assert torch.equal(tab.weight[:-1], dense.value_embeds.detach()) and (tab.weight[-1] == 0).all()
    assert "value_embeds" not in dict(trainer.model.named_parameters()) and "value_embeds" not in trainer.optimizer.params
    assert not hasattr(trainer.model, "initial_value_embeds")
    loader = T.TrainLoader(trainer.hp.data.train_files, 0, 1, torch.device("cpu"), log=lambda _: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on two cores, beside other tests' processes, take twice as long
    try:
        for step in range(2):
            trainer.train_step(trainer.schedule.plan(step), loader)
        val_loss, _ = trainer.evaluate(2, max_batches=1)  # validation reads the table through the cache too
    finally:
        torch.set_num_threads(threads)
    assert math.isfinite(val_loss) and torch.isfinite(trainer.losses[:2]).all() and trainer.model.ve_cache.grad is None
    read = tab.last_step[:-1] > 0  # the last: the scratch row
    assert tab.step_count == 1 and read.sum() > 100 and (tab.weight[:-1][read] != dense.value_embeds.detach()[read]).any(1).all()
    tab.load_state_dict(initial)
    assert tab.step_count == 0 and (tab.last_step == 0).all() and (tab.replay == 0).all() and tab.kept == []


def test_the_row_cache_stays_a_leaf_when_the_model_moves():
    """Module.to moves buffers with autograd on; the model keeps its row cache a leaf, so its .grad fills."""
    hp = T.Hyperparameters.of(**TINY, value_embed_sparse=True)
    model = T.GPT(hp.model, 64).to(torch.float32)
    assert model.ve_cache.is_leaf and model.ve_cache.requires_grad and model.ve_cache.shape == (64, len(hp.model.value_embed_layers) * 128)
    assert T.param_table(hp.model)["value_embeds"].comm == "sparse"


@pytest.mark.parametrize("settings, message", [
    ({"value_embed_sparse": True, "value_embeds": False}, "set VALUE_EMBEDS=1"),
])
def test_settings_the_sparse_value_embeddings_cannot_take_are_one_line(settings, message):
    with pytest.raises(T.SetupError, match=message) as error:
        T.check_hyperparameters(T.Hyperparameters.of(**settings))
    assert "\n" not in str(error.value)
    T.check_hyperparameters(T.Hyperparameters.of(value_embed_sparse=True, device="cuda"))  # graphs at world size 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_compiled_tiny_run_on_the_gpu_trains_with_sparse_value_embeddings_as_with_dense_ones(corpus):
    """Six compiled steps (stages 1 and 2, Adam every other step) and a validation on the GPU, CUDA_GRAPHS=0,
    beside the dense default: the row cache stays a leaf on the device (its .grad fills), nothing dense
    reaches the optimizer, and the losses follow the dense run's (the first the same rows through the cache;
    later ones apart by bf16 rounding and the decay of rows a step missed, T3.20)."""
    runs = {}
    for sparse in (False, True):
        hp = T.Hyperparameters.of(**dict(TINY, device="cuda", compile=True, cuda_graphs=False, rank_slice=True,
                                         value_embed_sparse=sparse),
                                  train_files=str(corpus / "tiny_train_*.bin"), val_files=str(corpus / "tiny_val_*.bin"),
                                  tokenizer_dir=str(corpus))
        T.check_hyperparameters(hp)
        trainer = T.Trainer(hp, 0, 1, torch.device("cuda"), T.RunLog(None))
        loader = T.TrainLoader(hp.data.train_files, 0, 1, torch.device("cuda"), log=lambda _: None)
        for step in range(6):
            trainer.train_step(trainer.schedule.plan(step), loader)
        val_loss, _ = trainer.evaluate(6, max_batches=1)
        runs[sparse] = (trainer.losses[:6].cpu(), val_loss)
    assert trainer.model.ve_cache.is_leaf and trainer.value_table.step_count == 3
    assert (trainer.value_table.last_step[:-1] > 0).sum() > 100 and math.isfinite(runs[True][1])
    torch.testing.assert_close(runs[True][0][0], runs[False][0][0], rtol=0, atol=1e-3)
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=0, atol=5e-2)
    assert abs(runs[True][1] - runs[False][1]) < 5e-2
