"""The fuzzer's Keras face: the programs a ``keras.Sequential`` can express, fit against plain
PyTorch.

The subset of the grammar (tests/support/fuzz_grammar.py) that is a list of layers: each stage's
``Linear(6, 6)`` and ``Tanh`` (parametrized by weight_norm, spectral_norm or a
parametrization; with module and parameter hooks, a frozen bias), a BatchNorm layer, a
Linear used again at another stage (tied weights), then the ``Linear(6, 4)`` head; the loss
is Keras' sparse categorical cross-entropy from logits, the optimizer SGD with momentum
(tests/frontends/test_keras.py's ``sgd``). :func:`check` runs ``model.fit`` (``shuffle=False``) and
test_keras's plain loop (a step per G·R batches, gradients summed then divided by G·R; with
replicas, each keeps its own BatchNorm statistics, the host's being replica 0's) from the
same weights, and compares every weight and buffer and the history's losses and
accuracies: bit for bit where each step is one batch (G·R = 1, as test_keras holds), else
within 1e-5, a small difference confirmed in float64 before it counts (fuzz_check's rule).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from hypothesis import strategies as st

from fuzz_check import Finding
from fuzz_draw import PENDING
from fuzz_grammar import CLASSES, FEATURES, WIDTH, Op, Program, writes_buffers
from keras_models import orders, plain, sgd

from poptorch_lite import keras

#: The grammar's ops a list of layers can hold ("tied" cannot: a layer listed twice is one
#: child of the Sequential, and the stage assignment counts children).
OPS = ("batchnorm", "weight_norm", "spectral_norm", "parametrize", "forward_hook",
       "module_hook", "pre_hook", "param_hook", "frozen")
_HOOKS = ("forward_hook", "module_hook", "pre_hook", "param_hook", "frozen")
SCHEDULES = ("Grouped", "Sequential", "Interleaved", "ZeroBubble")


@dataclasses.dataclass(frozen=True)
class KerasConfig:
    """How ``fit`` runs: G, R, D executions' worth of batches per execution
    (``steps_per_execution = D·G·R``), ``executions`` per epoch."""
    schedule: str = "Grouped"
    G: int = 1
    R: int = 1
    D: int = 1
    B: int = 2
    epochs: int = 1
    executions: int = 1
    recompute: bool = False
    dtype: str = "float32"


_INIT = {  # what an op does to stage s's Linear l{s} (named ``l``), as Python
    "weight_norm": "l = torch.nn.utils.parametrizations.weight_norm(l)",
    "spectral_norm": "l = torch.nn.utils.parametrizations.spectral_norm(l)",
    "parametrize": "torch.nn.utils.parametrize.register_parametrization(l, \"weight\", "
                   "Symmetric())",
}


def layers_source(program: Program) -> str:
    """``make_layers()``: the program's layers and the stage of each."""
    body = []
    for s in range(program.stages):
        body.append(f"l{s} = torch.nn.Linear({WIDTH}, {WIDTH})")
        for op in program.ops:
            if op.stage == s and op.kind in _INIT:
                body.append(_INIT[op.kind].replace("l =", f"l{s} =").replace("(l", f"(l{s}"))
            elif op.stage == s and op.kind in _HOOKS:
                body += FEATURES[op.kind].init.format(s=s, i=0).replace("self.", "").split("\n")
    for s in range(program.stages):
        body.append(f"layers += [l{s}, torch.nn.Tanh()]")
        for op in program.ops:
            if op.kind == "batchnorm" and op.stage == s:
                body.append(f"layers.append(torch.nn.BatchNorm1d({WIDTH}))")
        body.append(f"stages += [{s}] * (len(layers) - len(stages))")
    body += [f"layers.append(torch.nn.Linear({WIDTH}, {CLASSES}))", "stages.append(stages[-1])",
             "return layers, stages"]
    return _HEAD + "\n".join("    " + line for line in body) + "\n"


