"""Several processes (``torchrun``): data-parallel pipelines and pipeline stages in other processes.

- ``layout``: W processes as W/n pipelines of n stages;
- ``processes``: joining the group, the options check, the owners' weights, the
  gradient all-reduce, the agreement on a run's outcome, ``is_main_process``.

The values, gradients and random streams that cross processes during a run are
the runtime's (``runtime/channels.py``): the executor sends and receives them
per action. ``distributed`` uses ``runtime``; ``runtime`` never imports it.

[Note: stages in other processes]
``Options.Distributed.set_ipu_processes([[0], [1]])`` puts IPU 0 in process 0
and IPU 1 in process 1 of every pipeline; W processes (``torchrun
--nproc_per_node W``) make W/n such pipelines of n processes, data-parallel
replicas of each other ([Note: replicas across processes] in ``distributed/processes.py``).
Every process runs the same script: it builds and traces the whole model, but
places, holds parameters, gradients and optimizer state for, and runs only
its own stages. The schedule is the same data in every process; each process
runs its own streams' action lists, and the update (``U``) on its first stream.
A dependency on an action in another process becomes a message on
``torch.distributed`` (gloo for CPU tensors, NCCL between GPUs), on a process
group of its own per stage pair and direction, so no two threads ever share
one and the messages of one group come in one order on both sides (the end of
a run, on one thread, sends in one batch on the pipeline's group: the "stage"
dimension of the layout's mesh, [Note: process layout]):

- after stage s's forward of micro-batch i, each value that a stage t in
  another process reads goes there (the receiver allocates it from the trace:
  [Note: value info] in ``value_info``), and, when the model has random ops, so
  does the micro-batch's random stream to stage s+1 (``rng.pack``): stage s+1
  continues it, as on one device;
- after stage t's backward of i, the gradient of each such value that can
  have one goes back to s (zeros for a value that got none); stage s adds it
  to the gradients its local consumers left before its own backward.

Sends are asynchronous and waited for at the end of the run; a receive waits
at most the collective timeout (``POPTORCH_LITE_DIST_TIMEOUT``). The grid's row
order is a valid order for all of them, so no process waits for one that
waits for it.

Failures. An action that raises does not stop the run: from then on the
process computes nothing but still sends (zeros of the traced shapes) and
receives every message of the run, so every other process completes the run
too and no message is left in flight. The update first agrees over all
processes whether any of them failed (``Processes.agree``, one small
all-reduce per step; inference runs agree at their end) and, if one did, no
process steps: every process raises ``ExecutionError`` naming the process,
stage, micro-batch and action that failed, and each is left as after the
call's last completed step ([Note: commit point] in ``update``). A message
that cannot be sent or received (a process died, or hung past the timeout)
leaves the processes out of step: the call raises naming the peer, and later
calls of that model refuse to run.

Outputs. The values a call returns are broadcast from the process that
computed them to every process of the pipeline, so every process's call
returns what a single process would.
"""

from .processes import is_main_process

__all__ = ["is_main_process"]
