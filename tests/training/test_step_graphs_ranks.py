"""CUDA graphs of the training step at world size 2 (gloo, CPU), with the stand-in graphs of
test_step_graphs.py: the graphs' static gradients go through the optimizer's reductions (the flat
all-reduce of the replicated parameters, the reduce-scatters, the gradients kept for the next Adam
step) exactly as eager gradients do, over a tiny run that crosses the stage edges and the untie."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import TINY, free_port
from test_step_graphs import EagerGraph, tiny_hp

import train_gpt as T


def _worker(rank: int, world: int, port: int, corpus, out_path: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)  # two processes on CI's two cores
    try:
        # in CI's time: one micro-batch per rank (main() refuses RANK_SLICE at two ranks, the trainer
        # plans two slices a step; accumulation is tested at one rank), half the tiny batches, stopped
        # after the untie (step 5, stage 3)
        stages = T.replace_stage_columns(TINY["stages"], batch_tokens=(1024, 2048, 2048, 2048, 2048))
        hp = tiny_hp(corpus, rank_slice=True, stages=stages, stop_after=6, ngram_rows=3001)
        cpu = torch.device("cpu")
        eager = T.Trainer(hp, rank, world, cpu, T.RunLog(None))
        graphed = T.Trainer(hp, rank, world, cpu, T.RunLog(None))
        graphed.step_graphs = T.StepGraphs(graphed.training_loss, graphed.model, graphed.grad_accum,
                                           graphed.grad_scale, new_graph=EagerGraph,
                                           max_over_ranks=graphed.max_over_ranks)
        graphed.capture_graphs(T.TrainLoader(hp.data.train_files, rank, world, cpu, log=lambda _: None,
                                             grad_accum=graphed.grad_accum))
        graphed.forward_backward = graphed.step_graphs.run
        loaders = [T.TrainLoader(hp.data.train_files, rank, world, cpu, log=lambda _: None,
                                 grad_accum=eager.grad_accum) for _ in range(2)]
        plans = [eager.schedule.plan(step) for step in range(eager.last_step)]
        for plan in plans:
            eager.train_step(plan, loaders[0])
            graphed.train_step(plan, loaders[1])
        differences = {name: (p.detach().float() - q.detach().float()).abs().max().item()
                       for (name, p), q in zip(eager.model.named_parameters(), graphed.model.parameters())}
        a, b = eager.ngram, graphed.ngram
        table = (a.step_count, b.step_count, (a.weight.float() - b.weight.float()).abs().max().item(),
                 torch.equal(a.last_step, b.last_step))
        torch.save({"eager": eager.losses.clone(), "graphed": graphed.losses.clone(), "differences": differences,
                    "untie": any(plan.untie for plan in plans), "stages": {plan.stage for plan in plans},
                    "table": table}, f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_graphed_steps_at_two_ranks_train_as_eager_steps(corpus, tmp_path):
    """Each rank owns half the n-gram table (T3.19); each graph loads its micro-batch's rows from their owners (the
    exchange of fixed-size slots) into the cache it reads."""
    out_path = str(tmp_path / "ranks")
    mp.spawn(_worker, args=(2, free_port(), corpus, out_path), nprocs=2, join=True)
    for rank in range(2):
        result = torch.load(f"{out_path}.{rank}")
        assert result["untie"] and result["stages"] == {0, 1, 2}
        torch.testing.assert_close(result["graphed"], result["eager"], rtol=1e-5, atol=1e-6)
        assert max(result["differences"].values()) < 1e-5, result["differences"]
        eager_steps, graphed_steps, difference, same_clock = result["table"]
        assert eager_steps == graphed_steps > 0 and same_clock and difference < 1e-5, result["table"]
