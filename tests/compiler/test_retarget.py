"""Stage graphs rewritten for the device they run on ([Note: graphs on their devices]).

A model is traced on the host model's device. On the CPU the shape of each defect is
visible without a GPU: a graph moved to the ``meta`` device fails to run if a factory
op or a lifted constant still names the CPU, and a graph moved to ``cuda:0`` (nothing
is allocated there) is checked op by op against torch's CUDA kernel table. The CUDA
test runs the same model on a GPU stage against plain PyTorch on the GPU.
"""

import doctest
import operator

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import poptorch_lite as poptorch
from poptorch_lite.compiler import retarget
from poptorch_lite.compiler.subgraphs import base_op
from poptorch_lite.compiler.partition import partition
from poptorch_lite.strategies import PipelinedExecution

from models import reference_training, twin

aten = torch.ops.aten
CUDA0 = torch.device("cuda", 0)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class AllThree(torch.nn.Module):
    """A second stage that makes tensors on the trace device (``arange``, ``zeros``,
    ``rand``), lifts a constant (``torch.tensor``) and runs attention."""

    def __init__(self, width=8, constant=True):
        super().__init__()
        self.constant = constant
        self.fc = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x, y):
        with poptorch.Block("a", ipu_id=0):
            h = torch.relu(self.fc(x))
        with poptorch.Block("b", ipu_id=1):
            pos = torch.arange(h.shape[1], device=h.device).to(h.dtype) / h.shape[1]
            scale = torch.tensor([0.5, 1.5, 1.0, 1.0, 0.5, 1.5, 1.0, 1.0]) if self.constant else 1
            noise = torch.rand(h.shape, device=h.device) * torch.zeros(h.shape, device=h.device)
            q = (h * scale + pos + noise).view(h.shape[0], 2, 1, 4)
            a = F.scaled_dot_product_attention(q, q, q).reshape(h.shape)
            out = self.head(a + h)
            return out, F.cross_entropy(out, y)


def stages_of(model, training=True, generic=False, rows=4):
    torch.manual_seed(0)
    x, y = torch.randn(rows, 8), torch.randint(0, 4, (rows,))
    return partition(model, {m: m.training for m in model.modules()}, (x, y), {},
                     PipelinedExecution(), training, generic).stages


def devices_named(gm):
    found = []
    for node in gm.graph.nodes:
        torch.fx.node.map_aggregate((node.args, node.kwargs), lambda v: found.append(v)
                                    if isinstance(v, torch.device) else v)
    return set(found)


def test_a_traced_stage_names_the_trace_device_and_its_cpu_attention_kernel():
    """The defect: the second stage, traced on the CPU, would run CPU-only ops on a GPU."""
    stage = stages_of(AllThree())[1]
    assert devices_named(stage.module) == {torch.device("cpu")}
    ops = [retarget._op(n) for n in stage.module.graph.nodes if retarget._op(n) is not None]
    assert [op.name() for op in ops if not retarget._has_kernel(op, CUDA0)] == [
        "aten::_scaled_dot_product_flash_attention_for_cpu"]


@pytest.mark.parametrize("training", [True, False])
def test_a_stage_moved_to_another_device_runs_there_with_nothing_left_on_the_cpu(training):
    """On ``meta`` any op or constant still on the CPU would raise (devices mixed)."""
    model = AllThree()
    stage = stages_of(model, training)[1]
    for gm in retarget._graphs(stage):
        retarget.to_device(gm, torch.device("meta"))
        assert devices_named(gm) <= {torch.device("meta")}
        consts = [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"]
        assert consts and all(c.device.type == "meta" for c in consts)
    values = {"param:head.weight": model.head.weight, "param:head.bias": model.head.bias,
              "node:relu": torch.randn(4, 8), "input:1": torch.randint(0, 4, (4,))}
    args = [values[name].to("meta") for name in stage.inputs]
    assert all(o.device.type == "meta" for o in stage.module(*args))


def test_on_a_gpu_the_attention_is_the_composite_op_that_picks_the_gpus_kernel():
    stage = stages_of(AllThree(constant=False))[1]
    gm = stage.module
    retarget.to_device(gm, CUDA0)  # nothing is allocated: the graph has no constants
    assert devices_named(gm) == {CUDA0}
    assert retarget.missing_kernels([gm], CUDA0) == []
    calls = [base_op(n.target) for n in gm.graph.nodes
             if n.op == "call_function"]  # seen through rng.seeded: attention may drop out
    assert retarget.attention in calls
    assert aten._scaled_dot_product_flash_attention_for_cpu.default not in calls


class Normed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x, y):
        with poptorch.Block("a", ipu_id=0):
            h = self.fc(x)
        with poptorch.Block("b", ipu_id=1):
            out = self.head(torch.relu(self.bn(h)))
            return out, F.cross_entropy(out, y)


