"""How the fuzzer's wrapped side runs a program: the configuration, as the Options a user writes.

A :class:`Config` holds one value per factor (schedule, G, D, R, reduction, recomputation,
compiled stages, device, buffers per replica, random seed, micro-batch size, calls, output
mode, labels by keyword, offloaded optimizer state, a batch size that changes, an inference
model instead, processes and the optimizer's state sharded over them, and on a GPU or its
twin a step captured as one CUDA graph and replayed), the simplest
first, so that Hypothesis shrinks towards it (tests/support/fuzz_draw.py draws valid ones).
:meth:`Config.code` is the Options as Python, which is what :meth:`Config.options` runs and
what a finding prints; :meth:`Config.tolerance` is the fuzzer's tolerance rule ([Note: the
fuzzer's oracle] in fuzz_check).

With ``POPTORCH_LITE_FUZZ_DEVICE=cuda`` (the GPU check, benchmarks/gpu_check.sh) every drawn
configuration runs on the GPU, and so does the plain side (fuzz_plain): the same kernels and
the same CUDA generator on both sides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Optional

import torch

import poptorch_lite as poptorch

import models
from fuzz_grammar import Program

SCHEDULES = ("grouped", "sequential", "interleaved", "gpipe", "zero_bubble", "sharded")
DEVICES = ("cuda",) if os.environ.get("POPTORCH_LITE_FUZZ_DEVICE") == "cuda" else (
    "cpu", "ipu_model", "gpu_twin")


@dataclasses.dataclass(frozen=True)
class Config:
    """How the wrapped side runs a program (the simplest value of each factor first)."""
    schedule: str = "grouped"
    G: int = 1
    D: int = 1
    R: int = 1
    reduction: str = "mean"
    recompute: bool = False
    compiled: bool = False
    device: str = "cpu"
    broadcast_buffers: bool = True
    random_seed: Optional[int] = None
    B: int = 2
    calls: int = 2
    output_mode: str = "All"
    keyword: bool = False  # the labels passed as y=
    offload: bool = False  # the optimizer's state and update in host memory
    vary_batch: bool = False  # the second call's micro-batches hold B + 1 samples
    dtype: str = "float32"
    graph: bool = False  # on a GPU (or its twin): the steps captured as one CUDA graph, replayed
    autocast: str = "off"  # the calls under torch.autocast (bfloat16): "off", "on", "second"
    inference: bool = False  # an inferenceModel: the forward under no_grad, nothing stepped
    backend: str = "aot_eager"  # compiled stages' backend: "aot_eager", or "inductor" (slow)
    processes: int = 1  # processes, as torchrun starts them
    spread: str = "replicas"  # over the processes: "replicas" (R each) or "stages" (a pipeline)
    sharded: bool = False  # the optimizer's state sharded over the processes (ZeRO-1)

    def ambient(self, call: int):
        """The autocast the user puts around call ``call`` (both sides): bfloat16 on the
        device type the model computes on, in every call ("on") or in the second only."""
        on = self.autocast == "on" or (self.autocast == "second" and call == 1)
        if not on:  # no context at all: even a disabled autocast counts in autocast's
            return contextlib.nullcontext()  # nesting, which keeps the forward's casts cached
        return torch.autocast("cuda" if self.device == "cuda" else "cpu", dtype=torch.bfloat16)

    def code(self, program: Program) -> str:
        """The Options as a user writes them."""
        if self.schedule == "sharded":
            lines = ["opts = poptorch.Options().setExecutionStrategy(poptorch.ShardedExecution())"]
        else:
            auto = "poptorch.AutoStage.AutoIncrement, " if program.ipus == "loop" else ""
            lines = ["opts = poptorch.Options().setExecutionStrategy(poptorch.PipelinedExecution("
                     f"{auto}schedule={self.schedule!r}))"]
        if self.inference:
            lines.append("# poptorch.inferenceModel(net, opts): no optimizer, nothing stepped")
        lines += [f"opts.Training.gradientAccumulation({self.G})",
                  f"opts.deviceIterations({self.D}).replicationFactor({self.R})",
                  f"opts.outputMode(poptorch.OutputMode.{self.output_mode})"]
        if self.reduction == "sum":
            lines.append("opts.Training.accumulationAndReplicationReductionType("
                         "poptorch.ReductionType.Sum)")
        if self.recompute:
            lines.append("opts._Popart.set(\"autoRecomputation\", 3)")
        if self.graph:  # warm-up runs, a capture, then replays ([Note: step graphs])
            lines.append(f"opts.compileStages(True, backend="
                         f"{'aot_eager' if self.compiled else 'eager'!r}, cuda_graph=True)")
        elif self.compiled:
            lines.append(f"opts.compileStages(True, backend={self.backend!r})  # and PAYS_FROM = 0")
        if self.offload or self.sharded:
            lines.append("opts.TensorLocations.setOptimizerLocation("
                         "poptorch.TensorLocationSettings()"
                         + (".useOnChipStorage(False)" if self.offload else "")
                         + (".useReplicatedTensorSharding(True)" if self.sharded else "") + ")")
        if self.sharded:  # the gradient a step used, gathered whole to be read back
            lines.append("for name, p in net.named_parameters():  # what the fuzzer compares\n"
                         "    if p.requires_grad:\n"
                         "        opts.anchorTensor(f\"Gradient___{name}\", "
                         "f\"Gradient___{name}\")")
        if not self.broadcast_buffers:
            lines.append("opts.broadcastBuffers(False)")
        if self.random_seed is not None:
            lines.append(f"opts.randomSeed({self.random_seed})")
        if self.processes > 1 and self.spread == "stages":  # the pipeline's IPUs, split
            ipus = list(range(2 if program.ipus == "loop" else program.stages))
            half = (len(ipus) + 1) // 2
            lines.append(f"opts.Distributed.set_ipu_processes([{ipus[:half]}, {ipus[half:]}])")
        if self.processes > 1:
            lines.append(f"# in {self.processes} processes as torchrun starts them, each "
                         f"{'with the whole batch' if self.spread == 'stages' else 'with its own batch'}")
        lines.append(f"models.on_device(opts, {self.device!r})")
        if self.autocast != "off":
            lines.append(f"# {'every call' if self.autocast == 'on' else 'call 1'} under "
                         f"torch.autocast({'cuda' if self.device == 'cuda' else 'cpu'!r}, "
                         f"dtype=torch.bfloat16), on both sides")
        if self.dtype != "float32":
            lines.append(f"# the model and the inputs in torch.{self.dtype}: net = Net().to(torch."
                         f"{self.dtype})")
        return "\n".join(lines)

    def options(self, program: Program, net: torch.nn.Module) -> poptorch.Options:
        namespace = {"poptorch": poptorch, "models": models, "net": net}
        exec(self.code(program), namespace)  # noqa: S102: the text printed is what ran
        return namespace["opts"]

    def atoms(self) -> frozenset:
        return frozenset(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))

    def tolerance(self, program: Program) -> float:
        """0 where the arithmetic is plain PyTorch's to the bit, else by dtype (module doc).
        A gradient the forward takes through ``torch.utils.checkpoint`` is not bit for bit
        either: the trace's inner backward reads the recomputed values, so the second-order
        gradient reaches their inputs through the recomputation's ops rather than the
        forward's, and autograd sums it in another order (the values are the same). On CUDA
        the plain side computes on the GPU too, held to the float32 rule (not yet checked
        to the bit on a GPU)."""
        kinds = {o.kind for o in program.ops}
        through_checkpoint = "checkpoint" in kinds and kinds & {"penalty", "saliency",
                                                                "input_penalty"}
        if program.stages == 1 and self.G * self.R * self.processes == 1 and not self.compiled \
                and not through_checkpoint \
                and self.device != "cuda":
            return 0.0
        if self.compiled and self.backend == "inductor":  # fused kernels reassociate sums
            return 1e-4
        return 1e-5 if self.dtype == "float32" else 1e-7
