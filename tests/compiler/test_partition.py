"""Partition: annotation forms, values crossing stages, tracing semantics, loss provenance."""

import copy
import operator

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import poptorch_lite as poptorch

from models import data, reference_training, trained_grads


def layers():
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"dense1": torch.nn.Linear(8, 8), "dense2": torch.nn.Linear(8, 8),
                                "dense3": torch.nn.Linear(8, 8), "logits": torch.nn.Linear(8, 4)})


class WithBlocks(torch.nn.Module):
    """dense1 | dense2 dense3 | logits on IPUs 0, 1, 2 written with Block scopes."""

    def __init__(self):
        super().__init__()
        self.net = layers()

    def forward(self, x, y):
        with poptorch.Block("s0", ipu_id=0):
            x = torch.relu(self.net["dense1"](x))
        with poptorch.Block("s1", ipu_id=1):
            x = torch.relu(self.net["dense3"](torch.relu(self.net["dense2"](x))))
        with poptorch.Block("s2", ipu_id=2):
            out = self.net["logits"](x)
            return out, F.cross_entropy(out, y)


class WithBlockFunctions(WithBlocks):
    @poptorch.BlockFunction("s0", ipu_id=0)
    def first(self, x):
        return torch.relu(self.net["dense1"](x))

    @poptorch.BlockFunction("s1", ipu_id=1)
    def middle(self, x):
        return torch.relu(self.net["dense3"](torch.relu(self.net["dense2"](x))))

    @poptorch.BlockFunction("s2", ipu_id=2)
    def last(self, x, y):
        out = self.net["logits"](x)
        return out, F.cross_entropy(out, y)

    def forward(self, x, y):
        return self.last(self.middle(self.first(x)), y)


class WithSequential(torch.nn.Module):
    """The same layers as an nn.Sequential, the loss outside any block."""

    def __init__(self):
        super().__init__()
        n = layers()
        self.seq = torch.nn.Sequential()
        for name in ["dense1", "relu1", "dense2", "relu2", "dense3", "relu3", "logits"]:
            self.seq.add_module(name, n[name] if name in n else torch.nn.ReLU())

    def forward(self, x, y):
        out = self.seq(x)
        return out, F.cross_entropy(out, y)


def begin_blocks():
    m = WithSequential()
    poptorch.BeginBlock(m.seq.dense1, "s0", ipu_id=0)
    poptorch.BeginBlock(m.seq.dense2, "s1", ipu_id=1)
    poptorch.BeginBlock(m.seq.logits, "s2", ipu_id=2)
    return m


def sequential_list():
    m = WithSequential()
    poptorch.set_pipeline_stage_assignment(m.seq, [0, 0, 1, 1, 1, 1, 2])
    return m


def named_splits():
    m = WithSequential()
    poptorch.split_at(m, ["seq.dense2", "seq.logits"])
    return m


FORMS = {"Block": WithBlocks, "BlockFunction": WithBlockFunctions, "BeginBlock": begin_blocks,
         "Sequential list": sequential_list, "named splits": named_splits}


def stage_layout(poptorch_model):
    part = next(iter(poptorch_model._programs.values())).partition
    names = {id(p): n.split(".")[-2] for n, p in poptorch_model.model.named_parameters()}
    params = dict(poptorch_model.model.named_parameters())
    return [(st.ipu, sorted({names[id(params[n])] for n in st.param_names})) for st in part.stages]


@pytest.mark.parametrize("form", list(FORMS))
def test_every_annotation_form_yields_the_same_partition(form):
    model = FORMS[form]()
    opts = poptorch.Options().setExecutionStrategy(poptorch.ShardedExecution())
    wrapped = poptorch.inferenceModel(model, opts)
    x, y = data(4)
    out, loss = wrapped(x, y)
    assert stage_layout(wrapped) == [(0, ["dense1"]), (1, ["dense2", "dense3"]), (2, ["logits"])]
    plain_out, plain_loss = WithBlocks()(x, y)  # same weights; annotations are no-ops here
    assert_close(out, plain_out.detach())
    assert_close(loss, plain_loss.detach())


