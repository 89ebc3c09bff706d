"""The core sub-groups of Options: ``Training`` (accumulation, reduction) and ``Distributed``.

``Options.Training`` holds G and how the G*R micro-batch gradients are reduced
(POPTORCH_REFERENCE.md §2); ``Options.Distributed`` holds this process's rank
among several instances (§8). Both are option groups (see ``options/base.py``).

Example:
    >>> from poptorch_lite.options import Options
    >>> Options().Training.gradientAccumulation(4).gradient_accumulation
    4
"""

from __future__ import annotations

import os

from .. import errors
from ..enums import MeanReductionStrategy, ReductionType
from .base import (OptionGroup, check_bool, check_positive_int, coerce_enum, setter, via_setter,
                   warn_ipu_only)


class _StrategyValue(int):
    """PopTorch's ``Training.meanAccumulationAndReplicationReductionStrategy``: a value and a setter.

    PopTorch stores the strategy under that name, so scripts read it back
    (``... == poptorch.MeanReductionStrategy.Running``); scripts also call it
    like the setter (``...meanAccumulationAndReplicationReductionStrategy(
    poptorch.MeanReductionStrategy.Post)``). This int compares equal to the
    stored ``MeanReductionStrategy`` and, called, sets a new one.

    Example:
        >>> t = _TrainingOptions()
        >>> t.meanAccumulationAndReplicationReductionStrategy == MeanReductionStrategy.Post
        True
    """

    def __new__(cls, group: "_TrainingOptions"):
        value = super().__new__(cls, group.mean_reduction_strategy)
        value._group = group
        return value

    def __call__(self, strategy: MeanReductionStrategy) -> "_TrainingOptions":
        return self._group.setMeanAccumulationAndReplicationReductionStrategy(strategy)

    def __repr__(self) -> str:
        return repr(MeanReductionStrategy(int(self)))


class _SetterProperty(property):
    """A property whose value is callable as a setter (options files may call it)."""

    is_setter = True


