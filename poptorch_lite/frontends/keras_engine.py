"""The Keras face's passes over data as executions of PopTorch wrappers.

``fit``, ``evaluate`` and ``predict`` of ``keras.Model`` share this: the checks
made before anything runs (the tutorials' rules, [Note: Keras steps] in
``keras``), the one trace that finds the stages, a PopTorch wrapper per kind and
steps per execution, and the loop that runs a pass ``steps_per_execution``
steps per call and keeps the running logs ([Note: Keras batch hooks]).
"""

from __future__ import annotations

from typing import Optional

import torch
from tqdm import tqdm

from ..errors import PoptorchLiteWarning, WrapError, warn_once
from ..options.base import check_positive_int
from ..options.options import Options
from ..strategies import ShardedExecution
from ..wrap import inferenceModel, trainingModel
from .keras_callbacks import RunningLogs, format_logs
from .keras_data import Data
from .keras_stages import layer_stages
from .splits import _last_program, num_stages


class _TrainStep(torch.nn.Module):
    """The user's module followed by the compiled loss: ``forward(x, y) -> (y_pred, loss)``."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net
        self.loss_fn, self.loss_weight = None, None

    def forward(self, x, y, weight=None):
        y_pred = self.net(x)
        return y_pred, self.loss_fn(y_pred, y, weight, self.loss_weight)


class Executions:
    """The pass machinery of ``keras.Model`` (a mixin: it uses the model's ``module``,
    ``_step``, ``_ipu``, ``_spe``, ``_wrappers`` and the rest set by its ``__init__``)."""

    def _prepare(self, method: str, x, y, batch_size, steps, drop_remainder: bool,
                 steps_name: str = "steps", sample_weight=None) -> tuple:
        """The checks every method makes first: ``(data, replicas, steps per pass,
        steps per execution)``."""
        self._require_compiled(method != "predict")
        data = Data(x, y, _batch_size(batch_size), method != "predict", method, sample_weight)
        data.require_steps(steps, steps_name)
        if self._example is None:
            self._example = data.first(data.batch_size)[0]
        self._apply_assignment()
        R = self._ipu.replicas(self._num_stages(data))
        count, spe = self._plan(data, method, R, steps, drop_remainder, steps_name)
        return data, R, count, spe

    def _plan(self, data: Data, method: str, R: int, steps, drop_remainder: bool,
              steps_name: str) -> tuple:
        """Steps of one pass and the steps per execution for it ([Note: Keras steps])."""
        count = data.batches(R, steps, drop_remainder, steps_name)
        spe = self._spe
        if spe > count:  # to the steps of the pass, kept a multiple of G x replicas if it can
            unit = R * (self._ipu.G if method == "fit" else 1)
            cut = count - count % unit if count >= unit else count
            warn_once(f"keras.truncate.{data.what}.{spe}.{cut}",
                      f"{data.what}: steps_per_execution ({spe}) is larger than the {count} "
                      f"steps of this pass over the data; truncating it to {cut} for this "
                      f"call, as Keras does", PoptorchLiteWarning)
            spe = cut
        self._ipu.check(self._stages, spe, R, method == "fit")
        data.check_executions(count, spe, steps_name)
        return count, spe

    def _require_compiled(self, needs_loss: bool) -> None:
        if not self._compiled or (needs_loss and self._step.loss_fn is None):
            raise WrapError("You must compile your model with a loss before training/testing: "
                            "call model.compile(optimizer, loss=...)")

    def _num_stages(self, data: Data) -> int:
        """The stages of the model, from one trace of its first batch (once per assignment)."""
        if self._stages is None:
            x, y, w = data.first(data.batch_size)
            probe = inferenceModel(self._step if y is not None else self.module,
                                   Options().setExecutionStrategy(ShardedExecution()))
            probe.compile(*((x,) if y is None else (x, y) if w is None else (x, y, w)))
            self._stages = num_stages(probe)
            self._layer_stages = layer_stages(_last_program(probe).partition,
                                              "" if y is None else "net.", self.module)
            probe.destroy()
        return self._stages

    def _trace_stages(self) -> None:
        """The stages of the layers of a model with ``PipelineStage`` scopes, from one trace
        of the first batch it saw."""
        probe = inferenceModel(self.module, Options().setExecutionStrategy(ShardedExecution()))
        probe.compile(self._example)
        self._layer_stages = layer_stages(_last_program(probe).partition, "", self.module)
        probe.destroy()

    def _wrapper(self, kind: str, R: int, spe: int):
        """The PopTorch model for ``kind`` (train, evaluate, predict), wrapped once per
        steps per execution (see :meth:`_plan`)."""
        if (kind, spe) not in self._wrappers:
            module = self.module if kind == "predict" else self._step
            modes = {m: m.training for m in self.module.modules()}
            self.module.train(kind == "train")  # Keras' training flag; traced with these modes
            opts = self._ipu.options(kind, spe, R)
            try:
                self._wrappers[(kind, spe)] = (
                    trainingModel(module, opts, self.optimizer) if kind == "train"
                    else inferenceModel(module, opts))
            finally:
                for m, flag in modes.items():
                    m.training = flag
        return self._wrappers[(kind, spe)]

    def _release(self) -> None:
        """Destroy the PopTorch models; the next call wraps again ([Note: Keras face])."""
        for wrapper in self._wrappers.values():
            wrapper.destroy()
        self._wrappers.clear()

    def _run(self, wrapper, data: Data, order, count: int, spe: int, begin, end, verbose: int,
             desc: str, outputs: Optional[list] = None) -> dict:
        """Run ``count`` steps, ``spe`` per call; return the running logs."""
        b = data.batch_size
        running = RunningLogs(self._metrics or [] if outputs is None else [], outputs is None)
        bar = tqdm(total=count, desc=desc, unit="batch", disable=verbose != 1)
        for e, (xb, yb, wb) in enumerate(data.executions(order, spe, b, count)):
            first = e * spe
            if begin is not None and not self._async:
                begin(first)
            if outputs is not None:
                result = wrapper(xb)
                outputs.append(result)
            else:
                result = wrapper(xb, yb) if wb is None else wrapper(xb, yb, wb)
                y_pred, losses = result[0], result[1].reshape(-1)
            for j in range(spe):
                if outputs is None:
                    rows = slice(j * b, (j + 1) * b)
                    running.add(losses[j], y_pred[rows], yb[rows])
                if begin is not None and self._async:
                    begin(first + j)
                    end(first + j, running.logs())
            if begin is not None and not self._async:
                end(first + spe - 1, running.logs())
            bar.update(spe)
            bar.set_postfix_str(format_logs(running.logs()), refresh=False)
            if self.stop_training:
                break
        bar.close()
        return running.logs()


def _batch_size(batch_size) -> int:
    return 32 if batch_size is None else check_positive_int(batch_size, "batch_size",
                                                             "fit(..., batch_size=32)")


def _pair(validation_data) -> tuple:
    if isinstance(validation_data, (tuple, list)) and len(validation_data) == 2:
        return tuple(validation_data)
    return validation_data, None