class Skip(torch.nn.Module):
    """A value from stage 0 used in stage 2, the labels used in stage 2 only."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x, y):
        with poptorch.Block("A", ipu_id=0):
            h0 = torch.tanh(self.a(x))
        with poptorch.Block("B", ipu_id=1):
            h1 = torch.tanh(self.b(h0))
        with poptorch.Block("C", ipu_id=2):
            out = self.c(h1 + h0)
            return out, F.mse_loss(out, y * 2)


def test_skip_connections_and_labels_cross_stages_and_match_plain_pytorch():
    torch.manual_seed(0)
    model = Skip()
    ref = copy.deepcopy(model)
    G = 4
    x, y = torch.randn(2 * G, 8), torch.randn(2 * G, 8)
    opts = poptorch.Options().setExecutionStrategy(poptorch.ShardedExecution())
    opts.Training.gradientAccumulation(G)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    poptorch_model = poptorch.trainingModel(model, opts, opt)
    _, loss = poptorch_model(x, y)
    part = next(iter(poptorch_model._programs.values())).partition
    assert [st.ipu for st in part.stages] == [0, 1, 2]
    assert "input:1" in part.stages[2].inputs and "input:1" not in part.stages[0].inputs
    skip = [v for v in part.stages[0].outputs if v in part.stages[2].inputs]
    assert len(skip) == 1 and skip[0] not in part.stages[1].outputs  # straight from stage 0
    _, ref_losses, ref_grads = reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1),
                                                  x, y, 1, G, 1)
    assert_close(loss, ref_losses[-1], atol=1e-5, rtol=0)
    grads = trained_grads(poptorch_model)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(grads[n], ref_grads[n], atol=1e-5, rtol=0)
        assert_close(p.detach(), q.detach(), atol=1e-5, rtol=0)


class ClientPatterns(torch.nn.Module):
    """What symbolic tracing cannot run (POPTORCH_REFERENCE §12)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.python_calls = 0

    def forward(self, x, y):
        self.python_calls += 1          # Python side effect: runs at trace time only
        self.steps += 1                 # in-place buffer update: lands in the graph
        out = self.fc(x)
        n = float(out.numel())          # concrete at trace time
        if self.training:               # Python control flow on a flag
            out = out * 1.0
        acc = (out.argmax(1) == y).sum() / n * out.shape[1]
        return F.cross_entropy(out, y), acc  # the loss first, not last


def test_client_patterns_trace_and_the_loss_is_found_by_provenance():
    torch.manual_seed(0)
    model = ClientPatterns()
    ref = copy.deepcopy(model)
    G = 4
    x, y = torch.randn(3 * G, 4), torch.randint(0, 3, (3 * G,))
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(G)
    opts.outputMode(poptorch.OutputMode.All)
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(poptorch.PoptorchLiteWarning,
                      match=r"changes the Python attribute model.python_calls \(0 -> 1\)"):
        loss, acc = train(x, y)
    loss2, _ = train(x, y)
    assert model.python_calls == 0            # ran once, at the trace, and put back (W-LITE-14)
    assert int(model.steps) == 2 * G          # the buffer update ran per micro-batch
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for _ in range(2):
        ref_opt.zero_grad()
        for k in range(G):
            l, _ = ref(x[3 * k:3 * k + 3], y[3 * k:3 * k + 3])
            (l / G).backward()
            ref_losses.append(l.detach())
        ref_opt.step()
    assert_close(torch.cat([loss, loss2]), torch.stack(ref_losses), atol=1e-5, rtol=0)
    assert acc.shape == (G,)


class CustomLoss(torch.nn.Module):
    def __init__(self, reduction):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)
        self.reduction = reduction

    def forward(self, x):
        out = self.fc(x)
        return {"out": out, "loss": poptorch.identity_loss((out ** 2).sum(1), self.reduction)}