class _TrainingOptions(OptionGroup):
    """``Options.Training``: gradient accumulation and its reduction.

    Example:
        >>> t = _TrainingOptions().gradientAccumulation(4)
        >>> t.gradient_accumulation, t.reduction_type
        (4, <ReductionType.Mean: 1>)
    """

    _PATH = "Options.Training"
    _ATTRIBUTES = {
        "gradient_accumulation": via_setter("gradientAccumulation"),
        "reduction_type": via_setter("accumulationAndReplicationReductionType"),
        "accumulation_and_replication_reduction_type":
            via_setter("accumulationAndReplicationReductionType"),
        "mean_reduction_strategy":
            via_setter("setMeanAccumulationAndReplicationReductionStrategy"),
        "meanAccumulationAndReplicationReductionStrategy":
            via_setter("setMeanAccumulationAndReplicationReductionStrategy"),
        "automatic_loss_scaling": via_setter("setAutomaticLossScaling"),
        "stop_on_non_finite_loss": via_setter("stopOnNonFiniteLoss"),
        "convolution_dithering": via_setter("setConvolutionDithering"),
    }

    def __init__(self):
        super().__init__(gradient_accumulation=1, reduction_type=ReductionType.Mean,
                         mean_reduction_strategy=MeanReductionStrategy.Post,
                         automatic_loss_scaling=False, loss_scaling_growth_interval=2000,
                         stop_on_non_finite_loss=False, convolution_dithering=False)

    @property
    def accumulation_and_replication_reduction_type(self) -> ReductionType:
        """PopTorch's name for :attr:`reduction_type`."""
        return self.reduction_type

    @setter
    def gradientAccumulation(self, gradient_accumulation: int):
        """Accumulate gradients over G micro-batches per optimizer step (G >= 1).

        Example:
            >>> _TrainingOptions().gradientAccumulation(8).gradient_accumulation
            8
        """
        self._store(gradient_accumulation=check_positive_int(
            gradient_accumulation, "gradientAccumulation",
            "opts.Training.gradientAccumulation(1)"))

    @setter
    def accumulationAndReplicationReductionType(self, reduction_type: ReductionType):
        """Mean (default) or Sum of the G*R micro-batch gradients; NoReduction is refused.

        Example:
            >>> t = _TrainingOptions().accumulationAndReplicationReductionType(ReductionType.Sum)
            >>> t.reduction_type
            <ReductionType.Sum: 0>
        """
        name = "Training.accumulationAndReplicationReductionType"
        value = coerce_enum(reduction_type, ReductionType, name)
        if value == ReductionType.NoReduction:
            raise errors.OptionsError(
                f"{name} must be set to poptorch.ReductionType.Mean or "
                f"poptorch.ReductionType.Sum, got {value!r}; call "
                f"opts.{name}(poptorch.ReductionType.Mean)")
        self._store(reduction_type=value)

    @setter
    def accumulationReductionType(self, reduction_type: ReductionType):
        """Deprecated PopTorch name of :meth:`accumulationAndReplicationReductionType`.

        Example:
            >>> _TrainingOptions().accumulationReductionType(ReductionType.Sum).reduction_type
            <ReductionType.Sum: 0>
        """
        self.accumulationAndReplicationReductionType(reduction_type)

    @setter
    def setMeanAccumulationAndReplicationReductionStrategy(self, strategy: MeanReductionStrategy):
        """When the mean divides (IPU-only: equal results in fp32).

        Example:
            >>> _TrainingOptions().setMeanAccumulationAndReplicationReductionStrategy(MeanReductionStrategy.Running).mean_reduction_strategy
            <MeanReductionStrategy.Running: 0>
        """
        self._store(mean_reduction_strategy=coerce_enum(
            strategy, MeanReductionStrategy,
            "Training.setMeanAccumulationAndReplicationReductionStrategy"))
        warn_ipu_only(f"{self._PATH}.setMeanAccumulationAndReplicationReductionStrategy")

    @_SetterProperty
    def meanAccumulationAndReplicationReductionStrategy(self) -> _StrategyValue:
        """PopTorch's stored name of the strategy: reads as its value, calls as the setter.

        Example:
            >>> t = _TrainingOptions()
            >>> _ = t.meanAccumulationAndReplicationReductionStrategy(MeanReductionStrategy.Running)
            >>> t.meanAccumulationAndReplicationReductionStrategy
            <MeanReductionStrategy.Running: 0>
        """
        return _StrategyValue(self)

    @setter
    def setAutomaticLossScaling(self, enabled: bool, growth_interval: int = 2000):
        """Automatic loss scaling ([Note: loss scaling] in ``optim/loss_scale.py``).

        The scale starts at the optimizer's ``loss_scaling``. A step whose
        reduced gradients hold an inf or NaN is skipped and the scale halves;
        after ``growth_interval`` good steps in a row it doubles (the rule of
        ``torch.amp.GradScaler``; ``growth_interval`` is poptorch_lite's own).

        Example:
            >>> t = _TrainingOptions().setAutomaticLossScaling(True, growth_interval=100)
            >>> t.automatic_loss_scaling, t.loss_scaling_growth_interval
            (True, 100)
        """
        enabled = check_bool(enabled, f"{self._PATH}.setAutomaticLossScaling")
        interval = check_positive_int(
            growth_interval, "Training.setAutomaticLossScaling growth_interval",
            "opts.Training.setAutomaticLossScaling(True, growth_interval=2000)")
        self._store(automatic_loss_scaling=enabled, loss_scaling_growth_interval=interval)

    @setter
    def stopOnNonFiniteLoss(self, enabled: bool = True):
        """Stop a call at the first non-finite loss (a debugging aid; poptorch_lite's own).

        By default a NaN or inf loss passes through, as in PopTorch and plain
        PyTorch: it is returned, and its gradients reach the step (automatic loss
        scaling skips such steps). With this on, every micro-batch's loss is checked
        on the host (a device sync per micro-batch) and the first non-finite one
        raises ``ExecutionError`` naming the micro-batch; the call is undone to its
        last completed step (docs/ERRORS.md).

        Example:
            >>> _TrainingOptions().stopOnNonFiniteLoss().stop_on_non_finite_loss
            True
        """
        self._store(stop_on_non_finite_loss=check_bool(enabled,
                                                       f"{self._PATH}.stopOnNonFiniteLoss"))

    @setter
    def setConvolutionDithering(self, enabled: bool):
        """Tile balancing of convolutions (IPU-only).

        Example:
            >>> _TrainingOptions().setConvolutionDithering(True).convolution_dithering
            True
        """
        self._store(convolution_dithering=enabled)
        warn_ipu_only(f"{self._PATH}.setConvolutionDithering")


