"""PopTorch's per-replica variables on the face: ``poptorch_model.W.replicaGrouping(...)``.

A parameter read through a wrapper (``poptorch_model.W``) is the model's own ``Parameter``
(PopTorch hands out a stand-in that is no tensor) with PopTorch's ``replicaGrouping``
method on it: an attribute of that instance, pointing at the wrapper it was read through,
as PopTorch keys it by wrapper. A copy or pickle of the parameter carries None there, so
a saved model never needs poptorch_lite to load. The call checks its arguments against the
options and the parameter and records, per parameter name, the group of each replica; the
runtime does the rest ([Note: per-replica variables] in ``runtime/replica_groups``).
"""

from __future__ import annotations

import weakref

import torch

from .enums import CommGroupType, VariableRetrievalMode
from .errors import OptionsError, WrapError
from .options.base import coerce_enum
from .runtime.replica_groups import groups


class _ReplicaGrouping:
    """A parameter's ``replicaGrouping(comm_group_type, shards, variable_retrieval_mode)``."""

    __slots__ = ("wrapper", "name")

    def __init__(self, wrapper, name: str):
        self.wrapper, self.name = wrapper, name  # a weak reference to the wrapper

    def __call__(self, comm_group_type, shards: int,
                 variable_retrieval_mode=VariableRetrievalMode.OnePerGroup) -> None:
        held = self.wrapper()
        if held is None:
            raise WrapError(f"replicaGrouping() on {self.name}: the wrapper it was read "
                            f"through is gone; read it as poptorch_model.{self.name}")
        record(held, self.name, comm_group_type, shards, variable_retrieval_mode)

    def __reduce__(self):  # a pickled parameter carries None: loading needs no poptorch_lite
        return type(None), ()

    def __deepcopy__(self, memo):
        return None


def offer(wrapper, name: str, value):
    """``value`` (an attribute of the user's model) with ``replicaGrouping`` on it when it is a
    parameter."""
    if isinstance(value, torch.nn.Parameter):
        value.__dict__["replicaGrouping"] = _ReplicaGrouping(weakref.ref(wrapper), name)
    return value


def record(wrapper, name: str, comm_group_type, shards: int, mode) -> None:
    """Check a ``replicaGrouping`` call and record each replica's value of ``name``.

    Raises:
        WrapError: the model already compiled, or its replicas run in other processes.
        OptionsError: a retrieval mode other than OnePerGroup, a group size that does not
            divide the replicas, or a parameter whose dim 0 is not one value per group.
    """
    if wrapper._compiled:
        raise WrapError(f"replicaGrouping() on {name} after the model compiled: call it before "
                        f"the first call (or compile())")
    if wrapper._processes is not None:
        raise WrapError(f"replicaGrouping() on {name}: per-replica variables with replicas in "
                        f"other processes are not supported; run the replicas in one process")
    kind = coerce_enum(comm_group_type, CommGroupType, "replicaGrouping comm_group_type")
    if coerce_enum(mode, VariableRetrievalMode, "replicaGrouping variable_retrieval_mode") \
            != VariableRetrievalMode.OnePerGroup:
        raise OptionsError(f"replicaGrouping() on {name}: only VariableRetrievalMode.OnePerGroup "
                           f"is supported (the host holds one value per group); pass it")
    R = wrapper._options.replication_factor
    sized = kind in (CommGroupType.Consecutive, CommGroupType.Orthogonal)
    if sized and (isinstance(shards, bool) or not isinstance(shards, int) or shards < 1
                  or R % shards):
        raise OptionsError(f"replicaGrouping({kind.name}, {shards!r}) on {name}: the group size "
                           f"must be a positive int that divides replicationFactor ({R})")
    per_replica = groups(kind, shards, R)
    param = dict(wrapper._user_model.named_parameters())[name]
    count = max(per_replica) + 1
    if param.dim() == 0 or param.shape[0] != count:
        raise OptionsError(f"replicaGrouping({kind.name}, {shards}) on {name} gives {R} replicas "
                           f"{count} values, one per group, along dim 0, but {name} has shape "
                           f"{tuple(param.shape)}; give it a dim 0 of {count}")
    wrapper._replica_values[name] = per_replica
