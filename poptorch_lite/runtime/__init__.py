"""Running compiled stages: schedules, streams, weights, the executor and a compiled program.

- ``schedule`` and ``schedule_kinds``: schedules as grids of actions, and their builders (no torch);
- ``placement``: IPUs on devices and streams, and the streams running their lists;
- ``weights``: where each weight lives, and what a step does not commit;
- ``stage_work``: a stage's forward, recompute and backward (``split_backward``: its two halves); ``run``: the state of a run;
- ``batch``: a call's inputs split into micro-batches; ``merge``: their outputs merged;
- ``inputs``: a run's inputs put where its stages read them;
- ``executor``: a schedule run on the streams, the gradient reduction and the step;
- ``plan``: how the executor runs one schedule, worked out once;
- ``channels``: the values, gradients and random streams that cross processes during a run;
- ``undo``: a failed call put back to its last completed step;
- ``compiling``: the compile step, one entry; ``program``: its product, what one input
  signature compiles to, and its runs;
- ``compiled``: a wrapped model's compiled state, and a call's one direction through it
  (split, compile, run, merge).

``runtime`` uses ``compiler``, ``profiling`` and the layers below; nothing in it
imports ``distributed`` (which uses it) or a face.
"""
