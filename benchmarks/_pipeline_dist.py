"""The multi-process variants of benchmarks/pipeline.py: a model in 2 processes, one per stage.

:class:`Ranks` starts one process per stage (gloo on loopback, one intra-op
thread each) and then runs one timed training step at a time when asked, so
that its repetitions interleave with the in-process variants of
benchmarks/pipeline.py. Between steps the ranks block on a queue and use no CPU.
Two kinds of ranks:

- ``"torch"``: torch.distributed.pipelining, rank s holding stage s as a
  ``PipelineStage`` (rank 0 feeds the inputs, the last rank computes the loss);
  the schedules average the micro-batch gradients (``scale_grads=True``);
- ``"lite"``: poptorch_lite's ``trainingModel`` with
  ``Options.Distributed.set_ipu_processes``: every rank runs the same wrapped model
  and holds its own stage ([Note: stages in other processes]).

    ranks = Ranks("torch", ["gpipe", "1f1b"], model="mlp", width=1024, layers=8,
                  micro_batch=32, m=8, lr=1e-4)
    wall_s, cpu_s = ranks.step("1f1b")   # m micro-batches through both stages + SGD step
    ranks.close()
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
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV,
                                          ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleLoopedBFS,
                                          ScheduleZBVZeroBubble)

import poptorch_lite as poptorch

# Every torch.distributed.pipelining schedule: one stage per rank, or two per rank in a loop
# (rank r holds stages r and r+S) or a V (stages r and 2S-1-r).
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
             "interleaved1f1b": ScheduleInterleaved1F1B, "loopedbfs": ScheduleLoopedBFS,
             "interleavedzb": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
             "dualpipev": ScheduleDualPipeV}
_STYLE = {"interleaved1f1b": "loop", "loopedbfs": "loop", "interleavedzb": "loop",
          "zbv": "v", "dualpipev": "v"}


def local_stages(name, s, S):
    """The stage indices rank ``s`` holds under torch schedule ``name``, and the stage count.

    Example:
        >>> local_stages("1f1b", 1, 2), local_stages("zbv", 0, 2), local_stages("loopedbfs", 1, 2)
        (([1], 2), ([0, 3], 4), ([1, 3], 4))
    """
    style = _STYLE.get(name)
    if style is None:
        return [s], S
    return ([s, s + S] if style == "loop" else [s, 2 * S - 1 - s]), 2 * S
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


def conv_stages():
    """The MNIST tutorial's conv net as its two pipeline stages (blocks B1+B2, B3+B4):
    conv 10 and conv 20 (each conv, max-pool, ReLU), then Linear(320, 256)+ReLU and
    Linear(256, 10) with log-softmax; the loss is NLL.

    Example:
        >>> first, second = conv_stages()
        >>> second(first(torch.zeros(2, 1, 28, 28))).shape
        torch.Size([2, 10])
    """
    def conv(cin, cout):
        return [torch.nn.Conv2d(cin, cout, 5), torch.nn.MaxPool2d(2), torch.nn.ReLU()]
    first = torch.nn.Sequential(*conv(1, 10), *conv(10, 20), torch.nn.Flatten())
    second = torch.nn.Sequential(torch.nn.Linear(320, 256, bias=False), torch.nn.ReLU(),
                                 torch.nn.Linear(256, 10), torch.nn.LogSoftmax(1))
    return first, second


GPT2_SEQ = 128  # bytes per window of benchmarks/gpt2.py


def gpt2(width, layers, seq_len=GPT2_SEQ):
    """benchmarks/gpt2.py's model: transformers' GPT-2 from a config (vocabulary 256: bytes),
    built from seed 0; heads of width 64 as in GPT-2, at least 4."""
    import transformers  # the .[hf] extra; only the GPT-2 benchmark needs it
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=seq_len, n_embd=width,
                                     n_layer=layers, n_head=max(4, width // 64),
                                     bos_token_id=0, eos_token_id=0,
                                     use_cache=False)
    return transformers.GPT2LMHeadModel(config)


class _GPT2Part(torch.nn.Module):
    """Layers ``lo:hi`` of a GPT-2 as a stage of its own: the first part also embeds the
    tokens, the last also applies the final norm and the (untied copy of the) output head.
    Attention is causal as in the model (no mask: transformers' SDPA takes ``is_causal``)."""

    def __init__(self, lm, lo, hi, first, last):
        super().__init__()
        import copy
        t = lm.transformer
        self.first, self.last = first, last
        self.embed = torch.nn.ModuleList([t.wte, t.wpe, t.drop]) if self.first else None
        self.blocks = torch.nn.ModuleList(t.h[lo:hi])
        self.head = (torch.nn.ModuleList([t.ln_f, copy.deepcopy(lm.lm_head)]) if self.last
                     else None)

    def forward(self, x):
        if self.first:
            wte, wpe, drop = self.embed
            x = drop(wte(x) + wpe(torch.arange(x.shape[1], device=x.device)))
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.head[1](self.head[0](x))
        return x


def gpt2_loss(logits, ids):
    """transformers' causal LM loss: each position predicts the next byte, mean over tokens."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def stages(model, S, width, layers):
    """The S stage modules of ``model`` ("mlp", "conv" or "gpt2"), built from seed 0."""
    torch.manual_seed(0)
    if model == "conv":
        return list(conv_stages())
    if model == "gpt2":
        lm, per = gpt2(width, layers), layers // S
        return [_GPT2Part(lm, s * per, layers if s == S - 1 else (s + 1) * per, s == 0, s == S - 1)
                for s in range(S)]
    body = mlp(width, layers)
    return [body[stage_slice(s, S, layers)] for s in range(S)]


def batch(model, rows, width, seed=1, seq_len=GPT2_SEQ):
    """One step's inputs and targets."""
    g = torch.Generator().manual_seed(seed)
    if model == "gpt2":  # windows of seq_len bytes, each its own target
        ids = torch.randint(0, 256, (rows, seq_len), generator=g)
        return ids, ids
    if model == "conv":
        return torch.randn(rows, 1, 28, 28, generator=g), torch.randint(0, 10, (rows,), generator=g)
    return torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)