@pytest.mark.parametrize("reduction,plain", [("sum", torch.sum), ("mean", torch.mean),
                                             ("none", torch.sum)])
def test_identity_loss_trains_like_its_reduction(reduction, plain):
    torch.manual_seed(0)
    model = CustomLoss(reduction)
    ref = copy.deepcopy(model)
    x = torch.randn(6, 4)
    result = poptorch.trainingModel(model, None, torch.optim.SGD(model.parameters(), lr=0.1))(x)
    assert set(result) == {"out", "loss"}
    out = ref.fc(x)
    plain((out ** 2).sum(1)).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), atol=1e-6, rtol=0)


def test_stage_summary_lists_layers_blocks_stages_and_devices():
    model = begin_blocks()
    wrapped = poptorch.inferenceModel(model, poptorch.Options().setExecutionStrategy(
        poptorch.ShardedExecution()))
    with pytest.raises(poptorch.DeviceError, match="not been compiled"):
        poptorch.stage_summary(wrapped)
    wrapped(*data(2))
    rows = [[c.strip() for c in line.split("|")] for line in poptorch.stage_summary(wrapped).splitlines()]
    assert rows[0] == ["layer", "block", "stage", "ipu", "device", "parameters"]
    assert rows[2:] == [
        ["seq.dense1", "s0", "0", "0", "cpu", "72"], ["seq.relu1", "s0", "0", "0", "cpu", "0"],
        ["seq.dense2", "s1", "1", "1", "cpu", "72"], ["seq.relu2", "s1", "1", "1", "cpu", "0"],
        ["seq.dense3", "s1", "1", "1", "cpu", "72"], ["seq.relu3", "s1", "1", "1", "cpu", "0"],
        ["seq.logits", "s2", "2", "2", "cpu", "36"]]


def test_front_ends_refuse_bad_assignments():
    seq = WithSequential().seq
    with pytest.raises(poptorch.BlockError, match="7 layers"):
        poptorch.set_pipeline_stage_assignment(seq, [0, 1])
    with pytest.raises(poptorch.BlockError, match="back to 0"):
        poptorch.set_pipeline_stage_assignment(seq, [0, 1, 0, 1, 1, 1, 1])
    with pytest.raises(poptorch.BlockError, match="no layer named 'dense9'"):
        poptorch.split_at(seq, ["dense9"])


def test_annotations_are_no_ops_outside_a_wrapper():
    model = begin_blocks()
    x, y = data(3)
    out, _ = model(x, y)
    assert not poptorch.isRunningOnIpu()
    assert out.shape == (3, 4)


def test_is_running_on_ipu_is_true_while_traced():
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(poptorch.isRunningOnIpu())
            return x * 2

    poptorch.inferenceModel(Probe())(torch.ones(2))
    assert seen == [True]


class ViewReLU(torch.nn.Module):
    """An in-place ReLU through a view: it stays a write (a write to the value itself becomes
    its functional form: [Note: writes to activations] in ``grad_semantics``)."""

    def forward(self, x):
        x.view(-1).relu_()
        return x


class InPlaceAtBoundary(torch.nn.Module):
    """Stage 1 opens with an in-place ReLU on stage 0's output; stage 2 writes through a view."""

    def __init__(self):
        super().__init__()
        self.seq = torch.nn.Sequential(torch.nn.Linear(4, 6), ViewReLU(), torch.nn.Linear(6, 6))
        self.head = torch.nn.Linear(6, 2)

    def forward(self, x, y):
        h = self.seq(x)
        with poptorch.Block("head", ipu_id=2):
            flat = h.view(-1)
            flat.mul_(0.5)
            out = self.head(h)
            return out, F.mse_loss(out, y)


