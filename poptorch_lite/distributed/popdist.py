"""PopDist's face: which instance of a launch this process is, answered from its launcher.

[Note: instances]
PopTorch programs ask ``popdist`` who they are; ``poprun`` launches the instances (here
``poprun`` is ``poptorch_lite/poprun.py``, on torch's own launcher). An *instance* is one
process; it runs ``getNumLocalReplicas()`` replicas of the model, and the instances'
replicas together make ``getNumTotalReplicas()``. The answers come from the environment the
launcher leaves, the same variables ``Options.Distributed`` reads ([Note: process ids] in
``options/groups.py``), so that ``popdist`` and the options never disagree:

- the instance index and count: mpirun's ``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` first, else
  torchrun's ``RANK`` / ``WORLD_SIZE`` (``poprun`` is torchrun underneath);
- the replicas per instance and per replica's IPUs: ``poprun``'s ``POPDIST_NUM_LOCAL_REPLICAS``
  and ``POPDIST_NUM_IPUS_PER_REPLICA`` (1 and 1 under a plain ``torchrun``: each process one
  instance of one replica); ``POPDIST_NUM_TOTAL_REPLICAS`` must be their product with the
  instance count (PopDist's uniform layout), and the offset of an instance's replicas is its
  index times the local count.

``isPopdistEnvSet()`` is True when a launcher started the process (one of those variables
is set), also for a single instance; ``python script.py`` alone is not distributed, as on an
IPU host without ``poprun``. ``init()`` joins torch.distributed's default group the way a
training wrapper would ([Note: replicas across processes] in ``processes``), so the program's
own collectives (Horovod's, in Graphcore's applications) and ``execute_on_instances`` have
one; the wrappers adopt it.
"""

from __future__ import annotations

import importlib.machinery
import os
import types
from typing import Any, Callable, Iterable, Optional

from ..errors import OptionsError

__all__ = ["instance", "popdist_modules"]

POPRUN_VARIABLES = ("POPDIST_NUM_TOTAL_REPLICAS", "POPDIST_NUM_LOCAL_REPLICAS",
                    "POPDIST_NUM_IPUS_PER_REPLICA")


def _int(name: str, default: Optional[int]) -> Optional[int]:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 1:
        raise OptionsError(f"environment variable {name}={text!r} is not a positive integer; "
                           f"launch with poprun, which sets it, or unset it")
    return value


def instance() -> tuple[int, int]:
    """``(index, count)`` of this instance among the launch's: what ``Options.Distributed``
    reads from the launcher's variables (``(0, 1)`` when no launcher started this process).

    Raises:
        OptionsError: a variable is not an integer, or the index is not below the count.

    Example:
        >>> instance() if "WORLD_SIZE" not in os.environ else (0, 1)
        (0, 1)
    """
    from ..options.groups import _DistributedOptions

    read = _DistributedOptions()
    return read.process_id, read.num_processes


# -- PopDist's API ------------------------------------------------------------------------

def isPopdistEnvSet() -> bool:  # noqa: N802 (PopDist's names)
    """Whether a launcher (``poprun``, ``torchrun`` or ``mpirun``) started this process."""
    return any(v in os.environ for v in
               ("OMPI_COMM_WORLD_SIZE", "WORLD_SIZE", *POPRUN_VARIABLES))


def isUsingPopdist() -> bool:  # noqa: N802
    """As :func:`isPopdistEnvSet`."""
    return isPopdistEnvSet()


def getInstanceIndex() -> int:  # noqa: N802
    """This instance's index, 0 <= index < :func:`getNumInstances`."""
    return instance()[0]


def getNumInstances() -> int:  # noqa: N802
    """The number of instances (processes) of the launch."""
    return instance()[1]


def getNumLocalReplicas() -> int:  # noqa: N802
    """The replicas this instance runs (``poprun --num-replicas`` / ``--num-instances``)."""
    return _int("POPDIST_NUM_LOCAL_REPLICAS", 1)


def getReplicationFactor() -> int:  # noqa: N802
    """As :func:`getNumLocalReplicas`: the ``replicationFactor`` of this instance's options."""
    return getNumLocalReplicas()