def loss_of(model):
    return {"conv": F.nll_loss, "gpt2": gpt2_loss}.get(model, F.mse_loss)


class Pipelined(torch.nn.Module):
    """The stages of :func:`stages` in blocks "s0", "s1", ... on IPUs 0, 1, ..., with the loss
    in the last, for poptorch_lite."""

    def __init__(self, parts, loss):
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)
        self.loss = loss

    def forward(self, x, y):
        for s, part in enumerate(self.parts):
            with poptorch.Block(f"s{s}", ipu_id=s):
                x = part(x)
                if s == len(self.parts) - 1:
                    return x, self.loss(x, y)


def _torch_rank(s, S, names, model, width, layers, micro_batch, m, lr):
    dist.init_process_group("gloo", rank=s, world_size=S)
    x, y = batch(model, m * micro_batch, width)
    built = {}
    for name in names:  # each schedule its own copy of the model, cut as it needs
        held, n = local_stages(name, s, S)
        parts = stages(model, n, width, layers)
        mine = [PipelineStage(parts[k], k, n, torch.device("cpu")) for k in held]
        opt = torch.optim.SGD([p for k in held for p in parts[k].parameters()], lr=lr)
        cls = SCHEDULES[name]
        schedule = cls(mine if name in _STYLE else mine[0], m, loss_fn=loss_of(model))
        built[name] = (schedule, opt, held, n)

    def step(name):
        schedule, opt, held, n = built[name]
        args = (x,) if 0 in held else ()  # split into m micro-batches along dim 0
        kwargs = dict(target=y, losses=[]) if n - 1 in held else {}
        schedule.step(*args, **kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _lite_rank(s, S, names, model, width, layers, micro_batch, m, lr):
    os.environ.update(RANK=str(s), WORLD_SIZE=str(S), LOCAL_RANK=str(s),
                      LOCAL_WORLD_SIZE=str(S))
    x, y = batch(model, m * micro_batch, width)
    wrapped = {}
    for name in names:
        net = Pipelined(stages(model, S, width, layers), loss_of(model))
        opts = poptorch.Options()
        opts.Training.gradientAccumulation(m)
        opts.setExecutionStrategy(poptorch.PipelinedExecution(
            *[f"s{k}" for k in range(S)], schedule=poptorch.PipelineSchedule.parse(name)))
        opts.Distributed.set_ipu_processes([[k] for k in range(S)])
        wrapped[name] = poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=lr))
        wrapped[name].compile(x, y)  # joins the process group, traces, places

    def step(name):
        wrapped[name](x, y)
    return step


_KINDS = {"torch": _torch_rank, "lite": _lite_rank}


def _rank_main(kind, s, S, port, names, setup, commands, results):
    """One rank: build its stage and schedules, then run the steps it is sent until None."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback, whatever the hostname says
    torch.set_num_threads(1)
    step = _KINDS[kind](s, S, names, **setup)
    while (name := commands.get(timeout=STEP_TIMEOUT_S)) is not None:
        dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        step(name)
        dist.barrier()
        results.put((s, time.perf_counter() - t, time.process_time() - c))
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Ranks:
    """``S`` processes, one stage each, that train one step of a schedule when asked.

    Args:
        kind: "torch" (torch.distributed.pipelining) or "lite" (poptorch_lite).
        names: schedules to build: keys of :data:`SCHEDULES` for "torch", PipelineSchedule
            names for "lite".
        S: number of stages (= processes).
        setup: ``model`` ("mlp" or "conv"), ``width``, ``layers``, ``micro_batch``, ``m``
            (micro-batches per step) and ``lr`` (SGD).

    Example:
        >>> ranks = Ranks("torch", ["1f1b"], model="mlp", width=64, layers=4, micro_batch=4,
        ...               m=4, lr=1e-4)
        >>> wall_s, cpu_s = ranks.step("1f1b"); ranks.close()
    """

    def __init__(self, kind, names, S=2, **setup):
        ctx = mp.get_context("spawn")
        self.S, self.kind = S, kind
        self._commands = [ctx.Queue() for _ in range(S)]
        self._results = ctx.Queue()
        port = _free_port()
        self._procs = [ctx.Process(target=_rank_main, daemon=True,
                                   args=(kind, s, S, port, list(names), setup,
                                         self._commands[s], self._results))
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
                        f"{self.kind} rank(s) failed during a {name!r} step: (rank, exit code) "
                        f"{dead or 'none dead, timed out'}; see the rank's traceback above"
                    ) from None
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
