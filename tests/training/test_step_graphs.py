"""CUDA graphs of the training step (T5.3): the bookkeeping on the CPU, with a stand-in for
torch.cuda.CUDAGraph that re-runs the captured function and copies its results into the outputs
the capture returned (what a replay does on the GPU: the same kernels on the same addresses);
the capture itself on a GPU (marked gpu). Also the timed loop's host hygiene."""
import gc
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import TINY, free_port

import train_gpt as T


class EagerGraph:
    """CudaGraph's contract on the CPU: capture(fn) returns (fn(), fn()) and keeps the second
    result as the static outputs; replay() runs fn again and copies every tensor of its result into
    them (the accumulating graph returns only the n-gram table's outputs: it adds into the first
    graph's CE and gradients itself)."""

    def capture(self, fn):
        self.fn = fn
        eager, self.outputs = fn(), fn()
        return eager, self.outputs

    def replay(self):
        fresh, _ = torch.utils._pytree.tree_flatten(self.fn())
        static, _ = torch.utils._pytree.tree_flatten(self.outputs)
        for out, new in zip(static, fresh, strict=True):
            if isinstance(out, torch.Tensor):  # the distinct rows are None where loads run outside the graphs
                out.copy_(new)


class DriftingGraph(EagerGraph):
    """A graph whose replay disagrees with eager execution: its CE (or, with `gradient`, that
    gradient) scaled by `factor`."""
    factor, gradient = 1.05, None

    def replay(self):
        super().replay()
        ce, grads, _ = self.outputs
        (ce if self.gradient is None else grads[self.gradient]).mul_(self.factor)


def drifting(factor: float, gradient: str | None = None) -> type:
    return type("Drifting", (DriftingGraph,), {"factor": factor, "gradient": gradient})


def overlapping() -> type:
    """Stand-ins whose memory overlaps as graphs sharing one pool can: the replay of any graph but
    the first captured overwrites the first one's outputs."""
    made = []

    class Overlapping(EagerGraph):
        def capture(self, fn):
            made.append(self)
            return super().capture(fn)

        def replay(self):
            super().replay()
            if self is not made[0]:
                ce, grads, _ = made[0].outputs
                for t in (ce, *grads.values()):
                    t.mul_(1.5)

    return Overlapping


def tiny_hp(corpus, **overrides) -> T.Hyperparameters:
    return T.Hyperparameters.of(**{**TINY, "num_scheduled_iterations": 6, "num_extension_iterations": 1, **overrides},
                                train_files=str(corpus / "tiny_train_*.bin"), val_files=str(corpus / "tiny_val_*.bin"),
                                tokenizer_dir=str(corpus))


def graphed_trainer(hp, graph=EagerGraph) -> T.Trainer:
    """A CPU trainer whose steps replay graphs captured as the warm-up captures them."""
    trainer = T.Trainer(hp, 0, 1, torch.device("cpu"), T.RunLog(None))
    trainer.step_graphs = T.StepGraphs(trainer.training_loss, trainer.model, trainer.grad_accum,
                                       trainer.grad_scale, new_graph=graph)
    trainer.capture_graphs(T.TrainLoader(hp.data.train_files, 0, 1, torch.device("cpu"), log=lambda _: None,
                                         grad_accum=trainer.grad_accum))
    trainer.forward_backward = trainer.step_graphs.run
    return trainer


