"""After-step averages: weights a forward asks to be averaged after the optimizer's step.

[Note: after-step averages]
DINO keeps a teacher whose weights follow the student's as an exponential moving average.
On an IPU it calls, in its forward, the custom op ``ExpMovAvg`` (``com.acme``) on
``[student_param, teacher_param, factor]``; a PopART pattern turns the op into an
``AccumulateOp(MovingAverage)`` scheduled in the step's outer fragment, after the gradient
accumulation loop and the optimizer's update (vision/dino/pytorch/ema/exp_avg_custom_op.cpp):

    teacher = factor * teacher + (1 - factor) * student        (the student after the step)

which is what DINO's CPU reference does after ``optimizer.step()`` (``gpu_update_teacher``).
Here the op's implementation (``custom_ops``), while a training model is traced, leaves one
node in the graph, :data:`AVERAGE` ``(factor, student, teacher)``, and returns the teacher as
it is. The node runs wherever the partition puts it, with the stage's own tensors of the two
parameters, and notes the micro-batch's factor; the update action (``update``), after the
optimizer's step and before the step's copies are refreshed, averages each noted teacher's
home from its student's home (:func:`take`, :func:`apply`), in the factor's arithmetic:
``1 - factor`` is computed in the factor's dtype, as the ``AccumulateOp`` computes it.

- **The factor.** PopART streams the factor in with every micro-batch, and the outer fragment
  reads what the last one left; each replica averages its own copy with its own. DINO gives
  every micro-batch of a step the same factor. Here a step whose micro-batches or replicas
  were given different factors is refused (:class:`~poptorch_lite.errors.CustomOpError`)
  before its optimizer's step: one copy of the weights cannot hold replicas that averaged
  differently, and which micro-batch the outer fragment sees last is PopART's schedule's.
- **Where it is refused.** In an inference model (there is no step), outside a wrapped model
  (``custom_ops``: average the weights after ``optimizer.step()`` yourself), with stages in
  other processes (a teacher homed in another process than the op's stage would not follow),
  and in a captured CUDA step (the node notes its factor from Python, which a replay would not
  run: ``step_graph`` runs such a step eagerly, as it does ``ipu_print_tensor``).

A run starts with nothing noted for its weights (:func:`forget`), so a run that failed before
its step leaves no factor for the next one.
"""

from __future__ import annotations

import threading

import torch

from ..compiler.subgraphs import base_op
from ..errors import CustomOpError
from .streams import arrive

_lib = torch.library.Library("poptorch_lite", "FRAGMENT")
_lib.define("average_after_step(Tensor factor, Tensor student, Tensor teacher) -> ()")

_noted: dict = {}  # id(teacher tensor of a stage) -> [(factor, student tensor, teacher tensor)]
_lock = threading.Lock()  # stages note from their worker threads


def _note(factor: torch.Tensor, student: torch.Tensor, teacher: torch.Tensor) -> None:
    from ..compiler.markers import is_tracing
    if is_tracing():  # the trace runs the forward once; only real runs note a factor
        return
    with _lock:
        _noted.setdefault(id(teacher), []).append((factor.detach().clone(), student, teacher))


_lib.impl("average_after_step", _note, "CompositeExplicitAutograd")
torch.fx.node.has_side_effect(torch.ops.poptorch_lite.average_after_step.default)
AVERAGE = torch.ops.poptorch_lite.average_after_step.default


def in_graphs(modules, ops=(AVERAGE,)) -> bool:
    """Whether any of the fx graph modules holds a node of one of ``ops`` (through the
    wrappers of its target: ``subgraphs.base_op``)."""
    return any(base_op(n.target) in ops for gm in modules for n in gm.graph.nodes)


def forget(weights) -> None:
    """Drop what was noted for ``weights``' tensors (a run begins)."""
    if _noted:
        mine = weights.tensor_names()
        with _lock:
            for key in [k for k in _noted if k in mine]:
                del _noted[key]


def take(weights) -> list:
    """What was noted for ``weights`` since the run began, checked, as ``(factor, student,
    teacher)`` names for :func:`apply` ([Note: after-step averages]); call it before the step.

    Raises:
        CustomOpError: the step's micro-batches or replicas were given different factors.
    """
    if not _noted:
        return []
    names = weights.tensor_names()
    with _lock:
        mine = [(k, _noted.pop(k)) for k in list(_noted) if k in names]
    averages = []
    for key, notes in mine:
        factor, student, _ = notes[-1]
        if len(notes) > 1:
            given = torch.stack([f.to(factor.device).reshape(factor.shape) for f, _, _ in notes])
            if not bool((given == factor).all()):
                raise CustomOpError(
                    f"ExpMovAvg of {names[id(student)]!r} into {names[key]!r}: the micro-batches "
                    f"and replicas of one step were given different factors "
                    f"({sorted(set(given.flatten().tolist()))}); the average runs once a step, "
                    f"after the optimizer's, and PopTorch's replicas would each average with "
                    f"their own, which one copy of the weights cannot hold. Give every "
                    f"micro-batch of a step the same factor")
        averages.append((factor, names[id(student)], names[key]))
    return averages


def apply(weights, averages: list) -> None:
    """``teacher = f * teacher + (1 - f) * student`` on the homes, for each of ``averages``
    (:func:`take`'s), after the optimizer's step."""
    if not averages:
        return
    with torch.no_grad():
        for factor, s, t in averages:
            teacher, student = weights.home(t), weights.home(s)
            f = arrive(factor, teacher.device).to(teacher.dtype)
            teacher.mul_(f).add_(arrive(student, teacher.device) * (1 - f))