def test_values_written_in_place_at_a_stage_boundary_match_plain_pytorch():
    torch.manual_seed(0)
    model = InPlaceAtBoundary()
    poptorch.set_pipeline_stage_assignment(model.seq, [0, 1, 1])
    ref = copy.deepcopy(model)
    G = 2
    x, y = torch.randn(3 * G, 4), torch.randn(3 * G, 2)
    opts = poptorch.Options().setExecutionStrategy(poptorch.ShardedExecution())
    opts.Training.gradientAccumulation(G)
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    _, loss = train(x, y)
    part = next(iter(train._programs.values())).partition
    assert [len(st.written_inputs) for st in part.stages] == [0, 1, 1]
    _, ref_losses, ref_grads = reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1),
                                                  x, y, 1, G, 1)
    assert_close(loss, ref_losses[-1], atol=1e-6, rtol=0)
    grads = trained_grads(train)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(grads[n], ref_grads[n], atol=1e-6, rtol=0, msg=n)
        assert_close(p.detach(), q.detach(), atol=1e-6, rtol=0, msg=n)


def test_stage_graphs_hold_no_unread_alias_or_detach():
    """make_fx records an ``aten.alias``/``aten.detach`` of outputs autograd saves; nothing
    reads them, so stage graphs leave them out (each was a dispatch per forward), and the
    model still trains as plain PyTorch (the transparency tests)."""
    from poptorch_lite.compiler.partition import partition

    class Conv(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 4, 3)
            self.fc = torch.nn.Linear(4 * 6 * 6, 3)

        def forward(self, x, y):
            out = self.fc(F.relu(F.max_pool2d(self.conv(x), 1)).flatten(1))
            return out, F.cross_entropy(out, y)

    model = Conv()
    args = (torch.randn(2, 1, 8, 8), torch.tensor([0, 2]))
    part = partition(model, {m: m.training for m in model.modules()}, args, {},
                     poptorch.ShardedExecution(), True)
    dead = (torch.ops.aten.alias.default, torch.ops.aten.detach.default)
    nodes = [n for st in part.stages for gm in (st.module, *(seg.module for seg in st.segments))
             for n in gm.graph.nodes]
    assert nodes and [n for n in nodes if n.target in dead and not n.users] == []


@pytest.mark.parametrize("schedule,stages", [
    ("grouped", [(0, ("b0",)), (1, ("b1", "b2")), (0, ("b3",))]),  # PopTorch merges b1 and b2
    ("zero_bubble", [(0, ("b0",)), (1, ("b1",)), (1, ("b2",)), (0, ("b3",))]),  # a V
])
def test_consecutive_blocks_on_one_ipu_merge_except_as_zero_bubbles_virtual_stages(
        schedule, stages):
    """Blocks on IPUs 0, 1, 1, 0 with AutoStage.AutoIncrement: PopTorch's pipelines merge the
    two on IPU 1 into one stage; ZeroBubble, which PopTorch never had, keeps each stage id
    its own stage, the V of ZBV ([Note: partition])."""
    from poptorch_lite.compiler.partition import partition
    from models import BlockMLP
    model = BlockMLP(4, ipus=(0, 1, 1, 0))
    part = partition(model, {m: m.training for m in model.modules()}, data(2), {},
                     poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement,
                                                 schedule=schedule), True)
    assert [(st.ipu, st.blocks) for st in part.stages] == stages


class TwoBranches(torch.nn.Module):
    """DINO's layout ([Note: stages by data flow]): a student over IPUs 0 and 1, then a
    teacher over IPUs 0 and 1 again, which reads none of the student's values. ``tail``: what
    the teacher's IPU-0 block does besides (``"student"``: uses the student's IPU-1 output;
    ``"dropout"``: draws after the student's dropout on IPU 1; ``"in_place"``: writes in
    place what the student's IPU-1 block reads)."""

    def __init__(self, tail=None):
        super().__init__()
        self.s0, self.s1, self.t0, self.t1 = (torch.nn.Linear(8, 8) for _ in range(4))
        self.tail = tail

    def forward(self, x, y):
        with poptorch.Block("s0", ipu_id=0):
            a = torch.tanh(self.s0(x))
        with poptorch.Block("s1", ipu_id=1):
            student = self.s1(F.dropout(a, 0.25) if self.tail == "dropout" else a)
            if self.tail == "in_place":
                student = student * x.sum()
        with poptorch.Block("t0", ipu_id=0):
            b = torch.tanh(self.t0(x + student if self.tail == "student" else x))
            if self.tail == "dropout":
                b = F.dropout(b, 0.25)
            if self.tail == "in_place":
                x.mul_(2)
        with poptorch.Block("t1", ipu_id=1):
            teacher = self.t1(b)
            return student, F.mse_loss(student, teacher.detach() + y)