def getNumTotalReplicas() -> int:  # noqa: N802
    """Every instance's replicas together.

    Raises:
        OptionsError: ``POPDIST_NUM_TOTAL_REPLICAS`` is not the local count times the
            instance count (the instances must run the same number of replicas each).
    """
    local, instances = getNumLocalReplicas(), getNumInstances()
    total = _int("POPDIST_NUM_TOTAL_REPLICAS", local * instances)
    if total != local * instances:
        raise OptionsError(
            f"POPDIST_NUM_TOTAL_REPLICAS={total} is not POPDIST_NUM_LOCAL_REPLICAS={local} times "
            f"the instance count {instances}; each instance runs the same number of replicas: "
            f"launch with poprun --num-replicas {local * instances} --num-instances {instances}")
    return total


def getReplicaIndexOffset() -> int:  # noqa: N802
    """The global index of this instance's first replica."""
    return getInstanceIndex() * getNumLocalReplicas()


def getNumIpusPerReplica() -> int:  # noqa: N802
    """``poprun --ipus-per-replica`` (1 without): the IPUs, here stages' devices, a replica
    is given; the model's own stages decide how many it uses."""
    return _int("POPDIST_NUM_IPUS_PER_REPLICA", 1)


def getDeviceId(ipus_per_replica: Optional[int] = None) -> int:  # noqa: N802
    """0: each instance's devices start at its first (CUDA's ``LOCAL_RANK`` picks the GPU)."""
    return 0


def init() -> None:
    """Join torch.distributed's default group when there are several instances (once)."""
    index, count = instance()
    if count > 1:
        from .processes import join_default_group
        join_default_group(index, count, backend=None)


def finalizeBackend() -> None:  # noqa: N802
    """Leave the group :func:`init` (or a wrapper) joined."""
    from .processes import shutdown
    shutdown()


def execute_on_instances(instances: Iterable[int], function: Callable, *args: Any,
                         **kwargs: Any) -> Any:
    """Call ``function`` in the instances named, while the others wait for them; returns its
    result there, None elsewhere."""
    wanted = set(instances)
    index, count = instance()
    result = function(*args, **kwargs) if index in wanted else None
    if count > 1:
        init()
        import torch.distributed as dist
        dist.barrier()
    return result


def _options(ipus_per_replica: Optional[int] = None, **kwargs: Any):
    """``popdist.poptorch.Options``: PopTorch ``Options`` for this instance: its local
    replication and its place among the instances (``Options.Distributed``)."""
    from ..options.options import Options

    opts = Options(**kwargs)
    opts.replicationFactor(getNumLocalReplicas())
    opts.Distributed.configureProcessId(getInstanceIndex(), getNumInstances())
    getNumTotalReplicas()  # refuses a non-uniform launch
    return opts


def popdist_modules() -> tuple[types.ModuleType, types.ModuleType]:
    """``popdist`` and ``popdist.poptorch``, answering from the launcher's environment.

    Example:
        >>> popdist, _ = popdist_modules()
        >>> popdist.getNumInstances() == instance()[1]
        True
    """
    popdist = types.ModuleType("popdist", "PopDist on torch.distributed (poptorch_lite's).")
    for fn in (isPopdistEnvSet, isUsingPopdist, getInstanceIndex, getNumInstances,
               getNumLocalReplicas, getNumTotalReplicas, getReplicationFactor,
               getReplicaIndexOffset, getNumIpusPerReplica, getDeviceId, init,
               finalizeBackend, execute_on_instances):
        setattr(popdist, fn.__name__, fn)
    sub = types.ModuleType("popdist.poptorch", "PopDist's PopTorch options for this instance.")
    sub.Options = _options
    popdist.poptorch = sub
    popdist.__path__ = []  # a package, so `import popdist.poptorch` resolves the submodule
    popdist.__spec__ = importlib.machinery.ModuleSpec("popdist", None, is_package=True)
    sub.__spec__ = importlib.machinery.ModuleSpec("popdist.poptorch", None)
    return popdist, sub
