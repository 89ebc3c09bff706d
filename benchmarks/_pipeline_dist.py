"""The torch.distributed.pipelining baseline of benchmarks/pipeline.py: the same MLP in 2 processes.

:class:`TorchPipeline` starts one process per stage (gloo on loopback, one
intra-op thread each) and then runs one timed training step at a time when
asked, so that its repetitions interleave with the in-process variants of
benchmarks/pipeline.py. Between steps the ranks block on a queue and use no CPU.

    pipe = TorchPipeline(["gpipe", "1f1b"], width=1024, layers=8, micro_batch=32, m=8, lr=1e-4)
    wall_s, cpu_s = pipe.step("1f1b")   # m micro-batches through both stages + SGD step
    pipe.close()

Rank s holds layers [s*L/S, (s+1)*L/S) as a ``PipelineStage``; rank 0 feeds the
inputs and rank S-1 computes the MSE loss against the targets. The schedules
average the micro-batch gradients (``scale_grads=True``), like the other variants.
"""

import os
import queue
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
STEP_TIMEOUT_S = 600  # a rank that has not answered by then has hung


def mlp(width, layers):
    """The benchmark's layers: ``layers`` x (Linear(width, width), ReLU), as one Sequential.

    Example:
        >>> len(mlp(16, 4))  # 4 Linear + 4 ReLU
        8
    """
    return torch.nn.Sequential(*[mod for _ in range(layers)
                                 for mod in (torch.nn.Linear(width, width), torch.nn.ReLU())])


def stage_slice(s, S, layers):
    """The modules of stage ``s`` of ``S`` in ``mlp(width, layers)``: whole Linear+ReLU pairs,
    the first ``layers // S`` pairs per stage, the remainder on the last stage.

    Example:
        >>> stage_slice(0, 2, 8), stage_slice(1, 2, 8)
        (slice(0, 8, None), slice(8, 16, None))
    """
    per = 2 * (layers // S)
    return slice(s * per, 2 * layers if s == S - 1 else (s + 1) * per)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(s, S, port, names, width, layers, micro_batch, m, lr, commands, results):
    """One rank: build its stage and schedules, then run the steps it is sent until None."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback, whatever the hostname says
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=s, world_size=S)
    torch.manual_seed(0)  # same weights as the parent's model, which is built the same way
    part = mlp(width, layers)[stage_slice(s, S, layers)]
    x, y = torch.randn(m * micro_batch, width), torch.randn(m * micro_batch, width)
    opt = torch.optim.SGD(part.parameters(), lr=lr)
    schedules = {name: SCHEDULES[name](PipelineStage(part, s, S, torch.device("cpu")), m,
                                       loss_fn=F.mse_loss)
                 for name in names}
    while (name := commands.get(timeout=STEP_TIMEOUT_S)) is not None:
        dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        if s == 0:
            schedules[name].step(x)  # split into m micro-batches along dim 0
        elif s == S - 1:
            schedules[name].step(target=y, losses=[])
        else:
            schedules[name].step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        results.put((s, time.perf_counter() - t, time.process_time() - c))
    dist.destroy_process_group()


class TorchPipeline:
    """``S`` processes running ``mlp(width, layers)`` split into ``S`` stages.

    Args:
        names: schedules to build, keys of :data:`SCHEDULES` ("gpipe", "1f1b").
        width, layers, micro_batch, m, lr: the model, micro-batch size, micro-batches
            per step and SGD learning rate.
        S: number of stages (= processes).

    Example:
        >>> pipe = TorchPipeline(["1f1b"], width=64, layers=4, micro_batch=4, m=4, lr=1e-4)
        >>> wall_s, cpu_s = pipe.step("1f1b"); pipe.close()
    """

    def __init__(self, names, width, layers, micro_batch, m, lr, S=2):
        ctx = mp.get_context("spawn")
        self.S = S
        self._commands = [ctx.Queue() for _ in range(S)]
        self._results = ctx.Queue()
        port = _free_port()
        self._procs = [ctx.Process(target=_rank_main, daemon=True,
                                   args=(s, S, port, list(names), width, layers, micro_batch, m,
                                         lr, self._commands[s], self._results))
                       for s in range(S)]
        for p in self._procs:
            p.start()

    def step(self, name):
        """Run one training step with schedule ``name`` on all ranks.

        Returns:
            (wall seconds on rank 0 between a barrier before and one after,
            CPU seconds of all ranks together over the same span).

        Raises:
            RuntimeError: a rank died or did not answer within STEP_TIMEOUT_S.
        """
        for q in self._commands:
            q.put(name)
        walls, cpu = {}, 0.0
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while len(walls) < self.S:
            try:
                s, wall, c = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [(s, p.exitcode) for s, p in enumerate(self._procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"torch.distributed.pipelining rank(s) failed during a {name!r} step: "
                        f"(rank, exit code) {dead or 'none dead, timed out'}; see the rank's "
                        f"traceback above") from None
                continue
            walls[s] = wall
            cpu += c
        return walls[0], cpu

    def close(self):
        """Stop the ranks and wait for them."""
        for q in self._commands:
            q.put(None)
        for p in self._procs:
            p.join(timeout=60)