@pytest.mark.parametrize("training", [True, False])
def test_on_a_gpu_batch_norm_is_the_op_that_picks_cudnn_as_plain_pytorch_does(training):
    """Traced on the CPU, batch norm is ``native_batch_norm``; plain PyTorch on a GPU runs
    cuDNN's kernel, which rounds differently (an H200 saw a ResNet's first loss differ in its
    7th digit), so a GPU stage calls ``torch.batch_norm`` as ``F.batch_norm`` does. On the
    CPU the recorded op stays."""
    def calls(gm):
        return [base_op(n.target) for n in gm.graph.nodes if n.op == "call_function"]

    host = stages_of(Normed(), training)[1].module
    assert aten.native_batch_norm.default in calls(host)
    retarget.to_device(host, torch.device("cpu"))
    assert aten.native_batch_norm.default in calls(host)
    gpu = stages_of(Normed(), training)[1].module
    retarget.to_device(gpu, CUDA0)
    assert retarget.batch_norm in calls(gpu)
    assert aten.native_batch_norm.default not in calls(gpu)


def test_the_batch_norm_a_gpu_stage_calls_takes_the_recorded_ops_arguments_in_order():
    torch.manual_seed(0)
    x, w, b = torch.randn(6, 3), torch.randn(3), torch.randn(3)
    stats = [torch.randn(3), torch.rand(3) + 0.5]
    mine = [t.clone() for t in stats]
    expected = aten.native_batch_norm(x, w, b, *stats, True, 0.3, 1e-3)[0]
    assert_close(retarget.batch_norm(x, w, b, *mine, True, 0.3, 1e-3)[0], expected,
                 rtol=0, atol=0)
    for s, m in zip(stats, mine):  # the running statistics took the same update
        assert_close(m, s, rtol=0, atol=0)


@pytest.mark.parametrize("variant,args", [
    (aten._scaled_dot_product_efficient_attention.default, lambda q, m: (q, q, q, m, False)),
    (aten._scaled_dot_product_flash_attention.default, lambda q, m: (q, q, q)),
])
def test_a_gpu_attention_kernel_in_a_graph_moved_to_the_cpu_computes_attention(variant, args):
    """A graph traced on a GPU records a GPU-only variant; on the CPU it becomes the
    composite op with the same query, key, value, mask and scale."""
    torch.manual_seed(0)
    q = torch.randn(2, 2, 3, 4)
    mask = torch.randn(2, 2, 3, 3) if "efficient" in str(variant) else None
    g = torch.fx.Graph()
    q_in = g.placeholder("q")
    m_in = g.placeholder("m")
    call = g.call_function(variant, args(q_in, m_in), {"scale": 0.3})
    g.output(g.call_function(operator.getitem, (call, 0)))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert retarget.missing_kernels([gm], torch.device("cpu")) == []  # replaced, not missing
    retarget.to_device(gm, torch.device("cpu"))
    assert_close(gm(q, mask), F.scaled_dot_product_attention(q, q, q, mask, scale=0.3),
                 rtol=0, atol=0)


def test_an_lstm_traced_on_the_cpu_records_a_cpu_only_kernel_unless_traced_generic():
    class Recurrent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = torch.nn.LSTM(8, 8, batch_first=True)

        def forward(self, x, y):
            out = self.lstm(x.view(x.shape[0], 2, 4).repeat(1, 1, 2))[0][:, -1, :4]
            return out, F.cross_entropy(out, y)
    model = Recurrent()
    assert [op for st in stages_of(model) for op, _ in retarget.missing_kernels(
        retarget._graphs(st), CUDA0)] == ["aten::mkldnn_rnn_layer"] * 2  # stage and segment
    assert all(retarget.missing_kernels(retarget._graphs(st), CUDA0) == []
               for st in stages_of(model, generic=True))