_HEAD = '''import torch
import torch.nn.utils.parametrize
from poptorch_lite import keras
from keras_models import sgd


class Symmetric(torch.nn.Module):
    def forward(self, w):
        return (w + w.t()) / 2


def make_layers():
    layers, stages = [], []
'''


def source(program: Program, config: KerasConfig) -> str:
    """The Keras script of ``program``: its layers, stages, options, compile and fit."""
    lines = ["", "", "torch.manual_seed(0)", "layers, stages = make_layers()"]
    if config.R > 1:
        lines += ["config = keras.IPUConfig()",
                  f"config.auto_select_ipus = {config.R * program.stages}  # {config.R} replicas",
                  "with keras.IPUStrategy(config).scope():",
                  "    model = keras.Sequential(layers)"]
    else:
        lines.append("model = keras.Sequential(layers)")
    if program.stages > 1:
        lines.append("model.set_pipeline_stage_assignment(stages)")
    mode = '"Auto"' if config.recompute else "None"
    lines += [f"model.set_pipelining_options(gradient_accumulation_steps_per_replica={config.G},",
              "                             pipeline_schedule=keras.PipelineSchedule."
              f"{config.schedule},",
              f"                             recomputation_mode={mode})",
              "model.compile(sgd, keras.losses.SparseCategoricalCrossentropy(from_logits=True),",
              "              [\"accuracy\"], steps_per_execution="
              f"{config.D * config.G * config.R})",
              f"history = model.fit(x, y, batch_size={config.B}, epochs={config.epochs}, "
              "shuffle=False, verbose=0)"]
    if config.dtype != "float32":
        lines.append(f"# layers and x in torch.{config.dtype}")
    return layers_source(program) + "\n".join(lines) + "\n"


def _layers(program: Program, config: KerasConfig):
    namespace = {}
    exec(compile(layers_source(program), "<fuzz keras>", "exec"), namespace)  # noqa: S102
    torch.manual_seed(0)
    layers, stages = namespace["make_layers"]()
    dtype = getattr(torch, config.dtype)
    return [layer.to(dtype) for layer in layers], stages


def _data(program: Program, config: KerasConfig):
    n = config.B * config.D * config.G * config.R * config.executions
    g = torch.Generator().manual_seed(5)
    return (torch.randn(n, WIDTH, generator=g).to(getattr(torch, config.dtype)),
            torch.randint(0, CLASSES, (n,), generator=g))


