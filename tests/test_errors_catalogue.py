"""docs/ERRORS.md, row by row: every documented refusal, failure and warning is triggered here.

The tables are parsed out of the document (id, class, message); ``TRIGGERS`` maps each id
to a function that provokes it. A documented message becomes a regex: ``<placeholder>``
matches anything, the rest is literal. Where the contract is "refused before any state
changes", the trigger checks the options object or the model's weights afterwards.
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import gc
import os
import pathlib
import random
import re
import tempfile
import threading
import warnings
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import poptorch_lite as poptorch
from poptorch_lite import custom_ops, errors, keras
from poptorch_lite import optim
from poptorch_lite.compiler import retarget
from poptorch_lite.runtime.devices import resolve_devices
from poptorch_lite.runtime.streams import CpuStream
from poptorch_lite.runtime.schedule import Action, Schedule, validate
from poptorch_lite.runtime.schedule_kinds import build
from poptorch_lite.profiling.timeline import Span, Timeline

from models import CallsAModule
from patience import WATCHDOG_S, hung, interrupt_caller, limit
from processes import free_port, start

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "ERRORS.md"
P = poptorch.PipelineSchedule


# -- the document --------------------------------------------------------------------------


def _cells(line: str) -> list:
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def doc_rows() -> dict:
    """``{id: (class name, message)}`` for every table row whose id is E-... or W-...."""
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if re.match(r"\|\s*[EW]-[A-Z]+-\d+\s*\|", line):
            cells = _cells(line)
            assert cells[0] not in rows, f"{cells[0]} appears twice in {DOC.name}"
            message = re.fullmatch(r"`(.*?)`.*", cells[3])
            assert message, f"{cells[0]}: the message column must start with `text`"
            rows[cells[0]] = (cells[1], message.group(1))
    return rows


def pattern(message: str) -> str:
    """The documented text as a regex: ``<placeholder>`` matches anything."""
    return ".*?".join(re.escape(part) for part in re.split(r"<[^<>]*>", message))


def documented_class(name: str) -> type:
    return getattr(errors, name, None) or getattr(builtins, name)


ROWS = doc_rows()


# -- helpers -------------------------------------------------------------------------------


@contextlib.contextmanager
def options_unchanged(o: poptorch.Options):
    """The refusal must leave ``o`` exactly as it was (values and frozen state)."""
    before, frozen = repr(o.toDict()), o.is_frozen
    try:
        yield o
    finally:
        assert repr(o.toDict()) == before and o.is_frozen == frozen, "the options changed"


def refuse(setter):
    """Call ``setter(Options())`` and check the options are unchanged after it raises."""
    o = poptorch.Options()
    with options_unchanged(o):
        setter(o)


@contextlib.contextmanager
def weights_unchanged(model: torch.nn.Module):
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    try:
        yield
    finally:
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), f"{k} changed"
        assert torch.equal(torch.get_rng_state(), rng), "the CPU RNG state changed"


class Two(torch.nn.Module):
    """Two Linear layers in blocks ``ids`` on IPUs ``ipus``; ``tail`` says what follows."""

    def __init__(self, ids=("a", "b"), ipus=(0, 1), tail="mse", bn=False):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4) if bn else None
        self.ids, self.ipus, self.tail = ids, ipus, tail
        self.g = torch.Generator().manual_seed(0)
        self.calls, self.scale = 0, 1.0
        self.count = torch.zeros(())  # a tensor kept as a plain attribute

    def forward(self, x, y):
        with poptorch.Block(self.ids[0], ipu_id=self.ipus[0]):
            h = self.l1(x)
            if self.tail == "trace":
                h = h @ torch.ones(3, 3)
            if self.tail == "item":
                h = h * h.sum().item()
            if self.tail == "python_random":
                h = h * random.random()
            if self.tail == "counter":  # a Python attribute the forward changes
                self.calls += 1
            if self.tail == "scaled":  # a Python attribute the forward reads
                h = h * self.scale
            if self.tail == "count":  # written in place: a plain tensor attribute
                h = h * self.count.add_(1)
            if self.tail == "own_mode":  # the model's own train/eval flag
                h = torch.nn.functional.dropout(h, 0.5, self.training)
            if self.tail == "packed":  # by lengths from the data
                torch.nn.utils.rnn.pack_padded_sequence(
                    h.unsqueeze(1).repeat(1, 2, 1), (y[:, 0] > 0).long().cpu() + 1,
                    batch_first=True, enforce_sorted=False)
            if self.tail.startswith("generator"):  # a generator of the model's own
                g = self.g if self.tail != "generator_made" else torch.Generator()
                if self.tail == "generator_seeded":
                    g.manual_seed(1)
                h = h + torch.randn(h.shape, generator=g)
            if self.tail == "function_given_module":
                h = CallsAModule.apply(h, self.l1)
            if self.tail == "one_hot":
                h = h + F.one_hot(x.argmax(1))
        if self.tail == "outside":
            return F.mse_loss(self.l2(h), y)  # after the Block scope closed
        with poptorch.Block(self.ids[1], ipu_id=self.ipus[1]):
            if self.tail == "reuse_l1":  # l1 in both stages
                h = self.l1(h)
            out = self.l2(h if self.bn is None else self.bn(h))
            if self.tail == "del_buffer":
                del self.bn.running_mean
            if self.tail == "reassign_buffer":
                self.bn.running_mean = self.bn.running_mean * 2
            if self.tail == "write_statistic":  # the model's write, not BatchNorm's update
                self.bn.running_mean.mul_(0.5)
            if self.tail == "none":
                return out
            if self.tail == "none_mse":  # trains on a loss it does not return
                F.mse_loss(out, y)
                return out
            if self.tail == "two":
                return F.mse_loss(out, y), F.l1_loss(out, y)
            if self.tail == "total_and_part":  # which one a loop would train: unknown
                part = F.mse_loss(out, y)
                return out, part + out.abs().mean(), part
            return out, F.mse_loss(out, y)



def keras_model(spe=4, G=1, schedule=P.Grouped, stages=1, ipus=None, loss="mse"):
    """A compiled Keras Sequential of three layers, on ``stages`` stages, in an IPU scope."""
    config = keras.IPUConfig()
    config.auto_select_ipus = ipus or stages
    with keras.IPUStrategy(config).scope():
        model = keras.Sequential([torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)])
    if stages == 2:
        model.set_pipeline_stage_assignment([0, 0, 1])
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=G,
                                 pipeline_schedule=schedule)
    if loss is not None:
        model.compile("sgd", loss, steps_per_execution=spe)
    return model


class Endless(torch.utils.data.IterableDataset):
    """``dataset.repeat()``: the samples of (x, y) again and again, with no length."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        while len(self.x):
            yield from zip(self.x, self.y)


class Finite(Endless):
    """The samples of (x, y) once, with no length."""

    def __iter__(self):
        return zip(self.x, self.y)


def keras_refuses(call, n=32, strict=True, **kw):
    """``call(model, x, y)`` must raise and leave weights, optimizer, settings, wrappers and RNG
    as they were (``strict=False``: a callback raised after fit began; the weights only)."""
    model = keras_model(**kw)
    x, y = torch.randn(n, 4), torch.randn(n, 2)
    settings = (model._ipu, model._spe, dict(model._wrappers), model.optimizer)
    before = copy.deepcopy(model.module.state_dict())
    with weights_unchanged(model.module) if strict else contextlib.nullcontext():
        try:
            call(model, x, y)
        finally:
            assert not strict or settings == (model._ipu, model._spe, dict(model._wrappers),
                                              model.optimizer)
            assert all(torch.equal(v, before[k]) for k, v in model.module.state_dict().items())


def opts(strategy=None, G=1, D=1, R=1):
    o = poptorch.Options().deviceIterations(D).replicationFactor(R)
    o.Training.gradientAccumulation(G)
    return o.setExecutionStrategy(strategy or poptorch.ShardedExecution())


