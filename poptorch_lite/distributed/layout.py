"""The layout of several processes: W processes as a mesh of P = W/n pipelines × n stages.

[Note: process layout]
``Options.Distributed.set_ipu_processes`` gives each of the n positions of a
pipeline its IPU ids; W processes (``WORLD_SIZE``) then make P = W/n pipelines,
data-parallel replicas of each other: a P × n mesh of ranks, ``grid[k][j]`` the
process of position j of pipeline k (torch's ``DeviceMesh`` over the dimensions
"replica" and "stage", made by ``Processes.join``). Which ranks are neighbours is
``Options.Distributed.set_process_order``:

- "pipeline_inner" (the default): process r runs position ``r % n`` of pipeline
  ``r // n``. A pipeline's processes are neighbours (one host, when they fit on
  one), so activations stay on the host; the processes that run the same stages
  are n apart, so every gradient all-reduce crosses hosts.
- "data_parallel_inner": process r runs position ``r // P`` of pipeline ``r % P``.
  The P replicas of a stage are neighbours, so their all-reduce stays on a host as
  far as it can, and the activations cross hosts.

The numbers a step computes are the same in either order: every process computes
the same values and sums the same gradients; only the ranks that hold them differ.
Without ``set_ipu_processes`` n is 1 and both orders are the same: every process
runs every IPU, and the W pipelines are the replicas across processes of
``distributed``. What crosses a host per step in each order, and the process
groups each makes, are in docs/PERFORMANCE.md (p).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..errors import OptionsError


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where this process sits among W processes ([Note: process layout]).

    ``ipu_processes`` lists, per position of a pipeline, the IPU ids it runs
    (``Options.Distributed.set_ipu_processes``); None: every process runs every IPU.
    ``order`` is ``Options.Distributed.set_process_order``'s.

    Example:
        >>> layout = Layout(3, 4, ((0,), (1, 2)))
        >>> layout.n, layout.pipeline, layout.position, layout.pipelines
        (2, 1, 1, 2)
        >>> layout.position_of(2), layout.runs(0), layout.rank_of(0, 1)
        (1, False, 1)
        >>> Layout(1, 4, ((0,), (1, 2)), "data_parallel_inner").grid()
        ((0, 2), (1, 3))
    """

    rank: int
    size: int
    ipu_processes: Optional[tuple] = None
    order: str = "pipeline_inner"

    @property
    def n(self) -> int:
        """Processes per pipeline."""
        return len(self.ipu_processes) if self.ipu_processes else 1

    @property
    def data_parallel_inner(self) -> bool:
        return self.order == "data_parallel_inner"

    @property
    def pipeline(self) -> int:
        return self.rank % self.pipelines if self.data_parallel_inner else self.rank // self.n

    @property
    def position(self) -> int:
        return self.rank // self.pipelines if self.data_parallel_inner else self.rank % self.n

    @property
    def pipelines(self) -> int:
        """W/n: the data-parallel replicas of the pipeline."""
        return self.size // self.n

    @property
    def spans_processes(self) -> bool:
        """Whether a pipeline's stages run in more than one process."""
        return self.n > 1

    def rank_of(self, pipeline: int, position: int) -> int:
        if self.data_parallel_inner:
            return position * self.pipelines + pipeline
        return pipeline * self.n + position

    def grid(self) -> tuple:
        """The mesh: ``grid()[k][j]`` is the rank of position j of pipeline k."""
        return tuple(self.pipeline_ranks(k) for k in range(self.pipelines))

    def position_of(self, ipu: int) -> Optional[int]:
        """The position that runs ``ipu`` (0 when every process runs every IPU; None:
        the mapping leaves it out)."""
        if not self.ipu_processes:
            return 0
        return next((j for j, ids in enumerate(self.ipu_processes) if ipu in ids), None)

    def runs(self, ipu: int) -> bool:
        """Whether this process runs ``ipu``."""
        return not self.ipu_processes or ipu in self.ipu_processes[self.position]

    def pipeline_ranks(self, pipeline: Optional[int] = None) -> tuple:
        k = self.pipeline if pipeline is None else pipeline
        return tuple(self.rank_of(k, j) for j in range(self.n))

    def replica_ranks(self, position: Optional[int] = None) -> tuple:
        """The processes that run the same stages (one per pipeline)."""
        j = self.position if position is None else position
        return tuple(self.rank_of(k, j) for k in range(self.pipelines))

    @classmethod
    def from_options(cls, options) -> "Layout":
        """This process's layout; refuses a process count the pipelines do not divide.

        Raises:
            OptionsError: ``set_ipu_processes`` names n processes per pipeline but
                W is not a multiple of n (1 included: not launched as W processes).
        """
        d = options.Distributed
        layout = cls(d.process_id, d.num_processes, d.ipu_processes, d.process_order)
        if layout.size % layout.n:
            raise OptionsError(
                f"Options.Distributed.set_ipu_processes spreads each pipeline over {layout.n} "
                f"processes, but this run has {layout.size} process"
                f"{'es' if layout.size != 1 else ''} (Options.Distributed.numProcesses), which "
                f"is not a multiple of {layout.n}; launch a multiple of {layout.n} processes "
                f"(torchrun --nproc_per_node {layout.n} script.py for one pipeline, "
                f"{2 * layout.n} for two data-parallel replicas of it)")
        return layout