class _DistributedOptions(OptionGroup):
    """``Options.Distributed``: this process's rank among several instances.

    [Note: process ids]
    At construction it reads ``OMPI_COMM_WORLD_SIZE`` / ``OMPI_COMM_WORLD_RANK``
    as PopTorch does (mpirun, poprun) or, when those are unset, torchrun's
    ``WORLD_SIZE`` / ``RANK``; ``setEnvVarNames`` picks other variables. With
    more than one process a training model replicates across them
    ([Note: replicas across processes] in ``distributed/processes.py``).

    Example:
        >>> d = _DistributedOptions().configureProcessId(1, 4)
        >>> d.processId, d.numProcesses
        (1, 4)
    """

    _PATH = "Options.Distributed"
    _ATTRIBUTES = {
        "process_id": lambda g, v: g.configureProcessId(v, g.num_processes),
        "num_processes": lambda g, v: g.configureProcessId(g.process_id, v),
        "ipu_processes": via_setter("set_ipu_processes"),
        "process_order": via_setter("set_process_order"),
    }

    PROCESS_ORDERS = ("pipeline_inner", "data_parallel_inner")

    def __init__(self):
        super().__init__(process_id=0, num_processes=1, ipu_processes=None,
                         process_order="pipeline_inner")
        if "OMPI_COMM_WORLD_SIZE" not in os.environ and "WORLD_SIZE" in os.environ:
            self.setEnvVarNames("WORLD_SIZE", "RANK")  # torchrun
        else:
            self.setEnvVarNames("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")

    @property
    def processId(self) -> int:
        """Id of this process, 0 <= processId < numProcesses."""
        return self.process_id

    @property
    def numProcesses(self) -> int:
        """Number of processes the execution is distributed over."""
        return self.num_processes

    @property
    def distributed_process_id(self) -> int:
        """PopTorch's stored name of :attr:`processId`."""
        return self.process_id

    @property
    def num_distributed_processes(self) -> int:
        """PopTorch's stored name of :attr:`numProcesses`.

        Example:
            >>> g = _DistributedOptions().configureProcessId(1, 3)
            >>> g.distributed_process_id, g.num_distributed_processes
            (1, 3)
        """
        return self.num_processes

    @setter
    def configureProcessId(self, process_id: int, num_processes: int):
        """Set this process's id and the number of processes.

        Example:
            >>> _DistributedOptions().configureProcessId(0, 2).numProcesses
            2
        """
        n = check_positive_int(num_processes, "Distributed.configureProcessId num_processes",
                               "opts.Distributed.configureProcessId(0, 1)")
        if isinstance(process_id, bool) or not isinstance(process_id, int) \
                or not 0 <= process_id < n:
            raise errors.OptionsError(
                f"Distributed.configureProcessId({process_id!r}, {num_processes!r}): "
                f"the process id must be an int with 0 <= process_id < {n}; call "
                f"opts.Distributed.configureProcessId(pid, n) with 0 <= pid < n")
        self._store(process_id=process_id, num_processes=n)

    @setter
    def setEnvVarNames(self, var_num_processes: str, var_process_id: str):
        """Read numProcesses and processId from these environment variables.

        Example:
            >>> _DistributedOptions().setEnvVarNames("NO_SUCH_SIZE", "NO_SUCH_RANK").numProcesses
            1
        """
        read = {}
        for var, default in ((var_num_processes, "1"), (var_process_id, "0")):
            text = os.environ.get(var, default)
            try:
                read[var] = int(text)
            except ValueError:
                raise errors.OptionsError(
                    f"Environment variable {var}={text!r} is not an int; set it to "
                    f"an integer or call opts.Distributed.disable()") from None
        self.configureProcessId(read[var_process_id], read[var_num_processes])

    @property
    def processes_per_pipeline(self) -> int:
        """n: the processes one pipeline's stages are spread over (1 without
        :meth:`set_ipu_processes`)."""
        return len(self.ipu_processes) if self.ipu_processes else 1

    @setter
    def set_ipu_processes(self, mapping):
        """Run a pipeline's stages in several processes (poptorch_lite's own option).

        Entry j lists the IPU ids that process j of each pipeline runs ([Note: stages in
        other processes] in ``distributed``). With W = ``numProcesses`` processes
        (torchrun's ``WORLD_SIZE``) and n entries there are W / n pipelines, data-parallel
        replicas of each other: process r runs position r % n of pipeline r // n (or, with
        :meth:`set_process_order` ``("data_parallel_inner")``, position r // (W / n) of
        pipeline r % (W / n)). Left unset, every process runs every IPU (replicas across
        processes only).

        Args:
            mapping: a list (index = process) or a dict ``{process: ids}``; ids are an
                IPU id or a list of IPU ids. Stored in ``ipu_processes`` as a tuple of
                tuples.

        Raises:
            errors.OptionsError: not a list or dict, processes not numbered 0..n-1, an
                IPU id that is not an int >= 0, an IPU given to two processes, or a
                process without an IPU.

        Example:
            >>> _DistributedOptions().set_ipu_processes([[0, 1], 2]).ipu_processes
            ((0, 1), (2,))
        """
        how = "call e.g. opts.Distributed.set_ipu_processes([[0], [1]])"
        if isinstance(mapping, (list, tuple)):
            mapping = dict(enumerate(mapping))
        if not isinstance(mapping, dict) or not mapping:
            raise errors.OptionsError(
                f"set_ipu_processes needs a list or dict giving each process of a pipeline its "
                f"IPU ids, got {mapping!r}; {how}")
        if sorted(mapping) != list(range(len(mapping))):
            raise errors.OptionsError(
                f"set_ipu_processes: the processes of a pipeline are numbered 0..{len(mapping) - 1}, "
                f"got {sorted(mapping, key=repr)}; {how}")
        placed: dict = {}
        processes = []
        for j in range(len(mapping)):
            ids = mapping[j]
            ids = list(ids) if isinstance(ids, (list, tuple)) else [ids]
            if not ids:
                raise errors.OptionsError(
                    f"set_ipu_processes: process {j} has no IPU; give every process of a "
                    f"pipeline at least one IPU id")
            for ipu in ids:
                if isinstance(ipu, bool) or not isinstance(ipu, int) or ipu < 0:
                    raise errors.OptionsError(
                        f"set_ipu_processes: process {j} has IPU id {ipu!r}; IPU ids are "
                        f"non-negative ints")
                if ipu in placed:
                    raise errors.OptionsError(
                        f"set_ipu_processes: IPU {ipu} is given to processes {placed[ipu]} and "
                        f"{j}; give each IPU one process")
                placed[ipu] = j
            processes.append(tuple(ids))
        self._store(ipu_processes=tuple(processes))

    @setter
    def set_process_order(self, order: str):
        """Which processes are neighbours in rank order (poptorch_lite's own option; [Note:
        process layout] in ``distributed/layout.py``).

        ``"pipeline_inner"`` (the default): a pipeline's n processes have neighbouring
        ranks, so they share a host and its activations never leave it, while the
        gradient all-reduce of a stage crosses hosts. ``"data_parallel_inner"``: the W / n
        replicas of one stage have neighbouring ranks, so the all-reduce stays on a host
        as far as it can and the activations cross hosts instead (Megatron's and
        torchtitan's order). The numbers are the same either way; only what crosses a
        host differs (docs/PERFORMANCE.md (p)). Without :meth:`set_ipu_processes` both
        orders are the same.

        Raises:
            errors.OptionsError: ``order`` is not one of the two.

        Example:
            >>> _DistributedOptions().set_process_order("data_parallel_inner").process_order
            'data_parallel_inner'
        """
        if order not in self.PROCESS_ORDERS:
            raise errors.OptionsError(
                f"Distributed.set_process_order({order!r}): the order is one of "
                f"{', '.join(map(repr, self.PROCESS_ORDERS))}; call e.g. "
                f"opts.Distributed.set_process_order(\"data_parallel_inner\")")
        self._store(process_order=order)

    @setter
    def disable(self):
        """Ignore the environment: one process, id 0.

        Example:
            >>> _DistributedOptions().configureProcessId(1, 2).disable().numProcesses
            1
        """
        self._store(process_id=0, num_processes=1)