def _run(program: Program, config: KerasConfig) -> list:
    """What differs between ``fit`` and the plain loop (empty: nothing)."""
    x, y = _data(program, config)
    layers, stages = _layers(program, config)
    ref_layers, _ = _layers(program, config)
    ref = torch.nn.Sequential(*ref_layers)
    replicas = config.R > 1 and writes_buffers(program)
    expected = plain(_Replicas(ref, config.R) if replicas else ref, x, y, config.B, config.G,
                     config.R, orders(len(x), config.epochs, False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if config.R > 1:
                ipu_config = keras.IPUConfig()
                ipu_config.auto_select_ipus = config.R * program.stages
                with keras.IPUStrategy(ipu_config).scope():
                    model = keras.Sequential(layers)
            else:
                model = keras.Sequential(layers)
            if program.stages > 1:
                model.set_pipeline_stage_assignment(stages)
            model.set_pipelining_options(
                gradient_accumulation_steps_per_replica=config.G,
                pipeline_schedule=getattr(keras.PipelineSchedule, config.schedule),
                recomputation_mode="Auto" if config.recompute else None)
            model.compile(sgd, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          ["accuracy"], steps_per_execution=config.D * config.G * config.R)
            history = model.fit(x, y, batch_size=config.B, epochs=config.epochs,
                                shuffle=False, verbose=0).history
        except Exception as e:  # noqa: BLE001: plain PyTorch ran it
            return [f"fit failed where plain PyTorch runs: {type(e).__name__}: {e}"[:600]]
    exact = config.G * config.R == 1
    tol = 0.0 if exact else (1e-5 if config.dtype == "float32" else 1e-7)
    found = []
    got, want = dict(model.module.state_dict()), dict(ref.state_dict())
    for name in sorted(set(got) | set(want)):
        if name not in got or name not in want:
            found.append(f"{name}: only in {'fit' if name in got else 'plain PyTorch'}")
            continue
        a, b = got[name].detach().double(), want[name].detach().double()
        if a.shape != b.shape or ((a - b).abs() > tol + tol * b.abs()).any():
            found.append(f"{name}: differs by {(a - b).abs().max().item():.3g} (tolerance {tol:g})")
    for key in ("loss", "accuracy"):
        if any(abs(a - b) > tol + tol * abs(b) for a, b in zip(history[key], expected[key])):
            found.append(f"history[{key!r}] {history[key]} != {expected[key]}")
    return found


class _Replicas(torch.nn.Module):
    """``net`` with each replica's own buffers (BatchNorm's statistics are per replica:
    [Note: running statistics on replicas] in poptorch_lite/compiler/running_stats.py):
    batch k is replica k % R's (the PopTorch face's [D, G, R, B] order); between forwards
    ``net`` holds replica 0's, as the host does. Swapped as objects, not copied: the
    backward reads the statistics its forward saved."""

    def __init__(self, net: torch.nn.Module, R: int):
        super().__init__()
        self.net, self.R, self.k = net, R, 0
        self.slots = [(m, n) for m in net.modules() for n, b in m._buffers.items()
                      if b is not None]
        self.own = [[m._buffers[n] if r == 0 else m._buffers[n].clone() for m, n in self.slots]
                    for r in range(R)]

    def _hold(self, r: int) -> None:
        for (m, n), b in zip(self.slots, self.own[r]):
            m._buffers[n] = b

    def forward(self, x):
        r, self.k = self.k % self.R, self.k + 1
        self._hold(r)
        try:
            return self.net(x)
        finally:
            self._hold(0)


def check(program: Program, config: KerasConfig) -> str:
    """``fit`` against plain PyTorch (module doc).

    Raises:
        Finding: what differs, with the Keras script.
    """
    found = _run(program, config)
    if found and config.G * config.R > 1 and config.dtype == "float32" and all(
            "differs by" in f and float(f.split("differs by ")[1].split()[0]) < 1e-3
            for f in found):
        if not _run(program, dataclasses.replace(config, dtype="float64")):
            return "rounding"
    if found:
        raise Finding("\n".join(found[:8]) + "\n\n" + source(program, config)
                      + f"\n# as data\n{program!r}\n{config!r}\n")
    return "exact"


def _accumulations(schedule: str, S: int) -> list:
    """The two smallest G that IPU Keras' schedule takes for S stages: Grouped a multiple of
    2S, Interleaved a multiple of S and at least 2S - 1 (keras_ipu's check), else any."""
    def valid(G):
        if S == 1 or schedule not in ("Grouped", "Interleaved"):
            return True
        return G % (2 * S) == 0 if schedule == "Grouped" else G % S == 0 and G >= 2 * S - 1
    return [G for G in range(1, 4 * S + 1) if valid(G)][:2]


@st.composite
def examples(draw, pending=frozenset(PENDING)) -> tuple:
    """A (program, KerasConfig) pair of the Keras subset."""
    stages = draw(st.integers(1, 3))
    R = draw(st.integers(1, 2))
    kinds = [k for k in OPS if k not in pending and not (
        R > 1 and FEATURES[k].buffers == "own" and "keras_replicated_buffers" in pending)]
    op = st.builds(Op, st.sampled_from(kinds), st.integers(0, stages - 1))
    program = Program(stages=stages, ops=tuple(draw(st.lists(op, max_size=2))))
    schedule = draw(st.sampled_from(SCHEDULES))
    config = KerasConfig(schedule=schedule, G=draw(st.sampled_from(_accumulations(schedule,
                                                                                  stages))),
                         R=R, D=draw(st.integers(1, 2)),
                         B=draw(st.sampled_from([2, 3])), epochs=draw(st.integers(1, 2)),
                         executions=draw(st.integers(1, 2)), recompute=draw(st.booleans()))
    return program, config
