"""What the trace reads and leaves behind: inference tensors, scripted submodules, a user's
random generators, Python's and numpy's random, packed sequences (compiler/tracing.py,
compiler/trace_modes.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.testing import assert_close

import poptorch_lite as poptorch
from models import GradCodeMLP, data, on_device, twin

ATOL = 1e-5


@pytest.mark.parametrize("blocks", [1, 2])
@pytest.mark.parametrize("where", ["inputs", "call", "both"])
def test_inference_mode_and_its_tensors_infer_as_plain_pytorch(where, blocks, device):
    """Lightning validates under ``torch.inference_mode()``: its batches are inference tensors,
    which keep no version counter, and the call runs in that mode. The model writes a buffer
    in forward and, where plain PyTorch may (in inference mode), halves its input in place."""
    D, b = 3, 2
    torch.manual_seed(0)
    edit = where != "inputs"  # an inference tensor is written only in inference mode
    model = GradCodeMLP("ema_buffer", blocks, edit_input=edit)
    ref = twin(model, device)
    x, y = data(D * b)
    ref_x = x.clone().to("cuda" if device == "cuda" else "cpu")
    if where != "call":
        with torch.inference_mode():
            x, y = x.clone(), y.clone()
    opts = on_device(poptorch.Options().deviceIterations(D), device)
    if blocks == 2:
        opts.setExecutionStrategy(poptorch.PipelinedExecution())
    infer = poptorch.inferenceModel(model, opts)
    mode = torch.inference_mode() if where != "inputs" else contextlib.nullcontext()
    with mode:
        out, loss = infer(x, y)
    with torch.no_grad():
        refs = [ref(ref_x[k * b:(k + 1) * b], y[k * b:(k + 1) * b].to(ref_x.device))
                for k in range(D)]
    assert_close(out, torch.cat([o for o, _ in refs]).cpu(), atol=ATOL, rtol=0)
    assert_close(loss, torch.stack([l for _, l in refs]).cpu(), atol=ATOL, rtol=0)
    assert_close(x, ref_x.cpu(), atol=0, rtol=0)  # halved once, by the run, if at all
    assert_close(model.ema, ref.ema.cpu(), atol=ATOL, rtol=0)
    infer.destroy()