def test_blocks_on_ipus_0_1_0_1_are_two_stages_when_the_data_flows_forward():
    torch.manual_seed(0)
    model = TwoBranches()
    ref = copy.deepcopy(model)
    G = 4
    x, y = torch.randn(2 * G, 8), torch.randn(2 * G, 8)
    opts = poptorch.Options()  # PipelinedExecution(AutoStage.SameAsIpu)
    opts.Training.gradientAccumulation(G)
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    out, loss = train(x, y)
    assert stage_layout(train) == [(0, ["s0", "t0"]), (1, ["s1", "t1"])]
    outs, losses, _ = reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1),
                                         x, y, 1, G, 1)
    assert_close(loss, losses[-1], atol=0, rtol=0)
    assert_close(out, outs[-1], atol=0, rtol=0)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), atol=0, rtol=0, msg=n)


@pytest.mark.parametrize("tail, how", [
    ("student", "uses a value of block 's1'"),
    ("dropout", "draws random numbers after block 's1'"),
    ("in_place", "writes in place what is read by block 's1'"),
])
def test_a_stage_that_needs_a_later_stages_work_is_refused(tail, how):
    model = TwoBranches(tail)
    before = copy.deepcopy(model.state_dict())
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorch.BlockError, match=f"stage ids must ascend along the data flow"
                                                  f"(.|\\n)*({how})"):
        train(torch.randn(8, 8), torch.randn(8, 8))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_of_an_ops_several_outputs_only_those_autograd_differentiates_may_need_a_gradient():
    """[Note: value info]: a value that crosses to a stage in another process requires grad
    on arrival where it may. Of a training batch norm's outputs only the normalised one does
    (its saved mean and inverse deviation have no derivative; read as requiring grad, a
    second-order backward failed in the next stage); an op that is not ATen's (a custom
    Function: Python of the model's, never run for this) keeps the superset: all may."""
    from poptorch_lite.compiler import value_info

    graph = torch.fx.Graph()
    x, w, b, mean, var = (graph.placeholder(n) for n in ("x", "w", "b", "mean", "var"))
    norm = graph.call_function(torch.ops.aten.native_batch_norm.default,
                               (x, w, b, mean, var, True, 0.1, 1e-5))
    items = [graph.call_function(operator.getitem, (norm, k)) for k in range(3)]
    graph.output(tuple(items))
    for node, shape in zip((x, w, b, mean, var), ((4, 6), (6,), (6,), (6,), (6,))):
        node.meta["val"] = torch.empty(shape, device="meta")
    norm.meta["val"] = (torch.empty(4, 6, device="meta"),) + tuple(
        torch.empty(6, device="meta") for _ in range(2))
    for k, item in enumerate(items):
        item.meta["val"] = norm.meta["val"][k]
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    sources = {x: "input:0", w: "param:w", b: "param:b", mean: "buffer:m", var: "buffer:v"}
    infos = value_info.value_infos(gm, sources, lambda name: True, lambda n: n.name,
                                   {n.name for n in items})
    assert [infos[n.name].differentiable for n in items] == [True, False, False]

    ran = []

    def custom(*args):  # stands for a custom Function's call: never run to decide
        ran.append(args)
        return torch.ops.aten.native_batch_norm.default(*args)
    norm.target = custom
    infos = value_info.value_infos(gm, sources, lambda name: True, lambda n: n.name,
                                   {n.name for n in items})
    assert [infos[n.name].differentiable for n in items] == [True, True, True]
    assert ran == []
