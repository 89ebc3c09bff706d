"""From a module and its first inputs to stage graphs (no schedule, no threads).

- ``markers``: the ops annotations leave in a traced graph, and the trace context;
- ``structures``: inputs and outputs as tensor leaves and a structure that rebuilds them;
- ``tracing``: the model run once, as an export, into an aten graph (``running_stats``: which
  of its buffer writes are normalisations' updates);
- ``value_info``: what a value computed by a stage looks like;
- ``partition``: the traced graph split into stages, and the loss found;
- ``retarget``: stage graphs rewritten for the device they run on;
- ``rng``: one random stream per micro-batch, which the stage graphs draw from;
- ``lowered``: each stage as the runtime runs it, its graphs and the tables of what they
  read and write (the compile step's last product).

Imports go down only: ``compiler`` uses ``options``, ``optim`` and the vocabulary
(``errors``, ``enums``, ``strategies``), never ``runtime`` or the faces.
"""
