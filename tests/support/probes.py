"""A probe op for tests of pipelined execution: it calls back from inside a stage's forward
and backward, so a test can see which thread runs what, inject faults and stall actions."""

import torch
import torch.nn.functional as F

import poptorch_lite as poptorch
from poptorch_lite.annotations import is_tracing

SCHEDULES = ["sequential", "grouped", "interleaved", "gpipe"]
CONCURRENT = ["grouped", "interleaved", "gpipe"]

# A probe op: calls PROBE(kind, stage, micro-batch) in its forward ("F") and backward ("B").
# Rows of the input carry their micro-batch index in column 0.
PROBE = {"fn": None}


@torch.library.custom_op("poptorch_lite_test::probe", mutates_args=())
def probe(x: torch.Tensor, stage: int) -> torch.Tensor:
    if PROBE["fn"] is not None and not is_tracing():
        PROBE["fn"]("F", stage, int(x[0, 0]))
    return x.clone()


@probe.register_fake
def _(x, stage):
    return torch.empty_like(x)


def _probe_backward(ctx, grad):
    if PROBE["fn"] is not None:
        PROBE["fn"]("B", ctx.stage, int(ctx.index))
    return grad, None


def _probe_setup(ctx, inputs, output):
    ctx.stage, ctx.index = inputs[1], inputs[0][0, 0]


probe.register_autograd(_probe_backward, setup_context=_probe_setup)


class Probed(torch.nn.Module):
    """S stages on IPUs 0..S-1; each passes the micro-batch index column through a probe.

    ``stateful=True`` gives every stage a BatchNorm (buffers) and dropout (random state).
    """

    def __init__(self, stages=2, width=4, stateful=False):
        super().__init__()
        self.fcs = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(stages))
        self.norms = torch.nn.ModuleList(
            torch.nn.BatchNorm1d(width) if stateful else torch.nn.Identity()
            for _ in range(stages))
        self.p = 0.25 if stateful else 0.0

    def forward(self, x, y):
        index = x[:, :1]
        h = x
        for s, (fc, norm) in enumerate(zip(self.fcs, self.norms)):
            with poptorch.Block(f"b{s}", ipu_id=s):
                h = F.dropout(norm(fc(h)), self.p, self.training) if self.p else fc(h)
                h = probe(torch.cat([index, h[:, 1:]], dim=1), s)
                if s == len(self.fcs) - 1:
                    loss = F.mse_loss(h, y)
        return h, loss


def probed_batch(m, width=4, rows=2):
    x = torch.randn(m * rows, width)
    x[:, 0] = torch.arange(m).repeat_interleave(rows).float()
    return x, torch.randn(m * rows, width)


def options(schedule, G, D=1, recompute=False):
    opts = poptorch.Options().deviceIterations(D).setExecutionStrategy(
        poptorch.PipelinedExecution(schedule=schedule))
    opts.Training.gradientAccumulation(G)
    if recompute:
        opts._Popart.set("autoRecomputation", 3)
    return opts