def train_side_by_side(hp, eager: T.Trainer, graphed: T.Trainer):
    """Every step of the schedule in both trainers on the same batches; the same losses and weights after."""
    loaders = [T.TrainLoader(hp.data.train_files, 0, 1, torch.device("cpu"), log=lambda _: None) for _ in range(2)]
    for step in range(eager.schedule.total_steps):
        plan = eager.schedule.plan(step)
        eager.train_step(plan, loaders[0])
        graphed.train_step(plan, loaders[1])
    torch.testing.assert_close(graphed.losses, eager.losses, rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(eager.model.named_parameters(), graphed.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_graphed_steps_train_exactly_as_eager_ones(corpus):
    """Every stage, Adam and non-Adam steps (the kept gradient of T2.7 must survive the next
    replay), the untie step: the same losses and weights as the eager steps. Then the address
    check: a reset in place passes, a replaced tensor stops the run."""
    hp = tiny_hp(corpus, rank_slice=True)
    eager = T.Trainer(hp, 0, 1, torch.device("cpu"), T.RunLog(None))
    graphed = graphed_trainer(hp)
    # graph stages 0-2 and the extension's, 4 (the taper row, 3, has no step in a 6-step schedule)
    assert sorted(graphed.step_graphs.steps) == [(s, adam) for s in (0, 1, 2, 4) for adam in (False, True)][:7]
    assert all(p.grad is None for p in graphed.model.parameters())  # the capture left no gradients
    train_side_by_side(hp, eager, graphed)
    graphed.model.load_state_dict(eager.model.state_dict())  # a reset as the warm-up's: copies in place
    graphed.step_graphs.check_addresses()
    graphed.model.rope_cos = graphed.model.rope_cos.clone()  # a tensor the graphs read, replaced
    with pytest.raises(T.GraphMismatch, match="rope_cos is no longer at the address"):
        graphed.step_graphs.check_addresses()


def test_accumulated_micro_batches_sum_their_gradients_as_eager_backward_does(corpus):
    """Gradient accumulation (fewer GPUs than ranks): the first graph writes a micro-batch's CE and
    gradients, the accumulating graph adds each further one's into them."""
    hp = tiny_hp(corpus, rank_slice=True)
    trainer = T.Trainer(hp, 0, 1, torch.device("cpu"), T.RunLog(None))
    graphs = T.StepGraphs(trainer.training_loss, trainer.model, 2, 0.5, new_graph=EagerGraph)
    plan = trainer.schedule.plan(0)
    loader = lambda: T.TrainLoader(hp.data.train_files, 0, 1, torch.device("cpu"), log=lambda _: None,
                                   grad_accum=2)
    weights = trainer.target_weights[0]
    graphs.capture(plan, trainer.stage_execution[0], loader().next_batch(plan.tokens_per_rank, plan.shape.max_seq_len),
                   weights)
    ce = graphs.run(plan, loader(), weights)
    got = {name: p.grad.clone() for name, p in trainer.model.named_parameters()}
    trainer.model.zero_grad(set_to_none=True)
    batches, expected_ce = loader(), 0.0
    for _ in range(2):
        batch = batches.next_batch(plan.tokens_per_rank, plan.shape.max_seq_len)
        loss, step_ce = trainer.training_loss(*batch, plan.shape, trainer.stage_execution[0], weights, 0.5)
        loss.backward()
        expected_ce += step_ce.item() / 2
    assert ce.item() == pytest.approx(expected_ce, rel=1e-6)
    static = graphs.steps[T.StepGraphs.key(plan)]  # the loader wrote the last micro-batch into the graph's buffers
    assert torch.equal(static.tokens[:-1], batch[0]) and torch.equal(static.tokens[1:], batch[1])
    assert torch.equal(static.cu_seqlens, batch[2])
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_graphed_steps_with_the_ngram_table_train_as_eager_ones(corpus):
    """The n-gram table under the step graphs (T3.19): each graph loads its micro-batch's rows (a graph that read
    the capture's rows would train on them) and leaves the cache's gradient, which the table takes after each replay; every step's loss, the weights and
    the table as eager steps leave them. The table's state is among what the graphs read."""
    hp = tiny_hp(corpus, rank_slice=True, ngram_rows=3001)
    eager = T.Trainer(hp, 0, 1, torch.device("cpu"), T.RunLog(None))
    graphed = graphed_trainer(hp)
    table = graphed.step_graphs.ngram
    assert table is graphed.ngram is graphed.model.ngram
    assert table.kept == [] and table.step_count == 0  # the capture's loads and replays kept nothing, updated nothing
    train_side_by_side(hp, eager, graphed)
    assert eager.ngram.step_count == table.step_count > 0 and torch.equal(eager.ngram.last_step, table.last_step)
    torch.testing.assert_close(table.weight, eager.ngram.weight, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(table.row_sq, eager.ngram.row_sq, rtol=1e-4, atol=1e-8)
    graphed.ngram.weight = graphed.ngram.weight.clone()  # a table tensor the graphs read, replaced
    with pytest.raises(T.GraphMismatch, match="ngram.weight is no longer at the address"):
        graphed.step_graphs.check_addresses()


def test_accumulated_micro_batches_keep_their_own_rows(corpus):
    """With gradient accumulation each micro-batch's rows and row gradients reach the table as they are (the
    accumulating graph's own outputs, not summed into the first's), as eager micro-batches keep them; three
    micro-batches, so the accumulating graph replays twice and its second replay must not rewrite the rows
    its first one handed over."""
    hp = tiny_hp(corpus, rank_slice=True, ngram_rows=3001)
    trainer = T.Trainer(hp, 0, 1, torch.device("cpu"), T.RunLog(None))
    micro_batches = 3
    graphs = T.StepGraphs(trainer.training_loss, trainer.model, micro_batches, 1 / micro_batches,
                          new_graph=EagerGraph)
    plan, weights = trainer.schedule.plan(0), trainer.target_weights[0]
    loader = lambda: T.TrainLoader(hp.data.train_files, 0, 1, torch.device("cpu"), log=lambda _: None,
                                   grad_accum=micro_batches)
    graphs.capture(plan, trainer.stage_execution[0], loader().next_batch(plan.tokens_per_rank, plan.shape.max_seq_len),
                   weights)
    graphs.run(plan, loader(), weights)
    got, trainer.ngram.kept = trainer.ngram.kept, []
    batches = loader()
    for _ in range(micro_batches):
        inputs, targets, cu_seqlens = batches.next_batch(plan.tokens_per_rank, plan.shape.max_seq_len)
        distinct = trainer.ngram.load(inputs)
        loss, _ = trainer.training_loss(inputs, targets, cu_seqlens, plan.shape, trainer.stage_execution[0], weights,
                                        1 / micro_batches)
        loss.backward()
        trainer.ngram.keep_gradient(distinct)
    assert len(got) == len(trainer.ngram.kept) == micro_batches
    assert not torch.equal(got[1][0], got[2][0])  # the accumulating graph's two replays, two row sets
    for (rows, grad), (eager_rows, eager_grad) in zip(got, trainer.ngram.kept):
        assert torch.equal(rows, eager_rows)
        torch.testing.assert_close(grad, eager_grad, rtol=1e-5, atol=1e-6)


def test_graphed_steps_with_sampled_cross_entropy_sweep_each_steps_candidates(corpus):
    """With a candidate budget (T4.6) the trainer sets the model's candidate_step, which the graphs
    read, before each step's micro-batches: the same losses as eager steps, step for step."""
    budgets = T.replace_stage_columns(TINY["stages"], ce_candidates=(1024, 1024, 1024, 0, 0))
    hp = tiny_hp(corpus, rank_slice=True, stop_after=2, stages=budgets)
    eager, graphed = T.Trainer(hp, 0, 1, torch.device("cpu"), T.RunLog(None)), graphed_trainer(hp)
    loaders = [T.TrainLoader(hp.data.train_files, 0, 1, torch.device("cpu"), log=lambda _: None) for _ in range(2)]
    for step in range(2):
        plan = eager.schedule.plan(step)
        eager.train_step(plan, loaders[0])
        graphed.train_step(plan, loaders[1])
        assert graphed.model.candidate_step.item() == step
    torch.testing.assert_close(graphed.losses, eager.losses, rtol=1e-5, atol=1e-6)


def test_a_graph_unlike_eager_execution_stops_the_warm_up_naming_what_differs(corpus):
    hp = tiny_hp(corpus, rank_slice=True)
    with pytest.raises(T.GraphMismatch, match=r"stage 1 \(non-Adam step\) gives CE .* eager execution gives"):
        graphed_trainer(hp, graph=drifting(1.05))
    with pytest.raises(T.GraphMismatch, match=r"gives lm_head's gradient norm"):
        graphed_trainer(hp, graph=drifting(1.10, "lm_head"))
    # a gradient norm 3 % off is rounding a graph's other memory layout can cause (a bf16 scalar's
    # norm moved 1.3 % on an H100): inside the gradients' 5 %, not the CE's 1 %
    trainer = graphed_trainer(hp.replace(stop_after=1), graph=drifting(1.03, "lm_head"))  # one key
    assert 0.5 < trainer.step_graphs.worst_share < 1
    assert trainer.step_graphs.worst_where == "lm_head's gradient norm, stage 1"  # named in the log's capture line


def test_graphs_whose_replays_overwrite_a_kept_gradient_stop_the_warm_up(corpus):
    """A non-Adam step's gradient waits for the next Adam step (T2.7) while other graphs replay:
    the warm-up replays them all after the captures and stops if a kept gradient changed."""
    hp = tiny_hp(corpus, rank_slice=True)
    with pytest.raises(T.GraphMismatch, match=r"overwrite a gradient kept for the next Adam step \(stage 1's non-Adam"):
        graphed_trainer(hp, graph=overlapping())


def test_non_adam_graphs_are_captured_first_in_stage_order():
    """Captured first, the kept gradients are live during every later capture, so no graph that
    replays while they are kept can hold memory there."""
    keys = [(0, False), (0, True), (1, True), (1, False), (2, True), (2, False)]
    assert T.StepGraphs.capture_order(keys) == [(0, False), (1, False), (2, False), (0, True), (1, True), (2, True)]


def _mismatch_worker(rank: int, world: int, port: int, corpus, out_path: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        hp = tiny_hp(corpus, stop_after=1)
        trainer = T.Trainer(hp, rank, world, torch.device("cpu"), T.RunLog(None))
        trainer.step_graphs = T.StepGraphs(trainer.training_loss, trainer.model, trainer.grad_accum, trainer.grad_scale,
                                           new_graph=drifting(1.05) if rank == 1 else EagerGraph,
                                           max_over_ranks=trainer.max_over_ranks)
        try:
            trainer.capture_graphs(T.TrainLoader(hp.data.train_files, rank, world, torch.device("cpu"),
                                                 log=lambda _: None, grad_accum=trainer.grad_accum))
            outcome = "captured"
        except T.GraphMismatch as e:
            outcome = str(e)
        with open(f"{out_path}.{rank}", "w") as f:
            f.write(outcome)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_a_mismatch_on_one_rank_stops_every_rank_at_the_same_check(corpus, tmp_path):
    """Rank 1's graph drifts, rank 0's matches: both stop at that capture's check (no rank goes on
    into a collective that the other never joins), rank 1 naming the value, rank 0 pointing at it."""
    out_path = str(tmp_path / "outcome")
    mp.spawn(_mismatch_worker, args=(2, free_port(), corpus, out_path), nprocs=2, join=True)
    ranks = [Path(f"{out_path}.{rank}").read_text() for rank in range(2)]
    assert "stage 1 (non-Adam step) differs from eager execution on another rank" in ranks[0], ranks[0]
    assert "stage 1 (non-Adam step) gives CE" in ranks[1], ranks[1]


def test_the_step_runner_is_decided_once_and_the_log_says_which(corpus):
    """Graphs need a CUDA device, CUDA_GRAPHS=1 and the warm-up that captures them; otherwise the timed steps run
    eagerly and the log's `step runner:` line says so and why (with WARMUP=0 the plan once claimed graphs while
    the run went eager). The trainer's runner is fixed at construction, before any step."""
    hp, cuda, cpu = tiny_hp(corpus, rank_slice=True, warmup=True), torch.device("cuda"), torch.device("cpu")
    assert T.step_runner(hp, cuda) == (True, "CUDA graphs of each step's forward and backward, captured in the "
                                             "warm-up (T5.3)")
    assert T.step_runner(hp.replace(warmup=False), cuda) == (
        False, "eager steps (the warm-up captures the CUDA graphs, and WARMUP=0 skips it)")
    assert T.step_runner(hp.replace(cuda_graphs=False), cuda) == (False, "eager steps (CUDA_GRAPHS=0)")
    assert T.step_runner(hp, cpu) == (False, "eager steps (CUDA graphs need a CUDA device, not cpu)")
    lines = []
    trainer = T.Trainer(hp, 0, 1, cpu, lambda text, console=True: lines.append(text))
    assert trainer.step_graphs is None and trainer.forward_backward == trainer.eager_forward_backward
    assert "step runner: eager steps (CUDA graphs need a CUDA device, not cpu)" in lines


def test_the_collector_is_off_on_the_clock_and_collects_after(corpus):
    trainer = T.Trainer(tiny_hp(corpus, rank_slice=True, stop_after=2, val_loss_every=0), 0, 1,
                        torch.device("cpu"), T.RunLog(None))
    enabled, step = [], trainer.train_step
    trainer.train_step = lambda plan, loader: (enabled.append(gc.isenabled()), step(plan, loader))[1]
    trainer.run()
    assert enabled and not any(enabled) and gc.isenabled() and gc.get_freeze_count() == 0


def test_the_timed_loop_waits_for_the_gpu_only_at_validations_and_stage_edges(corpus):
    """The host waits for the GPU at the clock's start, before and after each validation, and before the step
    line that starts each stage (so per-stage ms/step are the GPU's when the graphed host runs ahead), nowhere
    else; each wait is named by the steps trained before it."""
    trainer = T.Trainer(tiny_hp(corpus, rank_slice=True, val_loss_every=4), 0, 1, torch.device("cpu"),
                        T.RunLog(None))
    trained, waits, step = [], [], trainer.train_step
    trainer.train_step = lambda plan, loader: (trained.append(plan.step), step(plan, loader))[1]
    trainer._sync = lambda: waits.append(len(trained))
    trainer.run()
    edges, validations = trainer.schedule.stage_starts[1:], trainer.validation_steps()
    assert len(edges) >= 3 and len(trained) == trainer.last_step == trainer.schedule.total_steps
    expected = [0]
    for s in range(trainer.last_step + 1):
        expected += [s, s] if s in validations else []
        expected += [s + 1] if s + 1 in edges and s < trainer.last_step else []
    assert waits == expected


def test_the_run_log_buffers_step_lines_until_a_console_line(tmp_path):
    path = tmp_path / "run.txt"
    log = T.RunLog(str(path))
    log("step:1/10 train_time:1ms step_avg:1.00ms", console=False)
    assert path.read_text() == ""  # no write per step line
    log("step:2/10 val_loss:3.0 train_time:2ms step_avg:1.00ms")
    assert path.read_text().splitlines() == ["step:1/10 train_time:1ms step_avg:1.00ms",
                                             "step:2/10 val_loss:3.0 train_time:2ms step_avg:1.00ms"]
    log.file.close()



def losses_without_host_syncs(trainer: T.Trainer) -> torch.Tensor:
    """Every step's loss of a warmed-up CUDA trainer, the steps after the first two run with
    torch.cuda.set_sync_debug_mode("error"): any wait for the GPU fails the test."""
    loader = T.TrainLoader(trainer.hp.data.train_files, 0, 1, torch.device("cuda"), log=lambda _: None,
                           grad_accum=trainer.grad_accum)
    for step in range(2):
        trainer.train_step(trainer.schedule.plan(step), loader)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(2, trainer.schedule.total_steps):
            trainer.train_step(trainer.schedule.plan(step), loader)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return trainer.losses.clone()


@pytest.mark.parametrize("rank_slice", [True, False])  # one micro-batch; eight accumulated
@pytest.mark.parametrize("ce_candidates", [0, 1024], ids=["full_softmax", "sampled"])  # T4.6
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_cuda_graphs_train_as_eager_steps_without_host_syncs(corpus, rank_slice, ce_candidates):
    """The warm-up captures every key's graph on the GPU (each checked against eager there); the
    graphed steps then train as the eager ones do, within bf16 tolerance, and never wait for the GPU;
    with a candidate budget in the three stages too (each step's sweep read from the device)."""
    budgets = T.replace_stage_columns(TINY["stages"], ce_candidates=(ce_candidates,) * 3 + (0, 0))
    hp = tiny_hp(corpus, device="cuda", rank_slice=rank_slice, warmup=True, num_scheduled_iterations=12,
                 num_extension_iterations=2, stages=budgets)
    cuda = torch.device("cuda")
    runs = {}
    for graphs in (False, True):
        trainer = T.Trainer(hp.replace(cuda_graphs=graphs), 0, 1, cuda, T.RunLog(None))
        assert (trainer.step_graphs is not None) == graphs
        assert trainer.forward_backward == (trainer.step_graphs.run if graphs else trainer.eager_forward_backward)
        trainer.warmup()
        runs[graphs] = losses_without_host_syncs(trainer)
    assert torch.isfinite(runs[True]).all()
    torch.testing.assert_close(runs[True], runs[False], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rank_slice", [True, False])  # one micro-batch; eight accumulated, each with its rows
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_cuda_graphs_with_the_ngram_table_train_as_eager_steps_without_host_syncs(corpus, rank_slice):
    """The n-gram table under the step graphs (T3.19): the loads captured in each step graph, the table's update
    eager between replays; the steps train as eager ones, within bf16 tolerance, and never wait for the GPU."""
    hp = tiny_hp(corpus, device="cuda", rank_slice=rank_slice, warmup=True, num_scheduled_iterations=12,
                 num_extension_iterations=2, ngram_rows=3001)
    T.check_ngram_rows(hp, 1)
    cuda = torch.device("cuda")
    runs = {}
    for graphs in (False, True):
        trainer = T.Trainer(hp.replace(cuda_graphs=graphs), 0, 1, cuda, T.RunLog(None))
        assert (trainer.step_graphs is not None) == graphs
        trainer.warmup()
        runs[graphs] = losses_without_host_syncs(trainer)
    assert torch.isfinite(runs[True]).all()
    torch.testing.assert_close(runs[True], runs[False], rtol=2e-2, atol=2e-2)