class Recurrent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.lstm = torch.nn.LSTM(4, 4, batch_first=True)

    def forward(self, x, y):
        with poptorch.Block("a", ipu_id=0):
            h = torch.tanh(self.fc(x))
        with poptorch.Block("b", ipu_id=1):
            out = self.lstm(h.view(h.shape[0], 2, 4))[0][:, -1]
            return out, F.cross_entropy(out, y)


def _pretend_cpu_lacks(monkeypatch, names):
    has = retarget._has_kernel
    monkeypatch.setattr(retarget, "_has_kernel",
                        lambda op, device: op.name() not in names and has(op, device))


def test_a_kernel_the_stage_device_lacks_makes_the_wrapper_trace_again_without_it(monkeypatch):
    """As on a GPU stage of a CPU-traced LSTM: the wrapper traces again without oneDNN's
    CPU-only kernels, and the numbers stay plain PyTorch's."""
    _pretend_cpu_lacks(monkeypatch, {"aten::mkldnn_rnn_layer"})
    torch.manual_seed(0)
    model = Recurrent()
    ref = twin(model)
    opts = poptorch.Options().setExecutionStrategy(PipelinedExecution())
    opts.Training.gradientAccumulation(4)
    opts.outputMode(poptorch.OutputMode.All)
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    out, loss = train(x, y)
    ops = {str(base_op(n.target)) for st in train._programs[next(iter(
        train._programs))].partition.stages for n in st.module.graph.nodes}
    assert "aten.mkldnn_rnn_layer.default" not in ops
    outs, losses, _ = reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1),
                                         x, y, 1, 4, 1)
    assert_close(loss, torch.stack(losses), atol=1e-5, rtol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), atol=1e-5, rtol=0)
    train.destroy()


def test_an_op_no_trace_can_put_on_the_stage_device_is_refused_before_any_state_changes(
        monkeypatch):
    _pretend_cpu_lacks(monkeypatch, {"aten::tanh"})
    torch.manual_seed(0)
    model = Recurrent()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opts = poptorch.Options().setExecutionStrategy(PipelinedExecution())
    opts.Training.gradientAccumulation(4)
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorch.TraceError) as info:
        train(torch.randn(8, 8), torch.randint(0, 4, (8,)))
    assert str(info.value).startswith(
        "stage 0 runs on cpu (IPU 0), but torch has no CPU kernel for aten::tanh, which the "
        "trace recorded at ")
    assert "h = torch.tanh(self.fc(x))" in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    train.destroy()


def test_doctests():
    result = doctest.testmod(retarget)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("schedule", ["grouped", "interleaved"])
def test_a_cpu_traced_model_with_all_three_on_a_gpu_stage_matches_plain_pytorch(schedule):
    """Stage 0 on the CPU, stage 1 on a GPU; the plain reference runs on the CPU, where the
    model was written (its ``torch.tensor`` constant is a CPU tensor: the whole model on a GPU
    would mix devices in plain PyTorch; the noise is multiplied by zeros, so no draw differs)."""
    torch.manual_seed(0)
    model = AllThree()
    ref = twin(model, "cpu")
    opts = poptorch.Options().setExecutionStrategy(PipelinedExecution(
        schedule=poptorch.PipelineSchedule.parse(schedule))).set_ipu_devices({0: "cpu", 1: "cuda:0"})
    opts.Training.gradientAccumulation(4)
    opts.outputMode(poptorch.OutputMode.All)
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    out, loss = train(x, y)
    outs, losses, _ = reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1),
                                         x, y, 1, 4, 1)
    assert_close(out, torch.cat(outs), atol=1e-5, rtol=0)
    assert_close(loss, torch.stack(losses), atol=1e-5, rtol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach().cpu(), atol=1e-5, rtol=0)
    train.destroy()