def replaced_parameter():
    """A parameter replaced between calls: the next call is refused, changing nothing."""
    model = Two()
    train = poptorch.trainingModel(model, opts(), torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        train(torch.randn(2, 4), torch.randn(2, 4))
        model.l1.weight = torch.nn.Parameter(torch.zeros(4, 4))
        x, y = torch.randn(2, 4), torch.randn(2, 4)
        with weights_unchanged(model):
            train(x, y)
    finally:
        train.destroy()


class _UsesCube(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(4, 4)

    def forward(self, x, y):
        out = poptorch.custom_op([self.l1(x)], "Cube", "com.acme", 1, example_outputs=[x])[0]
        return out, F.mse_loss(out, y)


def custom_op_unregistered():
    """A forward that calls a custom op nobody registered: its first call is refused, changing
    nothing."""
    model = _UsesCube()
    train = poptorch.trainingModel(model, opts(), torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    try:
        with weights_unchanged(model):
            train(x, y)
    finally:
        train.destroy()


def missing_op_library(tmp_path):
    """``--without-op-libraries``' stand-in, installed for the call and taken back."""
    import ctypes
    with mock.patch.object(ctypes.cdll, "LoadLibrary", ctypes.cdll.LoadLibrary):
        custom_ops.stand_in_for_missing_libraries()
        assert isinstance(ctypes.cdll.LoadLibrary(str(tmp_path / "ops.so")),
                          custom_ops.MissingLibrary)


def attribute_changed_every_call():
    """A Python attribute the forward reads, changed before each of six calls."""
    model = Two(tail="scaled")
    train = poptorch.trainingModel(model, opts())
    for k in range(6):
        model.scale = 1.0 + k
        train(torch.randn(2, 4), torch.randn(2, 4))
    train.destroy()


def hooks_changed_every_call():
    """A forward hook removed and registered again, another one, before each of six calls."""
    model = Two()
    train = poptorch.trainingModel(model, opts())
    handle = None
    for k in range(6):
        if handle is not None:
            handle.remove()
        handle = model.l1.register_forward_hook(lambda m, i, o, k=k: o * (1 + 0.1 * k))
        train(torch.randn(2, 4), torch.randn(2, 4))
    train.destroy()


def host_step_of_a_sharded_state():
    """The user's optimizer stepped on the host while its state holds process 0's chunk of
    a weight sharded over 2 processes ([Note: sharded optimizer state])."""
    from poptorch_lite.distributed.sharding import refuse_host_steps
    layer = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    opt.state[layer.weight]["momentum_buffer"] = torch.zeros(3)  # 3 of its 6 elements
    refuse_host_steps(opt, 2)
    for p in layer.parameters():
        p.grad = torch.ones_like(p)
    opt.step()


def another_processs_chunks():
    """Process 1 of 2 holds process 0's chunk of a weight's state (process 0's state dict
    loaded everywhere); the agreement's all-reduce stood in for (this process's flag alone)."""
    from poptorch_lite.distributed.sharding import CHUNK, Shards
    layer = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    opt.state[layer.weight].update({"momentum_buffer": torch.zeros(3), CHUNK: (0, 2, 0, 3)})
    Shards(lambda: None, 1, 2, lambda what, fn, *args, **kwargs: None).check_state(opt)


def step_pre_hook_on_a_sharded_state():
    """A step pre-hook on an optimizer whose state is sharded over 2 processes; the
    agreement's all-reduce stood in for (this process's flags alone)."""
    from poptorch_lite.distributed.sharding import Shards
    layer = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    opt.register_step_pre_hook(lambda o, args, kwargs: None)
    Shards(lambda: None, 1, 2, lambda what, fn, *args, **kwargs: None).check_state(opt)


def sparse_gradients_with_a_sharded_state():
    """An embedding with sparse=True whose optimizer's state is sharded over 2 processes;
    the agreement's all-reduce stood in for (this process's flags alone)."""
    from poptorch_lite.distributed.sharding import Shards
    opt = torch.optim.SGD(torch.nn.Embedding(4, 2, sparse=True).parameters(), lr=0.1)
    Shards(lambda: None, 1, 2, lambda what, fn, *args, **kwargs: None).check_state(
        opt, frozenset({"emb.weight"}))


def normalisation_frozen_between_calls():
    """A BatchNorm put in eval mode after the training model's first call."""
    model = Two(bn=True)
    train = poptorch.trainingModel(model, opts())
    train(torch.randn(2, 4), torch.randn(2, 4))
    model.bn.eval()
    train(torch.randn(2, 4), torch.randn(2, 4))
    train.destroy()


def constant_written_on_a_gpu():
    """A stage on the GPU twin whose forward writes a tensor kept as a plain attribute."""
    from gpu_twin import TWIN, TwinGpu
    from poptorch_lite.runtime import gpu
    with gpu.installed(TwinGpu()):
        first_call(Two(tail="count"), opts().set_ipu_devices(TWIN))


def own_mode_changed_after_wrapping():
    """``model.eval()`` after wrapping a model whose forward reads ``self.training``."""
    model = Two(tail="own_mode")
    train = poptorch.trainingModel(model, opts())
    model.eval()
    train(torch.randn(2, 4), torch.randn(2, 4))
    train.destroy()


def encoder_under_a_cpu_autocast():
    """An inference model of a TransformerEncoderLayer in eval mode, called under a CPU
    autocast."""
    model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, batch_first=True).eval()
    inference = poptorch.inferenceModel(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inference(torch.randn(2, 3, 4))
    inference.destroy()


def first_call(model, o, rows=None, training=True):
    """Wrap and call once; the refusal must leave weights (and RNG) untouched."""
    n = rows or poptorch.combined_batch_size(o, 2)
    x, y = torch.randn(n, 4), torch.randn(n, 4)
    with weights_unchanged(model):
        wrapped = (poptorch.trainingModel(model, o, optim.SGD(model.parameters(), lr=0.1))
                   if training else poptorch.inferenceModel(model, o))
        wrapped(x, y)


class Averaging(torch.nn.Module):
    """DINO's teacher, averaged from its student by ExpMovAvg ([Note: after-step averages]);
    ``teacher``: what the op is given as the teacher."""

    def __init__(self, teacher=lambda m: m.teacher.weight):
        super().__init__()
        self.student, self.teacher = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.teacher.requires_grad_(False)
        self.pick = teacher

    def forward(self, x, factor):
        with torch.no_grad():
            poptorch.custom_op([self.student.weight, self.pick(self), factor], "ExpMovAvg",
                               "com.acme", 1, [self.student.weight])
        return poptorch.identity_loss((self.student(x) - self.teacher(x)).pow(2).sum(),
                                      reduction="mean")


def averaged_call(model, o, factors):
    """One call, each micro-batch with its factor; a refusal leaves the weights unchanged."""
    x = torch.randn(len(factors), 4)
    with weights_unchanged(model):
        wrapped = poptorch.trainingModel(model, o, optim.SGD(model.parameters(), lr=0.1))
        wrapped(x, torch.tensor(factors))


def buffer_kept(model):
    """A first call refused for what the forward did to a buffer: the buffer is back, unchanged."""
    table = [(name, id(b)) for name, b in model.bn._buffers.items()]
    try:
        first_call(model, opts())
    finally:
        assert [(name, id(b)) for name, b in model.bn._buffers.items()] == table
        assert "running_mean" not in model.bn.__dict__


def call_with(*inputs):
    model = Two()
    wrapped = poptorch.trainingModel(model, opts(), optim.SGD(model.parameters(), lr=0.1))
    with weights_unchanged(model):
        wrapped(*inputs)


class Holder:
    """An object holding a tensor that pytree cannot walk (E-PART-16)."""

    def __init__(self, t):
        self.t = t


class NeedsTwo(dict):
    """A dict subclass whose constructor does not take its items (E-PART-17, E-BAT-06)."""

    def __init__(self, a, b):
        super().__init__(a=a, b=b)


class ReadBeforeWritten(torch.nn.Module):
    """Block a reads a buffer that block b writes (E-PART-25, E-PART-26)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x, y):
        with poptorch.Block("a", ipu_id=0):
            h = self.l1(x + self.seen)
        with poptorch.Block("b", ipu_id=1):
            with torch.no_grad():
                self.seen.add_(h.mean(0))
            return F.mse_loss(self.l2(h), y)


class Returning(torch.nn.Module):
    """Returns its loss beside ``wrap(out)``."""

    def __init__(self, wrap):
        super().__init__()
        self.l1, self.wrap = torch.nn.Linear(4, 4), wrap

    def forward(self, x, y):
        out = self.l1(x)
        return self.wrap(out), F.mse_loss(out, y)


def ds(n=20):
    return torch.utils.data.TensorDataset(torch.arange(float(n)).reshape(n, 1))


def tf1_stages():
    """Two TF1-style stages: a dense layer passing the labels on, then the loss."""
    dense, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    return [lambda x, y: (dense(x), y), lambda h, y: F.cross_entropy(head(h), y)]


def tf1_refuses(**kwargs):
    """``poptorch.pipeline`` refused: its base options stay unfrozen and unchanged."""
    args = dict(computational_stages=tf1_stages(), gradient_accumulation_count=3,
                optimizer=lambda params: optim.SGD(params, lr=0.1)) | kwargs
    o = poptorch.Options()
    with options_unchanged(o):
        poptorch.pipeline(**args, options=o)


def tf1_first_call(pipe, *inputs):
    """A pipeline's first call refused: no weight of its stages changes."""
    with weights_unchanged(pipe.model):
        pipe(*inputs)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(torch.arange(8.0))


def loader_refuses(o=None, dataset=None, **kwargs):
    """A refused DataLoader leaves its options unfrozen and unchanged."""
    o = o or poptorch.Options()
    with options_unchanged(o):
        poptorch.DataLoader(o, ds() if dataset is None else dataset, **kwargs)


def two_processes():
    o = poptorch.Options()
    o.Distributed.configureProcessId(0, 2)
    return o


# -- several processes ----------------------------------------------------------------------

_SPAWNED: dict = {}


def spawned(scenario, rank, what):
    """Raise what process ``rank`` of tests/support/_pipeline_worker.py's ``scenario`` raised, as it
    recorded it (class, message, notes): the scenario runs once, in its own processes."""
    if scenario not in _SPAWNED:
        with tempfile.TemporaryDirectory() as folder:
            out = pathlib.Path(folder)
            worker = pathlib.Path(__file__).parent / "support" / "_pipeline_worker.py"
            runs = start(worker, [scenario, out], 2)
            assert runs[0][0] == 0, runs[0][2][-3000:]
            _SPAWNED[scenario] = [torch.load(out / f"{scenario}-rank{r}.pt", weights_only=False)
                                  for r in range(2) if (out / f"{scenario}-rank{r}.pt").exists()]
    recorded = _SPAWNED[scenario][rank][what]
    if isinstance(recorded, str):  # a refusal's text, of the class the worker caught
        recorded = (None, recorded, [])
    kind, text, notes = recorded[:3]
    exc = getattr(errors, kind or ROW_CLASS[scenario, what])(text)
    for note in notes:
        exc.add_note(note)
    raise exc


ROW_CLASS = {("refuse", "uncovered"): "OptionsError", ("refuse", "stageless"): "OptionsError",
             ("refuse", "mismatch"): "OptionsError",
             ("checkpoint", "missing"): "CheckpointError",
             ("checkpoint", "refused"): "CheckpointError", ("refuse", "averaged"): "BlockError"}


def spread_options(W=2):
    o = poptorch.Options()
    o.Distributed.configureProcessId(0, W)
    o.Distributed.set_ipu_processes([[0], [1]])
    return o


def popdist_total(variables: dict):
    from poptorch_lite.distributed.popdist import popdist_modules
    with mock.patch.dict("os.environ", variables):
        popdist_modules()[0].getNumTotalReplicas()


def parse_poprun(argv: list):
    from poptorch_lite.poprun import parse
    parse(argv)


def rendezvous_missing():
    with mock.patch.dict("os.environ"):
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(var, None)
        first_call(Two(), two_processes())


def initialised_otherwise():
    """The script initialised a group of one process; the options say two."""
    torch.distributed.init_process_group("gloo", rank=0, world_size=1,
                                         store=torch.distributed.HashStore())
    try:
        first_call(Two(), two_processes())
    finally:
        torch.distributed.destroy_process_group()


def nobody_joins():
    """Process 0 of 2 waits for process 1, which never comes, for the collective timeout."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "POPTORCH_LITE_DIST_TIMEOUT": "1"}
    with mock.patch.dict("os.environ", env):
        first_call(Two(), two_processes())


def saved_before_the_first_call(tmp_path):
    model = Two()
    wrapped = poptorch.trainingModel(model, spread_options(), optim.SGD(model.parameters(), lr=0.1))
    poptorch.save_checkpoint(tmp_path / "ckpt.pt", wrapped)


def config_line(tmp_path, line):
    path = tmp_path / "bad.conf"
    path.write_text(line + "\n")
    poptorch.Options().loadFromFile(path)


def params():
    return [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]


def train_with(optimizer_of):
    model = Two()
    o = opts()
    with options_unchanged(o), weights_unchanged(model):
        poptorch.trainingModel(model, o, optimizer_of(model))


class Failing(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 5:
            raise KeyError("bad item")
        return torch.tensor([float(i)])


def failing_epoch():
    loader = poptorch.DataLoader(poptorch.Options(), Failing(), batch_size=2,
                                 mode=poptorch.DataLoaderMode.Async)
    try:
        list(loader)
    finally:
        loader.terminate()


def terminated():
    accessor = poptorch.AsynchronousDataAccessor([1, 2, 3])
    accessor.terminate()
    list(accessor)


def hooked(model: "Two", full: bool = True) -> "Two":
    """``model`` with a backward hook on the whole model (full) or on ``l1`` (deprecated)."""
    if full:
        model.register_full_backward_hook(lambda m, gi, go: None)
    else:
        model.l1.register_backward_hook(lambda m, gi, go: None)
    return model


def hooked_bias(model: "Two") -> "Two":
    """``model`` with a gradient hook on ``l1``'s bias."""
    model.l1.bias.register_hook(lambda g: g.clamp(-0.01, 0.01))
    return model


class TopWeight(torch.nn.Module):
    """A weight at the top of the model, where replicaGrouping reaches it (poptorch_model.W)."""

    def __init__(self):
        super().__init__()
        self.W = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x, y):
        return F.mse_loss(x @ self.W, y)


def grouping(compiled=False, R=1, kind=poptorch.CommGroupType.NoGrouping, size=0,
             mode=poptorch.VariableRetrievalMode.OnePerGroup, collected=False):
    model = poptorch.trainingModel(TopWeight(), opts(R=R))
    if compiled:
        model(torch.randn(2, 4), torch.randn(2, 4))
    group = model.W.replicaGrouping
    if collected:  # the wrapper it was read through is gone
        del model
        gc.collect()
    group(kind, size, mode)


def compiled_model():
    model = Two()
    wrapped = poptorch.trainingModel(model, opts(), optim.SGD(model.parameters(), lr=0.1))
    wrapped(torch.randn(2, 4), torch.randn(2, 4))
    return wrapped


def action_fails():
    model = Two(tail="mse")
    wrapped = poptorch.trainingModel(model, opts(G=2), optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 4)
    wrapped(x, torch.randn(4, 4))  # compiles
    model.l2.weight.data = torch.randn(4, 5)  # the next forward of stage 1 fails
    wrapped(x, torch.randn(4, 4))


def late_gpu_error():
    """A stream whose end-of-run wait raises, as a GPU stream does after a failed kernel."""
    model = Two(tail="mse")
    o = opts(strategy=poptorch.PipelinedExecution("a", "b"), G=4)
    wrapped = poptorch.trainingModel(model, o, optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(8, 4)
    wrapped.compile(x, torch.randn(8, 4))
    with mock.patch.object(CpuStream, "synchronize", side_effect=RuntimeError(
            "CUDA error: an illegal memory access was encountered")):
        wrapped(x, torch.randn(8, 4))


def on_devices(mapping):
    o = opts(strategy=poptorch.PipelinedExecution("a", "b"), G=4).set_ipu_devices(mapping)
    first_call(Two(tail="mse"), o)


def without_kernel(name, fn):
    """Run ``fn`` as if torch had no kernel for op ``name`` on any device (as the CPU's
    attention kernel is missing on a GPU): no trace can place it."""
    has = retarget._has_kernel
    with mock.patch.object(retarget, "_has_kernel",
                           lambda op, device: op.name() != name and has(op, device)):
        fn()


def oversubscribed():
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "device_count", return_value=2), \
            mock.patch.dict("os.environ", {"LOCAL_WORLD_SIZE": "3", "LOCAL_RANK": "2"}):
        resolve_devices([0], None)


def non_finite_loss():
    model = Two(tail="mse")
    o = opts(G=2)
    o.Training.stopOnNonFiniteLoss(True)
    wrapped = poptorch.trainingModel(model, o, optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    x[3, 0] = float("inf")
    with weights_unchanged(model):
        wrapped(x, y)


class StallingTrained(torch.nn.Module):
    """``Stalling`` with a loss: stage b's forward passes through the stall op."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x, y):
        with poptorch.Block("a", ipu_id=0):
            h = self.l1(x)
        with poptorch.Block("b", ipu_id=1):
            out = self.l2(stall(h))
            return out, F.mse_loss(out, y)


def optimizer_fails_part_way():
    model = Two(tail="mse")
    opt = optim.SGD(model.parameters(), lr=0.1)
    wrapped = poptorch.trainingModel(model, opts(G=2), opt)
    opt.register_step_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("broken")))
    wrapped(torch.randn(4, 4), torch.randn(4, 4))


def interrupted():
    model = StallingTrained()
    wrapped = poptorch.trainingModel(model, opts(G=2), optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    wrapped(x, y)
    STALL["interrupt"] = True
    try:
        with weights_unchanged(model):
            wrapped(x, y)
    finally:
        STALL["interrupt"] = False


def saved(tmp_path, model=None, loader=None):
    model = model or compiled_model()
    path = tmp_path / "ckpt.pt"
    poptorch.save_checkpoint(path, model, loader)
    return model, path


def refuse_checkpoint(tmp_path, edit=None, model=None, loader=None, save_loader=None):
    """Save a checkpoint, ``edit`` it, then load it, checking nothing moved."""
    model, path = saved(tmp_path, model or compiled_model(), save_loader)
    if edit is not None:
        state = torch.load(path, weights_only=True)
        edit(state)
        torch.save(state, path)
    with weights_unchanged(model.model):
        poptorch.load_checkpoint(path, model, loader)


def other_model(tmp_path, **kwargs):
    """A checkpoint of ``Two()`` loaded into a model built with ``kwargs``."""
    _, path = saved(tmp_path)
    model = Two(**kwargs)
    wrapped = poptorch.trainingModel(model, opts(), optim.SGD(model.parameters(), lr=0.1))
    with weights_unchanged(model):
        poptorch.load_checkpoint(path, wrapped)


def parts_of_two_steps(tmp_path):
    """Parts of 2 processes (made here from one process's checkpoint) of different steps,
    put together for one process ([Note: resharding checkpoints])."""
    model, path = saved(tmp_path)
    state = torch.load(path, weights_only=True)
    part = {"rank": 0, "processes": 2, "ipu_processes": None,
            "process_order": "pipeline_inner", "shards": None}
    torch.save({**state, "part": part}, f"{path}.process0-of-2")
    torch.save({**state, "part": {**part, "rank": 1}, "steps": state["steps"] + 1},
               f"{path}.process1-of-2")
    with weights_unchanged(model.model):
        poptorch.load_checkpoint(path, model)


def chunks_that_miss(tmp_path):
    """A state sharded over 2 (made here from one process's) whose second process's chunks
    are not in its file: put together for one process, they cover half of each weight."""
    model = Two()
    wrapped = poptorch.trainingModel(model, opts(), torch.optim.Adam(model.parameters()))
    wrapped(torch.randn(2, 4), torch.randn(2, 4))
    _, path = saved(tmp_path, wrapped)
    state = torch.load(path, weights_only=True)
    for entry in state["optimizer"]["state"].values():
        for key, value in entry.items():
            if value.dim():
                entry[key] = value.reshape(-1)[:(value.numel() + 1) // 2].clone()
    torch.save({**state, "shards": 2}, path)
    torch.save({"format": state["format"], "version": state["version"], "steps": state["steps"],
                "optimizer": {"param_groups": state["optimizer"]["param_groups"], "state": {}}},
               f"{path}.shard1-of-2")
    with weights_unchanged(model):
        poptorch.load_checkpoint(path, wrapped)


def loader_position(state, mode=poptorch.DataLoaderMode.Sync, dataset=None):
    loader = poptorch.DataLoader(poptorch.Options(), dataset or ds(8), batch_size=2, mode=mode)
    try:
        loader.load_state_dict(state)
    finally:
        loader.terminate()


STALL = {"hold": None, "interrupt": False}


@torch.library.custom_op("poptorch_lite_catalogue::stall", mutates_args=())
def stall(x: torch.Tensor) -> torch.Tensor:
    """Holds the action until ``STALL["hold"]`` (an Event) is set (a stuck op for the
    watchdog), or sends the caller's thread a SIGINT (Ctrl-C) and returns once the caller
    reported it (tests/support/patience.py)."""
    if STALL["interrupt"]:
        interrupt_caller()
    hold = STALL["hold"]
    if hold is not None and not hold.wait(limit(120)):
        raise AssertionError(hung("the test's release of the stalled action", 120))
    return x.clone()


@stall.register_fake
def _(x):
    return torch.empty_like(x)


stall.register_autograd(lambda ctx, grad: grad)


class Stalling(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        with poptorch.Block("a", ipu_id=0):
            h = self.l1(x)
        with poptorch.Block("b", ipu_id=1):
            return self.l2(stall(h))


def watchdog_fires():
    # a pipelined schedule: streams run on their own threads, which the watchdog watches
    wrapped = poptorch.inferenceModel(
        Stalling(), opts(poptorch.PipelinedExecution(), D=2).watchdogTimeout(WATCHDOG_S))
    x = torch.randn(4, 4)
    wrapped(x)
    STALL["hold"] = threading.Event()
    try:
        wrapped(x)
    finally:
        STALL["hold"].set()
        STALL["hold"] = None
        wrapped.destroy()


def one_span(**kw):
    return Span(**(dict(stream=0, stage=0, microbatch=0, kind="F", start=0.0, end=1.0) | kw))


GOOD = build(P.Sequential, 1, 1, True)


class _SkipsB(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)

    def forward(self, x):
        return self.a(x)


def _balance_skipping_a_layer():
    poptorch.balance_by_time(_SkipsB(), torch.ones(1, 1), stages=1, layers=["a", "b"])


def grid(rows, **kw):
    fields = dict(name="bad", num_stages=1, num_microbatches=1, training=True,
                  stage_streams=(0,), rows=rows) | kw
    validate(Schedule(**fields))


def a(text):
    return Action.parse(text)


# -- the triggers --------------------------------------------------------------------------

T = {
    # options
    "E-OPT-01": lambda: refuse(lambda o: o.deviceIterations(0)),
    "E-OPT-02": lambda: refuse(lambda o: o.broadcastBuffers(1)),
    "E-OPT-03": lambda: refuse(lambda o: o.outputMode("bogus")),
    "E-OPT-04": lambda: refuse(lambda o: setattr(o, "foo", 1)),
    "E-OPT-05": lambda: refuse(lambda o: o.deviceIteration(2)),
    "E-OPT-06": lambda: (lambda o: (poptorch.inferenceModel(Two(), o),
                                    o.deviceIterations(2)))(poptorch.Options()),
    "E-OPT-07": lambda: refuse(lambda o: o.inputReplicaGrouping(2, poptorch.CommGroupType.All)),
    "E-OPT-08": lambda: poptorch.combined_batch_size(
        poptorch.Options().replicationFactor(2).inputReplicaGrouping(3), 1),
    "E-OPT-09": lambda: refuse(lambda o: o.randomSeed(-1)),
    "E-OPT-10": lambda: refuse(lambda o: o.setExecutionStrategy("pipelined")),
    "E-OPT-11": lambda: refuse(lambda o: o.watchdogTimeout(-1)),
    "E-OPT-12": lambda: refuse(lambda o: o.set_ipu_devices([])),
    "E-OPT-13": lambda: refuse(lambda o: o.set_ipu_devices({-1: "cpu"})),
    "E-OPT-14": lambda: refuse(lambda o: o.set_ipu_devices({0: 3.5})),
    "E-OPT-15": lambda: refuse(lambda o: o.Training.accumulationAndReplicationReductionType(
        poptorch.ReductionType.NoReduction)),
    "E-OPT-16": lambda: refuse(lambda o: o.Distributed.configureProcessId(2, 2)),
    "E-OPT-17": lambda: refuse(lambda o: o.Distributed.setEnvVarNames("PATH", "HOME")),
    "E-OPT-18": lambda: refuse(lambda o: o.useIpuId(-1)),
    "E-OPT-19": lambda: refuse(lambda o: o.setAvailableMemoryProportion(0.5)),
    "E-OPT-20": lambda: refuse(lambda o: o.setAvailableMemoryProportion({"GPU0": 0.5})),
    "E-OPT-21": lambda: refuse(lambda o: o.setAvailableMemoryProportion({"IPU0": "half"})),
    "E-OPT-22": lambda: refuse(lambda o: o.Precision.setPartialsType(torch.int32)),
    "E-OPT-24": lambda: refuse(lambda o: o._Popart.set(3, 1)),
    "E-OPT-25": lambda: refuse(lambda o: o._Popart.set("autoRecomputation", -1)),
    "E-OPT-26": lambda: refuse(lambda o: o._Popart.setEngineOptions(["x"])),
    "E-OPT-27": lambda: refuse(lambda o: o._Popart.setPatterns({"X": True}, "2")),
    "E-OPT-28": lambda: poptorch.TensorLocationSettings().minElementsForOffChip(-1),
    "E-OPT-29": lambda: refuse(lambda o: o.TensorLocations.numIOTiles(33)),
    "E-OPT-30": lambda: refuse(lambda o: o.TensorLocations.setWeightLocation({"x": 1})),
    "E-OPT-31": lambda: refuse(lambda o: o.Training.setAutomaticLossScaling(
        True, growth_interval=0)),
    "E-OPT-32": lambda: refuse(lambda o: o.Distributed.set_ipu_processes("0")),
    "E-OPT-33": lambda: refuse(lambda o: o.Distributed.set_ipu_processes({1: [0]})),
    "E-OPT-34": lambda: refuse(lambda o: o.Distributed.set_ipu_processes([[0], []])),
    "E-OPT-35": lambda: refuse(lambda o: o.Distributed.set_ipu_processes([[0], [1.5]])),
    "E-OPT-36": lambda: refuse(lambda o: o.Distributed.set_ipu_processes([[0, 1], [1]])),
    "E-OPT-37": lambda: refuse(lambda o: o.anchorTensor("g", 3)),
    "E-OPT-38": lambda: first_call(Two(), opts().anchorTensor("g", "MatMul:0")),
    "E-OPT-39": lambda: first_call(Two(), opts().anchorTensor("g", "l1.bias",
                                                              poptorch.OutputMode.All)),
    "E-OPT-40": lambda: refuse(lambda o: o._Popart.set("syntheticDataMode", 3)),
    # options files and JSON
    "E-CFG-01": lambda tmp_path: poptorch.Options().loadFromFile(tmp_path / "missing.conf"),
    "E-CFG-02": lambda tmp_path: config_line(tmp_path, "deviceIterations(4"),
    "E-CFG-03": lambda tmp_path: config_line(tmp_path, "deviceIterations"),
    "E-CFG-04": lambda tmp_path: config_line(tmp_path, "__import__('os').system('true')"),
    "E-CFG-05": lambda tmp_path: config_line(tmp_path, "Nope.deviceIterations(2)"),
    "E-CFG-06": lambda tmp_path: config_line(tmp_path, "nope(2)"),
    "E-CFG-07": lambda tmp_path: config_line(tmp_path, "deviceIterations(*[2])"),
    "E-CFG-08": lambda tmp_path: config_line(tmp_path, "setAvailableMemoryProportion({**{}})"),
    "E-CFG-09": lambda tmp_path: config_line(tmp_path, "deviceIterations(1 + 1)"),
    "E-CFG-10": lambda tmp_path: config_line(tmp_path, "outputMode(os.sep)"),
    "E-CFG-11": lambda tmp_path: config_line(tmp_path, "outputMode(poptorch.OutputMode.Nope)"),
    "E-CFG-12": lambda tmp_path: config_line(tmp_path, "outputMode((1).real)"),
    "E-CFG-13": lambda tmp_path: config_line(tmp_path, "outputMode(poptorch.OutputMode())"),
    "E-CFG-14": lambda tmp_path: config_line(
        tmp_path, "setExecutionStrategy(poptorch.ShardedExecution(poptorch.Stage('A').nope()))"),
    "E-CFG-15": lambda tmp_path: config_line(tmp_path, "deviceIterations(0)"),
    "E-CFG-16": lambda: refuse(lambda o: o.from_json("{nope")),
    "E-CFG-17": lambda: refuse(lambda o: o.from_json("[1]")),
    "E-CFG-18": lambda: refuse(lambda o: o.from_json('{"Nope.x": 1}')),
    # annotations and front ends
    "E-BLK-01": lambda: poptorch.BeginBlock(torch.nn.Linear(2, 2), 3.5),
    "E-BLK-02": lambda: poptorch.BeginBlock(torch.nn.Linear(2, 2), "a", ipu_id=-1),
    "E-BLK-03": lambda: poptorch.BeginBlock(poptorch.BeginBlock(torch.nn.Linear(2, 2), "a"), "b"),
    "E-BLK-04": lambda: poptorch.BeginBlock(3, "a"),
    "E-BLK-05": lambda: poptorch.recomputationCheckpoint(1.0),
    "E-BLK-06": lambda: poptorch.set_pipeline_stage_assignment(torch.nn.Linear(2, 2), [0]),
    "E-BLK-07": lambda: poptorch.set_pipeline_stage_assignment(
        torch.nn.Sequential(torch.nn.ReLU(), torch.nn.ReLU()), [0]),
    "E-BLK-08": lambda: poptorch.set_pipeline_stage_assignment(
        torch.nn.Sequential(torch.nn.ReLU(), torch.nn.ReLU()), [0, -1]),
    "E-BLK-09": lambda: poptorch.set_pipeline_stage_assignment(
        torch.nn.Sequential(torch.nn.ReLU(), torch.nn.ReLU()), [1, 0]),
    "E-BLK-10": lambda: poptorch.split_at(torch.nn.Sequential(torch.nn.ReLU()), ["ghost"]),
    "E-BLK-11": lambda: poptorch.split_at(
        torch.nn.Sequential(torch.nn.ReLU(), torch.nn.ReLU()), ["1", "1"]),
    "E-BLK-12": lambda: poptorch.balance_by_time(
        torch.nn.Sequential(torch.nn.ReLU()), torch.ones(1), stages=1, layers=["ghost"]),
    "E-BLK-13": lambda: poptorch.balance_by_time(
        torch.nn.Sequential(torch.nn.ReLU()), torch.ones(1), stages=2),
    "E-BLK-14": lambda: _balance_skipping_a_layer(),
    # the Keras face
    "E-KER-01": lambda: keras_refuses(lambda m, x, y: m.fit(x[:30], y[:30], batch_size=4,
                                                            verbose=0)),
    "E-KER-02": lambda: keras_refuses(lambda m, x, y: m.fit(x[:24], y[:24], batch_size=4,
                                                            verbose=0)),
    "E-KER-03": lambda: keras_refuses(lambda m, x, y: m.fit(x, y, batch_size=4, verbose=0,
                                                            steps_per_epoch=12)),
    "E-KER-04": lambda: keras_refuses(lambda m, x, y: m.fit(x, y, batch_size=2, verbose=0),
                                      spe=6, G=4),
    "E-KER-05": lambda: keras_refuses(lambda m, x, y: m.fit(x, y, batch_size=2, verbose=0),
                                      spe=8, G=2, stages=2),
    "E-KER-06": lambda: keras_refuses(lambda m, x, y: m.fit(x, y, batch_size=2, verbose=0),
                                      spe=6, G=3, stages=2, schedule=P.Interleaved),
    "E-KER-07": lambda: keras_refuses(lambda m, x, y: m.fit(x, y, batch_size=2, verbose=0),
                                      spe=8, G=4, stages=2, ipus=3),
    "E-KER-08": lambda: keras_refuses(lambda m, x, y: m.fit(x, y, verbose=0), loss=None),
    "E-KER-09": lambda: keras_refuses(lambda m, x, y: m.fit(x, y[:16], verbose=0)),
    "E-KER-10": lambda: keras_refuses(lambda m, x, y: m.fit(x.tolist(), y, verbose=0)),
    "E-KER-11": lambda: keras_refuses(lambda m, x, y: m.predict(torch.tensor(1.0))),
    "E-KER-12": lambda: keras_refuses(lambda m, x, y: m.evaluate(x, verbose=0)),
    "E-KER-13": lambda: keras_refuses(lambda m, x, y: m.fit(
        torch.utils.data.TensorDataset(x, y), y, verbose=0)),
    "E-KER-14": lambda: keras_refuses(lambda m, x, y: m.fit(torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=None), verbose=0)),
    "E-KER-15": lambda: keras_refuses(lambda m, x, y: m.fit(
        torch.utils.data.TensorDataset(x), batch_size=4, verbose=0)),
    "E-KER-16": lambda: keras.Model([torch.nn.Linear(2, 2)]),
    "E-KER-17": lambda: keras.Sequential([torch.nn.Linear(2, 2), torch.relu]),
    "E-KER-18": lambda: keras.Sequential().add(torch.relu),
    "E-KER-19": lambda: keras_refuses(lambda m, x, y: m.compile("nadam", "mse")),
    "E-KER-20": lambda: keras_refuses(lambda m, x, y: m.compile(0.1, "mse")),
    "E-KER-21": lambda: keras_refuses(lambda m, x, y: m.compile(lambda p: None, "mse")),
    "E-KER-22": lambda: keras_refuses(lambda m, x, y: m.compile("sgd", "hinge")),
    "E-KER-23": lambda: keras_refuses(lambda m, x, y: m.compile("sgd", 3)),
    "E-KER-24": lambda: keras_refuses(lambda m, x, y: m.fit(x, y, batch_size=8, verbose=0),
                                      loss=lambda y_true, y_pred: 1.0),
    "E-KER-25": lambda: keras_refuses(lambda m, x, y: m.compile("sgd", "mse", ["f1"])),
    "E-KER-26": lambda: keras_refuses(lambda m, x, y: m.compile("sgd", "mse", [3])),
    "E-KER-27": lambda: keras_refuses(lambda m, x, y: m.set_pipelining_options(
        pipeline_schedule="gpipe")),
    "E-KER-28": lambda: keras_refuses(lambda m, x, y: m.set_pipelining_options(
        recomputation_mode=True)),
    "E-KER-29": lambda: keras.callbacks.LearningRateScheduler(0.1),
    "E-KER-30": lambda: keras_refuses(lambda m, x, y: m.fit(x, y, 8, verbose=0, callbacks=[
        keras.callbacks.LearningRateScheduler(lambda epoch, lr: "fast")]), strict=False),
    "E-KER-31": lambda: keras_refuses(lambda m, x, y: m.fit(x, y, 8, verbose=0,
                                                            callbacks=[print])),
    # execution strategies
    "E-STR-01": lambda: poptorch.Stage(),
    "E-STR-02": lambda: poptorch.Stage("a", 1),
    "E-STR-03": lambda: poptorch.Stage("a").ipu(-1),
    "E-STR-04": lambda: poptorch.Stage("a").recompute(1),
    "E-STR-05": lambda: poptorch.ShardedExecution(3),
    "E-STR-06": lambda: poptorch.Phase("a", poptorch.Stage("b")),
    "E-STR-07": lambda: (lambda ph: [ph.ipus(0), None][1])(
        poptorch.Phase(poptorch.Stage("a"), poptorch.Stage("b"))),
    "E-STR-08": lambda: poptorch.ShardedExecution("a", "a"),
    "E-STR-09": lambda: poptorch.PipelinedExecution().stage("a"),
    "E-STR-10": lambda: poptorch.ShardedExecution("a").stage("b"),
    "E-STR-11": lambda: poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement, "b"),
    "E-STR-12": lambda: poptorch.SerialPhasedExecution(3),
    "E-STR-13": lambda: poptorch.SerialPhasedExecution(),
    "E-STR-14": lambda: poptorch.SerialPhasedExecution(["a"]).phase(1),
    "E-STR-15": lambda: poptorch.SerialPhasedExecution(["a"]).useSeparateBackwardPhase(1),
    "E-STR-16": lambda: poptorch.SerialPhasedExecution(["a"]).setTensorsLiveness(1),
    "E-STR-17": lambda: poptorch.ParallelPhasedExecution(["a"]).sendTensorsOffChipAfterFwd(1),
    "E-STR-18": lambda: first_call(Two(ipus=(0, 0)), opts(poptorch.ParallelPhasedExecution(
        ["a"], ["b"]))),
    "E-STR-19": lambda: poptorch.PipelinedExecution("a", schedule="zigzag"),
    # first call
    "E-PART-01": lambda: first_call(Two(), opts(poptorch.ShardedExecution("a", "b", "ghost"))),
    "E-PART-02": lambda: first_call(Two(), opts(poptorch.ShardedExecution("a"))),
    "E-PART-03": lambda: first_call(Two(ipus=(None, None)), opts(poptorch.PipelinedExecution(
        poptorch.AutoStage.SameAsIpu), G=3)),
    "E-PART-04": lambda: first_call(Two(ids=("a", "a")), opts()),
    "E-PART-05": lambda: first_call(Two(tail="outside"), opts()),
    "E-PART-06": lambda: first_call(Two(ipus=(1, 0)), opts(poptorch.PipelinedExecution(), G=3)),
    "E-PART-07": lambda: first_call(Two(tail="none"), opts()),
    "E-PART-08": lambda: first_call(Two(tail="two"), opts()),
    "E-PART-09": lambda: first_call(Two(tail="trace"), opts()),
    "E-PART-21": lambda: first_call(Two(tail="total_and_part"), opts()),
    "E-PART-11": lambda: first_call(Two(tail="item"), opts()),
    "E-PART-12": lambda: first_call(Two(tail="one_hot"), opts()),
    "E-PART-13": lambda: buffer_kept(Two(tail="del_buffer", bn=True)),
    "E-PART-14": lambda: buffer_kept(Two(tail="reassign_buffer", bn=True)),
    "E-PART-10": lambda: first_call(Two(tail="write_statistic", bn=True), opts(R=2)),
    "E-PART-16": lambda: first_call(Returning(Holder), opts()),
    "E-PART-17": lambda: first_call(Returning(lambda t: NeedsTwo(t, t)), opts()),
    "E-PART-18": lambda: first_call(Two(tail="function_given_module"), opts()),
    "E-PART-19": lambda: first_call(hooked(Two(), full=False), opts()),
    "E-PART-20": lambda: first_call(hooked(Two()), opts(G=3)),  # its blocks are two stages
    "E-PART-22": lambda: first_call(Two(tail="generator_seeded"), opts()),
    "E-PART-23": lambda: first_call(Two(tail="generator_made"), opts()),
    "E-OPT-41": lambda: first_call(Two(tail="generator"), opts(R=2)),
    "E-OPT-42": lambda: refuse(lambda o: o.Distributed.set_process_order("replica_inner")),
    "E-PART-24": lambda: first_call(Two(tail="packed"), opts()),
    "E-PART-25": lambda: first_call(ReadBeforeWritten(), opts(poptorch.PipelinedExecution(), G=3)),
    "E-PART-26": lambda: first_call(ReadBeforeWritten(), opts().useIpuModel(True)),
    "E-PART-27": lambda: first_call(hooked_bias(Two(tail="reuse_l1")), opts()),
    "E-PART-15": lambda: without_kernel("aten::addmm", lambda: first_call(
        Two(), opts(strategy=poptorch.PipelinedExecution("a", "b"), G=4))),
    # pipelining
    "E-PIPE-01": lambda: first_call(Two(), opts(poptorch.PipelinedExecution(), G=2)),
    "E-PIPE-02": lambda: first_call(Two(tail="none"), opts(poptorch.PipelinedExecution()),
                                    training=False),
    # wrapping and calling
    "E-WRAP-01": lambda: poptorch.trainingModel(Two(), {"deviceIterations": 2}),
    "E-WRAP-02": lambda: (lambda m: (poptorch.trainingModel(m), poptorch.trainingModel(m)))(Two()),
    "E-WRAP-03": lambda: (lambda o: [poptorch.inferenceModel(Two(), o)])(opts(G=2)),
    "E-WRAP-04": lambda: poptorch.inferenceModel(Two()).to("cpu"),
    "E-WRAP-05": lambda: poptorch.inferenceModel(Two()).setOptimizer(
        optim.SGD(Two().parameters(), lr=0.1)),
    "E-WRAP-06": lambda: poptorch.inferenceModel(
        Two(tail="none"), opts().connectionType(poptorch.ConnectionType.Never))(
        torch.randn(2, 4), torch.randn(2, 4)),
    "E-WRAP-07": lambda: poptorch.inferenceModel(Two()).runStatistics(),
    "E-WRAP-08": lambda: poptorch.inferenceModel(Two()).detachFromDevice(),
    "E-WRAP-09": lambda: compiled_model().attachToDevice(),
    "E-WRAP-10": lambda: poptorch.inferenceModel(Two()).attachToDevice(),
    "E-WRAP-11": lambda: compiled_model().getAnchoredTensor("grad"),
    "E-WRAP-12": lambda: compiled_model()._compileWithDispatch,
    "E-WRAP-13": lambda: compiled_model().copyNamedBuffersToDevice(),
    "E-WRAP-14": lambda: first_call(Two(), opts().updatableNamedBuffers(["ghost"])),
    "E-WRAP-15": lambda tmp: poptorch.inferenceModel(Two()).save(tmp / "m.poptorch"),
    "E-WRAP-16": lambda: grouping(compiled=True),
    "E-WRAP-17": lambda: grouping(collected=True),
    "E-WRAP-18": lambda: grouping(mode=poptorch.VariableRetrievalMode.AllReplicas),
    "E-WRAP-19": lambda: grouping(R=4, kind=poptorch.CommGroupType.Consecutive, size=3),
    "E-WRAP-20": lambda: grouping(R=2),
    "E-WRAP-21": replaced_parameter,
    # batch sizes and inputs
    "E-TF-01": lambda: tf1_refuses(computational_stages=[]),
    "E-TF-02": lambda: tf1_refuses(computational_stages=[torch.nn.Linear(4, 4), 3]),
    "E-TF-03": lambda: tf1_refuses(repeat_count=0),
    "E-TF-04": lambda: tf1_refuses(device_mapping=[0, 1, 2]),
    "E-TF-05": lambda: tf1_refuses(device_mapping=[0, "ipu1"]),
    "E-TF-06": lambda: tf1_refuses(gradient_accumulation_count=2),
    "E-TF-07": lambda: tf1_refuses(recomputation_mode="sometimes"),
    "E-TF-08": lambda: tf1_refuses(outfeed_loss="yes"),
    "E-TF-09": lambda: tf1_refuses(loss="sparse_categorical_crossentropy"),
    "E-TF-10": lambda: tf1_refuses(optimizer="sgd"),
    "E-TF-11": lambda: tf1_refuses(computational_stages=[torch.nn.Linear(4, 4)],
                                   optimizer=optim.SGD(params(), lr=0.1)),
    "E-TF-12": lambda: (lambda layer: tf1_refuses(
        computational_stages=[layer, torch.nn.ReLU(), layer], gradient_accumulation_count=5))(
        torch.nn.Linear(4, 4)),
    "E-TF-13": lambda: poptorch.pipeline(tf1_stages(), gradient_accumulation_count=3)(
        torch.randn(12, 4), torch.randint(0, 2, (12,))),
    "E-TF-14": lambda: poptorch.pipeline(tf1_stages(), gradient_accumulation_count=1).inference(
        torch.randn(4, 4), torch.randint(0, 2, (4,))),
    "E-TF-15": lambda: tf1_first_call(poptorch.pipeline(
        [torch.nn.Linear(4, 4)], gradient_accumulation_count=1, optimizer=lambda p: optim.SGD(
            p, lr=0.1)), torch.randn(4, 4)),
    "E-TF-16": lambda: tf1_first_call(poptorch.pipeline(
        [torch.nn.Linear(4, 2)], gradient_accumulation_count=1, loss=F.cross_entropy,
        optimizer=lambda p: optim.SGD(p, lr=0.1)), torch.randn(4, 4)),
    "E-KER-32": lambda: keras_refuses(lambda m, x, y: m.set_pipelining_options(offload_all=1)),
    "E-KER-33": lambda: keras_refuses(lambda m, x, y: m.compile("sgd", "mse", None, [1, 2])),
    "E-KER-34": lambda: keras_refuses(lambda m, x, y: m.compile("sgd", "mse",
                                                                weighted_metrics=["mae"])),
    "E-KER-35": lambda: keras_refuses(lambda m, x, y: m.compile("sgd", torch.nn.MSELoss(),
                                                                loss_weights=0.5)),
    "E-KER-36": lambda: keras_refuses(lambda m, x, y: m.fit(
        torch.utils.data.TensorDataset(x, y), verbose=0, sample_weight=torch.ones(32))),
    "E-KER-37": lambda: keras_refuses(lambda m, x, y: m.fit(x, y, verbose=0,
                                                            sample_weight=torch.ones(31))),
    "E-KER-38": lambda: keras_refuses(lambda m, x, y: m.fit(x, y, 8, verbose=0,
                                                            sample_weight=torch.ones(32)),
                                      loss=torch.nn.MSELoss()),
    "E-KER-39": lambda: keras_refuses(lambda m, x, y: m.fit(x, y, 8, verbose=0,
                                                            sample_weight=torch.ones(32)),
                                      loss=lambda t, p: ((t - p) ** 2).mean()),
    "E-KER-40": lambda: keras_refuses(lambda m, x, y: m.fit(Endless(x, y), verbose=0)),
    "E-KER-41": lambda: keras_refuses(lambda m, x, y: m.fit(torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x[:30], y[:30]), batch_size=4), verbose=0,
        steps_per_epoch=8, drop_remainder=True)),
    "E-KER-42": lambda: keras_refuses(lambda m, x, y: m.fit(
        poptorch.AsynchronousDataAccessor([]), verbose=0, steps_per_epoch=4)),
    "E-KER-44": lambda: keras_refuses(lambda m, x, y: m.fit(
        Finite(x[:30], y[:30]), batch_size=4, verbose=0, steps_per_epoch=8), strict=False,
        spe=8),
    "E-KER-43": lambda: keras.Model(torch.nn.Linear(2, 2)).get_pipeline_stage_assignment(),
    "E-TF-17": lambda: tf1_refuses(optimizer_function=lambda *out: out),
    "E-TF-18": lambda: tf1_refuses(optimizer=None, optimizer_function=0.1),
    "E-TF-19": lambda: tf1_refuses(inputs=0.1),
    "E-TF-20": lambda: tf1_refuses(outfeed_queue=[]),
    "E-TF-21": lambda: tf1_first_call(poptorch.pipeline(
        tf1_stages(), gradient_accumulation_count=3, optimizer_function=lambda loss: loss),
        torch.randn(12, 4), torch.randint(0, 2, (12,))),
    "E-TF-22": lambda: tf1_first_call(poptorch.pipeline(
        tf1_stages(), gradient_accumulation_count=3,
        optimizer_function=lambda loss: poptorch.OptimizerFunctionOutput("sgd", loss)),
        torch.randn(12, 4), torch.randint(0, 2, (12,))),
    "E-TF-23": lambda: poptorch.IPUInfeedQueue(3),
    "E-TF-24": lambda: poptorch.pipeline(tf1_stages(), gradient_accumulation_count=3,
                                         optimizer=lambda p: optim.SGD(p, lr=0.1),
                                         infeed_queue=[]),
    "E-TF-25": lambda: tf1_first_call(poptorch.pipeline(
        [lambda x, y: (x * 2, y), lambda h, y: F.cross_entropy(h, y)],
        gradient_accumulation_count=3, optimizer=lambda p: optim.SGD(p, lr=0.1)),
        torch.randn(12, 4), torch.randint(0, 2, (12,))),
    "E-TF-26": lambda: tf1_first_call(poptorch.pipeline(
        [lambda x, y: (torch.nn.Linear(4, 4)(x), y), lambda h, y: F.cross_entropy(h, y)],
        gradient_accumulation_count=3, optimizer=lambda p: optim.SGD(p, lr=0.1)),
        torch.randn(12, 4), torch.randint(0, 4, (12,))),
    "E-TF-27": lambda: tf1_refuses(inputs=[torch.ones(2)]),
    "E-BAT-01": lambda: first_call(Two(), opts(G=2), rows=3),
    "E-BAT-02": lambda: poptorch.combined_batch_size(poptorch.Options(), 0),
    "E-BAT-03": lambda: call_with(np.zeros((2, 4), np.float32), torch.randn(2, 4)),
    "E-BAT-04": lambda: call_with(torch.randn(2, 4), object()),
    "E-BAT-05": lambda: call_with(torch.randn(2, 4), [0.0, 1.0]),
    "E-BAT-06": lambda: poptorch.inferenceModel(torch.nn.Identity())(
        NeedsTwo(torch.ones(2), torch.ones(2))),
    # optimizers
    "E-OPTIM-01": lambda: optim.SGD(params(), lr=0.1).variable_attrs.isConstant("nope"),
    "E-OPTIM-02": lambda: optim.SGD(params(), lr=-1),
    "E-OPTIM-03": lambda: train_with(lambda m: torch.optim.Adagrad(m.parameters())),
    "E-OPTIM-04": lambda: train_with(lambda m: torch.optim.RMSprop(
        [{"params": m.l1.parameters(), "centered": True}, {"params": m.l2.parameters()}])),
    "E-OPTIM-05": lambda: optim.copy_hyperparameters(optim.SGD(params(), lr=0.1),
                                                     optim.Adam(params())),
    "E-OPTIM-06": lambda: (lambda p: optim.copy_hyperparameters(
        optim.SGD(p, lr=0.1), optim.SGD([{"params": p[:1]}, {"params": p[1:]}], lr=0.1)))(params()),
    "E-OPTIM-07": lambda: optim.SGD(params(), lr=0.1, loss_scaling=0),
    "E-OPTIM-08": lambda: optim.SGD(params(), lr=0.1, accum_type=torch.int32),
    "E-OPTIM-09": lambda: optim.SGD(params(), lr=0.1, use_combined_accum=1),
    "E-OPTIM-10": lambda: optim.RMSprop(params()).max_grad_norm,
    "E-OPTIM-11": lambda: (lambda p: optim.SGD(
        [{"params": p[:1], "loss_scaling": 2.0}, {"params": p[1:]}], lr=0.1))(params()),
    "E-OPTIM-12": lambda: optim.Adam(params(), amsgrad=True),
    "E-OPTIM-13": host_step_of_a_sharded_state,
    "E-OPTIM-14": another_processs_chunks,
    "E-OPTIM-15": step_pre_hook_on_a_sharded_state,
    "E-OPTIM-16": sparse_gradients_with_a_sharded_state,
    # DataLoader and AsynchronousDataAccessor
    "E-DL-01": lambda: poptorch.DataLoader(ds(), ds()),
    "E-DL-02": lambda: loader_refuses(batch_size=2, batch_sampler=[[0, 1]]),
    "E-DL-03": lambda: loader_refuses(two_processes(), batch_sampler=[[0, 1]]),
    "E-DL-04": lambda: loader_refuses(batch_size=0),
    "E-DL-05": lambda: loader_refuses(two_processes(), Stream()),
    "E-DL-06": lambda: loader_refuses(batch_size=32),
    "E-DL-07": lambda: loader_refuses(two_processes(), shuffle=True),
    "E-DL-08": lambda: loader_refuses(two_processes(),
                                      sampler=torch.utils.data.SequentialSampler(range(20))),
    "E-DL-09": lambda: loader_refuses(two_processes(), batch_size=None),
    "E-DL-10": lambda: loader_refuses(mode=poptorch.DataLoaderMode.AsyncRebatched,
                                      rebatched_worker_size=0),
    "E-DL-11": lambda: loader_refuses(mode="bogus"),
    "E-DL-12": lambda: loader_refuses(mode=poptorch.DataLoaderMode.Async,
                                      async_options={"nope": 1}),
    "E-DL-13": lambda: list(poptorch.AsynchronousDataAccessor(["ab", "cd"], rebatched_size=2)),
    "E-DL-14": lambda: poptorch.AsynchronousDataAccessor(poptorch.DataLoader(
        poptorch.Options(), ds(), mode=poptorch.DataLoaderMode.Async)),
    "E-DL-15": lambda: poptorch.AsynchronousDataAccessor([1], buffer_size=0),
    "E-DL-16": failing_epoch,
    "E-DL-17": terminated,
    "E-DL-18": lambda: loader_position({}, mode=poptorch.DataLoaderMode.Async),
    "E-DL-19": lambda: loader_position({"epoch": "one"}),
    "E-DL-20": lambda: loader_position({"epoch": 0, "batches": 7, "rng": None}),
    "E-DL-22": lambda: loader_position({"epoch": 0, "batches": 1, "rng": torch.get_rng_state(),
                                        "processes": 2, "combined": 2, "batches_per_epoch": 2}),
    "E-DL-21": lambda: loader_position({"epoch": 0, "batches": 1, "rng": torch.get_rng_state()},
                                       dataset=Stream()),
    # ops
    "E-OPS-01": lambda: poptorch.identity_loss(3.0, "mean"),
    "E-OPS-02": lambda: poptorch.identity_loss(torch.ones(2), "max"),
    "E-OPS-03": lambda: poptorch.ipu_print_tensor([1.0]),
    "E-OPS-04": lambda: poptorch.setLogLevel("LOUD"),
    "E-OPS-05": lambda: poptorch.MultiConv().availableMemoryProportions("half"),
    "E-OPS-06": lambda: torch.ops.poptorch.internal_cast(torch.ones(1), "FLOAT8"),
    "E-OPS-07": lambda: torch.ops.poptorch.identity_loss(torch.ones(1), 5),
    "E-OPS-08": lambda: poptorch.registerCustomArgParser(tuple, object()),
    "E-OPS-09": lambda: poptorch.for_loop(2, torch.tanh, (torch.ones(1),)),
    "E-OPS-11": custom_op_unregistered,
    "E-OPS-12": lambda: poptorch.custom_op(torch.ones(1).numpy(), "CopyTensor", "ai.graphcore", 1,
                                           [torch.ones(1)]),
    "E-OPS-13": lambda: poptorch.custom_op([torch.ones(1)], "CopyTensor", "ai.graphcore", 1,
                                           [torch.ones(1)], attributes={"grain": [1, 2.0]}),
    "E-OPS-14": lambda: poptorch.custom_op([torch.ones(2)], "CopyTensor", "ai.graphcore", 1,
                                           [torch.ones(3)]),
    "E-OPS-15": lambda: poptorch.register_custom_op("Cube", 7, lambda x: x),
    "E-OPS-16": lambda: custom_ops.MissingLibrary("./custom_ops.so").some_function(),
    "E-OPS-10": lambda: poptorch.for_loop(2.5, torch.tanh, [torch.ones(1)]),
    "E-OPS-17": lambda: poptorch.custom_op([torch.nn.Parameter(torch.ones(1))] * 2 + [
        torch.ones(1)], "ExpMovAvg", "com.acme", 1, [torch.ones(1)]),
    "E-OPS-18": lambda: averaged_call(Averaging(teacher=lambda m: m.teacher.weight * 1), opts(),
                                      [0.5]),
    "E-OPS-19": lambda: averaged_call(Averaging(), opts(G=2), [0.5, 0.25]),
    "E-OPS-20": lambda: poptorch.custom_op([torch.ones(1, 3, 2), torch.ones(1, 3, 5)], "Nms",
                                           "ai.graphcore", 1, [torch.ones(1)],
                                           {"threshold": 0.5, "numDetections": 4}),
    "E-OPS-21": lambda: poptorch.custom_op([torch.ones(4, 1, 3), torch.ones(1, 2),
                                            torch.tensor([4]), torch.tensor([2])], "Ctc",
                                           "ai.graphcore", 1, [torch.ones(())],
                                           {"reduction": "Average"}),
    # schedules and timelines
    "E-SCH-01": lambda: Action.parse("1X0"),
    "E-SCH-02": lambda: build(P.Grouped, 0, 2, True),
    "E-SCH-03": lambda: grid(GOOD.rows, recompute=(True, False)),
    "E-SCH-04": lambda: grid(((a("0F0"), None),) + GOOD.rows[1:]),
    "E-SCH-05": lambda: grid(GOOD.rows + ((a("0F1"),),)),
    "E-SCH-06": lambda: grid(GOOD.rows[:1] + GOOD.rows),
    "E-SCH-07": lambda: grid(((None, a("0F0")), (a("1F0"), None)), num_stages=2, training=False,
                             stage_streams=(0, 1)),
    "E-SCH-08": lambda: grid(GOOD.rows[1:2] + GOOD.rows[:1] + GOOD.rows[2:]),
    "E-SCH-09": lambda: grid(GOOD.rows[:-1]),
    "E-TL-01": lambda: one_span(kind="X"),
    "E-TL-02": lambda: one_span(start=2.0, end=1.0),
    "E-TL-03": lambda: Timeline([one_span(stream=2)], ["s0", "s1"], "x"),
    "E-TL-04": lambda: Timeline.concat([]),
    "E-TL-05": lambda: Timeline.concat([Timeline([], ["s0"], "x"), Timeline([], ["s0"], "y")]),
    "E-TL-06": lambda: Timeline([one_span()], ["s0"], "x").render(width=0),
    "E-TL-07": lambda: Timeline.from_chrome_trace({"traceEvents": [
        {"ph": "X", "pid": 0, "tid": 0, "name": "conv", "cat": "kernel", "ts": 0, "dur": 1}]}),
    # runtime failures
    "E-RUN-01": action_fails,
    "E-RUN-02": watchdog_fires,
    "E-RUN-03": non_finite_loss,
    "E-RUN-04": interrupted,
    "E-RUN-05": optimizer_fails_part_way,
    "E-RUN-06": late_gpu_error,
    "E-DEV-01": lambda: on_devices({0: "cpu", 1: f"cuda:{torch.cuda.device_count() + 1}"}),
    "E-DEV-02": lambda: on_devices({0: "cpu", 1: "meta"}),
    "E-DEV-03": oversubscribed,
    "E-DEV-04": lambda: on_devices({0: "cpu", 2: "cpu"}),
    # checkpoints
    "E-CKP-01": lambda tmp_path: poptorch.save_checkpoint(
        tmp_path / "x.pt", poptorch.inferenceModel(Two())),
    "E-CKP-02": lambda tmp_path: poptorch.load_checkpoint(tmp_path / "none.pt", compiled_model()),
    "E-CKP-03": lambda tmp_path: (tmp_path / "bad.pt").write_bytes(b"PK\x03\x04 cut") and
    poptorch.load_checkpoint(tmp_path / "bad.pt", compiled_model()),
    "E-CKP-04": lambda tmp_path: torch.save(Two().state_dict(), tmp_path / "w.pt") or
    poptorch.load_checkpoint(tmp_path / "w.pt", compiled_model()),
    "E-CKP-05": lambda tmp_path: refuse_checkpoint(tmp_path, lambda s: s.update(version=7)),
    "E-CKP-06": lambda tmp_path: other_model(tmp_path, bn=True),
    "E-CKP-07": lambda tmp_path: refuse_checkpoint(tmp_path, lambda s: s["model"].update(
        {"l1.weight": torch.zeros(3, 3)})),
    "E-CKP-08": lambda tmp_path: refuse_checkpoint(tmp_path, lambda s: s.update(
        optimizer_class="Adam")),
    "E-CKP-09": lambda tmp_path: refuse_checkpoint(tmp_path, lambda s: s["optimizer"][
        "param_groups"][0].update(params=[0])),
    "E-CKP-10": lambda tmp_path: refuse_checkpoint(tmp_path, loader=poptorch.DataLoader(
        poptorch.Options(), ds(8), batch_size=2)),
    "E-CKP-11": lambda tmp_path: refuse_checkpoint(
        tmp_path, lambda s: s.update(dataloader={"epoch": 0, "batches": 9, "rng": None}),
        loader=poptorch.DataLoader(poptorch.Options(), ds(8), batch_size=2)),
    "E-CKP-12": lambda tmp_path: refuse_checkpoint(tmp_path, lambda s: s["rng"].pop("python")),
    "E-CKP-14": saved_before_the_first_call,
    "E-CKP-15": parts_of_two_steps,
    "E-CKP-16": lambda: spawned("checkpoint", 0, "missing"),
    "E-CKP-17": lambda: spawned("checkpoint", 0, "refused"),
    "E-CKP-18": lambda tmp: (torch.save({"weights": 1}, tmp / "other.pt"),
                             poptorch.load(tmp / "other.pt")),
    "E-CKP-20": chunks_that_miss,
    "E-CKP-21": lambda: spawned("sharded", 1, "chunk_missing"),
    "E-CKP-22": lambda: spawned("sharded", 1, "chunk_stale"),
    "E-CKP-19": lambda tmp: (compiled_model().save(tmp / "m.poptorch", export_model=False),
                             poptorch.load(tmp / "m.poptorch")),
    # several processes
    "E-PROC-01": lambda: poptorch.trainingModel(Two(), spread_options(W=3)),
    "E-PROC-02": rendezvous_missing,
    "E-PROC-03": initialised_otherwise,
    "E-PROC-04": lambda: spawned("refuse", 0, "mismatch"),
    "E-PROC-05": nobody_joins,
    "E-PROC-06": lambda: spawned("refuse", 1, "uncovered"),
    "E-PROC-07": lambda: spawned("refuse", 0, "stageless"),
    "E-PROC-12": lambda: spawned("refuse", 1, "averaged"),
    "E-PROC-13": lambda: popdist_total(dict(WORLD_SIZE="2", RANK="1",
                                            POPDIST_NUM_TOTAL_REPLICAS="3",
                                            POPDIST_NUM_LOCAL_REPLICAS="2")),
    "E-PROC-14": lambda: parse_poprun(["--num-replicas", "2", "--nproc-per-node", "2", "p"]),
    "E-PROC-15": lambda: parse_poprun(["--num-replicas", "3", "--num-instances", "2", "p"]),
    "E-PROC-16": lambda: parse_poprun(["--num-replicas", "3", "--num-instances", "3",
                                       "--host", "a,b", "p"]),
    "E-PROC-08": lambda: spawned("errors", 0, "remote"),
    "E-PROC-09": lambda: spawned("errors", 0, "lost"),
    "E-PROC-10": lambda: spawned("errors", 0, "broken"),
    "E-PROC-11": lambda: spawned("end", 0, "end"),
    "E-CKP-13": lambda tmp_path: refuse_checkpoint(tmp_path, lambda s: s.update(loss_scale={})),
    # warnings
    "W-IPU-01": lambda: poptorch.Options().Precision.enableStochasticRounding(True),
    "W-IPU-02": lambda: poptorch.SerialPhasedExecution(["a"]).useSeparateBackwardPhase(),
    "W-IPU-03": lambda: poptorch.set_available_memory(torch.ones(1), 0.5),
    "W-IPU-04": lambda: poptorch.serializedMatMul(torch.ones(2, 2), torch.ones(2, 2)),
    "W-IPU-05": lambda: poptorch.set_overlap_for_input(torch.ones(1)),
    "W-IPU-06": lambda: poptorch.set_overlap_for_output(torch.ones(1)),
    "W-IPU-07": lambda: poptorch.ipu_print_tensor(torch.ones(1, requires_grad=True),
                                                  print_gradient=True),
    "W-IPU-08": lambda: poptorch.AsynchronousDataAccessor([1], sharing_strategy="x").terminate(),
    "W-IPU-09": lambda: poptorch.Attribute(__outline={"layer": 0}).__enter__(),
    "W-IPU-13": lambda: poptorch.MultiConv().__enter__(),
    "W-LITE-01": lambda: poptorch.inferenceModel(Two(tail="none"), opts())(
        torch.randn(2, 4, requires_grad=True), torch.randn(2, 4)),
    "W-LITE-02": lambda: poptorch.DataLoader(poptorch.Options(), Stream(), num_workers=2),
    "W-LITE-03": lambda: poptorch.DataLoader(poptorch.Options(), ds(), batch_size=3,
                                             drop_last=False),
    "W-LITE-04": lambda: poptorch.Options().outputMode(poptorch.OutputMode.All, 2),
    "W-LITE-05": lambda: optim.SGD(params(), lr=0.1, velocity_scaling=2.0),
    "W-LITE-06": lambda: optim.check_optimizer(type("MySGD", (torch.optim.SGD,), {})(
        params(), lr=0.1)),
    "W-LITE-07": lambda: (lambda w: (w.compile(torch.randn(2, 4), torch.randn(2, 4)),
                                     w.compile(torch.randn(2, 4), torch.randn(2, 4))))(
        poptorch.inferenceModel(Two(tail="none"), opts())),
    "W-LITE-09": lambda: tf1_refuses(gradient_accumulation_dtype=torch.float16,
                                     computational_stages=[torch.nn.Linear(4, 4)], optimizer=None),
    "W-IPU-10": lambda: keras_model().set_pipelining_options(offload_activations=True),
    "W-IPU-11": lambda: (lambda c: (setattr(c, "selection_order", "SNAKE"),
                                    c.configure_ipu_system()))(keras.IPUConfig()),
    "W-IPU-12": lambda: (lambda c: (setattr(c.device_connection, "type", "ON_DEMAND"),
                                    c.configure_ipu_system()))(keras.IPUConfig()),
    "W-LITE-10": lambda: keras_model(spe=8).evaluate(torch.randn(16, 4), torch.randn(16, 2),
                                                     batch_size=4, verbose=0),
    "W-LITE-11": lambda: (lambda w: (w(torch.randn(2, 4), torch.randn(2, 4)), w.destroy(),
                                     w(torch.randn(2, 4), torch.randn(2, 4))))(
        poptorch.trainingModel(Two(), opts())),
    "W-LITE-12": lambda: poptorch.trainingModel(Two(tail="none_mse"), opts())(
        torch.randn(2, 4), torch.randn(2, 4)),
    "W-LITE-13": lambda: poptorch.trainingModel(Two(tail="python_random"), opts())(
        torch.randn(2, 4), torch.randn(2, 4)),
    "W-LITE-14": lambda: poptorch.trainingModel(Two(tail="counter"), opts())(
        torch.randn(2, 4), torch.randn(2, 4)),
    "W-LITE-15": attribute_changed_every_call,
    "W-LITE-21": hooks_changed_every_call,
    "W-LITE-16": missing_op_library,
    "W-LITE-17": lambda: poptorch.Options().Jit.traceModel(True),
    "E-PART-28": constant_written_on_a_gpu,
    "W-LITE-18": normalisation_frozen_between_calls,
    "W-LITE-19": own_mode_changed_after_wrapping,
    "W-LITE-20": encoder_under_a_cpu_autocast,
    "W-LITE-08": lambda: keras_model(spe=1).fit(torch.randn(10, 4), torch.randn(10, 2),
                                               batch_size=4, verbose=0, drop_remainder=True),
}


def _run(trigger, tmp_path):
    return trigger(tmp_path) if trigger.__code__.co_argcount else trigger()


def test_every_documented_id_has_a_trigger_and_every_trigger_a_row():
    assert set(ROWS) == set(T), (sorted(set(ROWS) - set(T)), sorted(set(T) - set(ROWS)))
    for row_id, (cls_name, message) in ROWS.items():  # a row must pin real text and a class
        assert len(re.sub(r"<[^<>]*>", "", message)) >= 15, row_id
        assert isinstance(documented_class(cls_name), type), row_id


def test_every_site_is_a_module_that_defines_the_function_named():
    """The last column says where a row is raised: ``path.py `Class.function```, relative to
    the package; the file must exist and define each dotted part of the name."""
    package = DOC.parent.parent / "poptorch_lite"
    sites = 0
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if not re.match(r"\|\s*[EW]-[A-Z]+-\d+\s*\|", line):
            continue
        row_id, site = _cells(line)[0], _cells(line)[-1]
        for path, name in re.findall(r"([\w/]+\.py)(?: `([\w.]+)`)?", site):
            source = package / path
            assert source.is_file(), f"{row_id}: no poptorch_lite/{path}"
            text = source.read_text(encoding="utf-8")
            for part in name.split(".") if name else ():
                assert re.search(rf"^\s*(def|class) {part}\b", text, re.M), \
                    f"{row_id}: poptorch_lite/{path} defines no {part}"
            sites += 1
    assert sites > 200


@pytest.mark.parametrize("row_id", sorted(i for i in ROWS if i.startswith("E-")))
def test_refusal_is_raised_as_documented(row_id, tmp_path):
    cls_name, message = ROWS[row_id]
    cls = documented_class(cls_name)
    with pytest.raises(cls) as info:
        _run(T[row_id], tmp_path)
    assert type(info.value) is cls, f"{row_id}: raised {type(info.value).__name__}"
    text = "\n".join([str(info.value), *getattr(info.value, "__notes__", [])])
    assert re.search(pattern(message), text, re.DOTALL), \
        f"{row_id}: documented\n  {message}\nbut got\n  {text}"
    if hasattr(errors, cls_name):  # builtins (timeline's ValueError, Ctrl-C) are documented
        assert isinstance(info.value, poptorch.Error)


@pytest.mark.parametrize("row_id", sorted(i for i in ROWS if i.startswith("W-")))
def test_warning_is_issued_as_documented(row_id, tmp_path):
    cls_name, message = ROWS[row_id]
    cls = documented_class(cls_name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(T[row_id], tmp_path)
    ours = [w for w in caught if issubclass(w.category, poptorch.PoptorchLiteWarning)]
    hits = [w for w in ours if w.category is cls and re.search(pattern(message), str(w.message))]
    assert hits, f"{row_id}: documented {cls_name} `{message}`, got " \
                 f"{[(w.category.__name__, str(w.message)) for w in ours]}"


def test_a_runtime_failure_names_its_place_and_the_model_works_again():
    with pytest.raises(poptorch.ExecutionError) as info:
        action_fails()
    text = str(info.value)
    assert re.search(r"^action 1F\d \(forward\) failed on stream 1", text)
    assert [line for line in text.splitlines() if line.startswith(">>")]
    assert isinstance(info.value.__cause__, RuntimeError)
