"""poptorch.custom_op and its registry ([Note: custom ops]): PopTorch's own custom-op tests
(the Cube and LeakyRelu ops of its ``custom_ops_test.py``) with Python implementations, and
transparency against plain PyTorch calling the same ops, across stages, schedules, replicas,
accumulation and compiled stages, with a custom backward."""

import copy

import pytest
import torch
import torch.nn.functional as F

import poptorch_lite as poptorch
from poptorch_lite import custom_ops

from models import microbatch_seeds, reference_training


@pytest.fixture(autouse=True)
def registry(monkeypatch):
    """Each test's registrations end with it (the shipped ops stay)."""
    monkeypatch.setattr(custom_ops, "_REGISTRY", dict(custom_ops._REGISTRY))


def cube(x, bias, **attributes):
    return x ** 3 + bias, x ** 3


class LeakyRelu(torch.autograd.Function):
    """PopTorch's example op, with a backward of its own that is *not* autograd's derivative
    (it also passes ``alpha`` where x > 0 is exactly 0): a trace that differentiated the
    forward's ops instead would train differently."""

    @staticmethod
    def forward(ctx, x, alpha):
        ctx.save_for_backward(x)
        ctx.alpha = alpha
        return torch.where(x > 0, x, alpha * x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.where(x >= 0, 1.0 + ctx.alpha, ctx.alpha), None


def leaky_relu(x, alpha=0.01, **attributes):
    return LeakyRelu.apply(x, alpha)


def test_popTorchs_cube_inference_has_two_outputs():
    """PopTorch's ``test_inference``: out[0] == 12, out[1] == 8 for x = 2, bias = 4."""
    poptorch.register_custom_op("Cube", "com.acme", cube)

    class BasicNetwork(torch.nn.Module):
        def forward(self, x, bias):
            x, y = poptorch.custom_op([x, bias], "Cube", "com.acme", 1, example_outputs=[x, x])
            return x, y

    model = poptorch.inferenceModel(BasicNetwork())
    out = model(torch.full((1, 8), 2.0), torch.full((1, 8), 4.0))
    assert torch.equal(out[0], torch.full((1, 8), 12.0))
    assert torch.equal(out[1], torch.full((1, 8), 8.0))
    model.destroy()


class Net(torch.nn.Module):
    """Two stages; the first ends in the LeakyRelu custom op, the second in CopyTensor and
    RemapCE (the shipped identities), with dropout so the random streams are compared too."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
        self.drop = torch.nn.Dropout(0.25)

    def forward(self, x, y):
        with poptorch.Block("in", ipu_id=0):
            h = poptorch.custom_op([self.l1(x)], "LeakyRelu", "com.acme", 1,
                                   example_outputs=[x], attributes={"alpha": 0.02})[0]
        with poptorch.Block("out", ipu_id=1):
            h = poptorch.custom_op([self.drop(h)], "CopyTensor", "ai.graphcore", 1,
                                   example_outputs=[h])[0]
            out = self.l2(h)
            out = poptorch.custom_op([out], "RemapCE", "ai.graphcore", 1, example_outputs=[out],
                                     attributes={"fwd_grain_size": 16, "debug_str": ""})[0]
            loss = F.cross_entropy(out, y)
        return out, loss


CONFIGS = {  # name: (schedule, D, G, R, compiled)
    "grouped": (poptorch.PipelinedExecution(), 2, 4, 1, False),
    "sequential-replicas": (poptorch.ShardedExecution(), 1, 2, 2, False),
    "grouped-compiled": (poptorch.PipelinedExecution(), 1, 4, 1, True),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_training_matches_plain_pytorch_calling_the_same_ops(config):
    strategy, D, G, R, compiled = CONFIGS[config]
    poptorch.register_custom_op("LeakyRelu", "com.acme", leaky_relu)
    torch.manual_seed(0)
    net = Net()
    plain = copy.deepcopy(net)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(D * G * R * 2, 8, generator=g), torch.randint(0, 4, (D * G * R * 2,),
                                                                      generator=g)
    opts = poptorch.Options().deviceIterations(D).replicationFactor(R)
    opts.Training.gradientAccumulation(G)
    opts.setExecutionStrategy(strategy)
    if compiled:
        opts.compileStages(True, backend="aot_eager")
    train = poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.5))
    torch.manual_seed(7)
    out, loss = train(x, y)
    torch.manual_seed(7)
    seeds = microbatch_seeds(D, G * R)
    outs, losses, _ = reference_training(plain, torch.optim.SGD(plain.parameters(), lr=0.5),
                                         x, y, D, G, R, seeds=seeds)
    tol = dict(rtol=1e-5, atol=1e-6) if compiled else dict(rtol=0, atol=0)
    # OutputMode.Final: each replica's last micro-batch ([D, G, R, B] order)
    torch.testing.assert_close(loss, losses[-1] if R == 1 else torch.stack(losses[-R:]), **tol)
    torch.testing.assert_close(out, torch.cat(outs[-R:]), **tol)
    for (name, p), q in zip(net.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, **tol, msg=name)
    train.destroy()


def test_the_custom_backward_is_the_one_that_trains():
    """The op's own backward, not autograd's derivative of its forward, reaches the weights:
    the same model with ``torch.where`` in its place trains to other weights."""
    poptorch.register_custom_op("LeakyRelu", "com.acme", leaky_relu)
    torch.manual_seed(0)
    net = Net()
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    derived = copy.deepcopy(net)
    opts = poptorch.Options().deviceIterations(8).setExecutionStrategy(
        poptorch.ShardedExecution())
    train = poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.5))
    train(x, y)
    poptorch.register_custom_op("LeakyRelu", "com.acme",
                                lambda x, alpha: torch.where(x > 0, x, alpha * x))
    other = poptorch.trainingModel(derived, opts.clone(),
                                   torch.optim.SGD(derived.parameters(), lr=0.5))
    other(x, y)
    assert not torch.equal(net.l1.weight, derived.l1.weight)
    train.destroy()
    other.destroy()


def test_a_version_of_its_own_comes_before_any_version():
    poptorch.register_custom_op("Scale", "com.acme", lambda x: 2 * x)
    poptorch.register_custom_op("Scale", "com.acme", lambda x: 3 * x, domain_version=2)
    one = torch.ones(2)
    assert torch.equal(poptorch.custom_op([one], "Scale", "com.acme", 1, [one])[0], 2 * one)
    assert torch.equal(poptorch.custom_op([one], "Scale", "com.acme", 2, [one])[0], 3 * one)
    assert ("com.acme", "Scale", 2) in custom_ops.registered()


def test_the_shipped_copies_are_copies_with_an_identity_gradient():
    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    for name in ("CopyTensor", "RemapCE"):
        (out,) = poptorch.custom_op([x], name, "ai.graphcore", 1, example_outputs=[x],
                                    attributes={"grain_size": 8})
        assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
        (grad,) = torch.autograd.grad(out, x, torch.tensor([1.0, 2.0, 3.0]))
        assert torch.equal(grad, torch.tensor([1.0, 2.0, 3.0]))


def test_an_unregistered_op_names_what_the_domain_has():
    poptorch.register_custom_op("Cube", "com.acme", cube)
    with pytest.raises(poptorch.CustomOpError) as info:
        poptorch.custom_op([torch.ones(1)], "Square", "com.acme", 1, [torch.ones(1)])
    assert "domain 'com.acme' has Cube (version any)" in str(info.value)
    assert isinstance(info.value, ValueError)


# -- DINO's ExpMovAvg: an average after the optimizer's step ([Note: after-step averages]) --


class Dino(torch.nn.Module):
    """DINO's shape: a student trained against a frozen teacher whose weights follow the
    student's, averaged by ``ExpMovAvg`` called in the forward, in each parameter's block
    (vision/dino/pytorch/core/dino.py). ``plain``: the forward without the op, for the
    reference, which averages after its own step as DINO's CPU reference does."""

    def __init__(self, plain: bool = False):
        super().__init__()
        self.student = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(),
                                           torch.nn.Linear(8, 4))
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)
        self.plain = plain
        if not plain:
            poptorch.BeginBlock(self.student[2], ipu_id=1)
            poptorch.BeginBlock(self.teacher[2], ipu_id=1)

    def forward(self, x, factor):
        s = self.student(x)
        with torch.no_grad():
            for q, k in zip(self.student.parameters(), self.teacher.parameters()):
                if not self.plain:
                    poptorch.custom_op([q, k, factor], "ExpMovAvg", "com.acme", 1,
                                       example_outputs=[q], attributes={})
            t = self.teacher(x)
        return s, F.mse_loss(s, t.softmax(-1) + 1.0)

    def average(self, f: torch.Tensor) -> None:  # DINO's gpu_update_teacher, f a tensor
        with torch.no_grad():
            for q, k in zip(self.student.parameters(), self.teacher.parameters()):
                k.mul_(f).add_(q * (1 - f))


EMA_CONFIGS = {  # name: (schedule, D, G, R, options)
    "grouped": (poptorch.PipelinedExecution(), 2, 4, 1, {}),
    "sequential-replicas": (poptorch.ShardedExecution(), 2, 2, 2, {}),
    "grouped-ipu-model": (poptorch.PipelinedExecution(), 1, 4, 1, {"model": True}),
    "grouped-offloaded": (poptorch.PipelinedExecution(), 1, 4, 1, {"offload": True}),
    "grouped-compiled": (poptorch.PipelinedExecution(), 2, 4, 1, {"compiled": True}),
}


def dino_options(strategy, D: int, G: int, R: int, model=False, offload=False, compiled=False):
    opts = poptorch.Options().deviceIterations(D).replicationFactor(R).useIpuModel(model)
    opts.Training.gradientAccumulation(G)
    opts.setExecutionStrategy(strategy)
    if offload:
        opts.TensorLocations.setOptimizerLocation(
            poptorch.TensorLocationSettings().useOnChipStorage(False))
    if compiled:
        opts.compileStages(True, backend="aot_eager")
    return opts


@pytest.mark.parametrize("config", sorted(EMA_CONFIGS))
def test_the_teacher_follows_the_student_after_each_step_as_dinos_cpu_reference(config):
    strategy, D, G, R, extra = EMA_CONFIGS[config]
    torch.manual_seed(0)
    net, plain = Dino(), Dino(plain=True)
    plain.load_state_dict(net.state_dict())
    x = torch.randn(2 * D * G * R * 2, 8, generator=torch.Generator().manual_seed(3))
    factors = torch.tensor([0.75, 0.5])  # one per call, the same for every micro-batch
    initial = net.teacher[0].weight.detach().clone()
    train = poptorch.trainingModel(net, dino_options(strategy, D, G, R, **extra),
                                   torch.optim.AdamW(net.parameters(), lr=0.05))
    optimizer = torch.optim.AdamW(plain.parameters(), lr=0.05)
    F_, b = D * G * R, 2
    losses = []
    for c, f in enumerate(factors):
        _, loss = train(x[c * F_ * b:(c + 1) * F_ * b], f.repeat(F_))
        for d in range(D):
            optimizer.zero_grad()
            for j in range(G * R):
                k = (c * D + d) * G * R + j
                _, expected = plain(x[k * b:(k + 1) * b], None)
                expected.backward()
                losses.append(expected.detach())
            for p in plain.student.parameters():
                p.grad.div_(G * R)
            optimizer.step()
            plain.average(f)
    tol = dict(rtol=1e-5, atol=1e-6) if extra.get("compiled") else dict(rtol=0, atol=0)
    # OutputMode.Final: each replica's last micro-batch ([D, G, R, B] order)
    torch.testing.assert_close(loss, losses[-1] if R == 1 else torch.stack(losses[-R:]), **tol)
    train.copyWeightsToHost()
    for (name, p), q in zip(net.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(p, q, **tol, msg=name)
    assert not torch.equal(net.teacher[0].weight, initial)  # the teacher moved
    train.destroy()


def test_exp_mov_avg_is_refused_outside_a_training_model_and_for_uneven_factors():
    net = Dino()
    with pytest.raises(poptorch.CustomOpError, match="outside one there is no step"):
        net(torch.ones(2, 8), torch.ones(1))
    infer = poptorch.inferenceModel(Dino())
    with pytest.raises(poptorch.CustomOpError, match="an inference model has none"):
        infer(torch.ones(2, 8), torch.ones(1))
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    train = poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.5))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(poptorch.ExecutionError, match=r"different factors \(\[0.5, 0.75\]\)"
                       r"(.|\n)*the call was undone") as info:
        train(torch.ones(8, 8), torch.tensor([0.5, 0.5, 0.75, 0.5]))
    assert isinstance(info.value.__cause__, poptorch.CustomOpError)
    train.copyWeightsToHost()
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k  # refused before the optimizer's step
    train.destroy()


# -- YOLOv4's Nms and PopART's Ctc -----------------------------------------------------------


def nms_inputs(seed: int, B=2, N=40, C=3):
    g = torch.Generator().manual_seed(seed)
    corner = torch.rand(B, N, 2, generator=g) * 40
    boxes = torch.cat([corner, corner + torch.rand(B, N, 2, generator=g) * 30 + 1], -1)
    return torch.rand(B, N, C, generator=g), boxes


def nms_examples(B: int, K: int) -> list:
    return [torch.zeros(B, K, dtype=torch.long), torch.zeros(B, K), torch.zeros(B, K, 4),
            torch.zeros(B, K, dtype=torch.int), torch.zeros(B, dtype=torch.int)]


@pytest.mark.parametrize("seed", range(4))
def test_nms_keeps_what_torchvisions_per_class_nms_keeps_best_first(seed):
    """YOLOv4's op against an independent reference: greedy by score within each class
    (``batched_nms``), above the score threshold, the first ``numDetections``."""
    torchvision = pytest.importorskip("torchvision")
    scores, boxes = nms_inputs(seed)
    B, N, C = scores.shape
    K, threshold, floor = 12, 0.4, 0.2
    got = poptorch.custom_op([scores, boxes], "Nms", "ai.graphcore", 1, nms_examples(B, K),
                             {"threshold": threshold, "scoreThreshold": floor,
                              "numDetections": K, "useGather": 1})
    for b in range(B):
        flat, which = scores[b].reshape(-1), torch.arange(N * C)
        kept = flat > floor
        picked = torchvision.ops.batched_nms(boxes[b][which[kept] // C], flat[kept],
                                             which[kept] % C, threshold)[:K]
        n = len(picked)
        assert n == K  # these inputs never run out: every batch counts K
        assert torch.equal(got[0][b], (which[kept] // C)[picked])
        assert torch.equal(got[1][b], flat[kept][picked])
        assert torch.equal(got[2][b], boxes[b][(which[kept] // C)[picked]])
        assert torch.equal(got[3][b], (which[kept] % C)[picked].int())
    assert torch.equal(got[4], torch.full((B,), K, dtype=torch.int32))


def test_nms_pads_and_stops_as_its_codelets_do():
    """Once one batch has no box above the score threshold the op stops for all: that batch
    counts what it found, the other ``numDetections`` (the codelets' count); empty places are
    -1, 0, 0 and INT32_MAX."""
    scores = torch.tensor([[[0.9], [0.8], [0.1], [0.05]], [[0.9], [0.7], [0.6], [0.55]]])
    boxes = torch.tensor([[[0.0, 0, 1, 1], [5, 5, 6, 6], [9, 9, 10, 10], [20, 20, 21, 21]]] * 2)
    idx, sc, bx, cls, count = poptorch.custom_op(
        [scores, boxes], "Nms", "ai.graphcore", 1, nms_examples(2, 4),
        {"threshold": 0.5, "scoreThreshold": 0.5, "numDetections": 4})
    assert idx.tolist() == [[0, 1, -1, -1], [0, 1, 2, -1]]  # batch 1's 0.55 is never reached
    assert torch.equal(sc, torch.tensor([[0.9, 0.8, 0.0, 0.0], [0.9, 0.7, 0.6, 0.0]]))
    assert cls.tolist() == [[0, 0, INT_MAX, INT_MAX], [0, 0, 0, INT_MAX]]
    assert torch.equal(bx[0, 2:], torch.zeros(2, 4)) and torch.equal(bx[1, :3], boxes[1, :3])
    assert count.tolist() == [2, 4]


INT_MAX = torch.iinfo(torch.int32).max


def test_soft_nms_scales_the_scores_of_the_best_boxes_neighbours():
    """``sigma`` > 0 (the codelets' paper version): a box of the best's class keeps its place
    with its score times exp(-IoU²/sigma), here below another class's box it passed before."""
    scores = torch.tensor([[[0.9, 0.0], [0.8, 0.7], [0.0, 0.0]]])
    boxes = torch.tensor([[[0.0, 0, 2, 2], [1, 0, 3, 2], [9, 9, 10, 10]]])  # IoU 2 / 6
    idx, sc, _, cls, count = poptorch.custom_op(
        [scores, boxes], "Nms", "ai.graphcore", 1, nms_examples(1, 3),
        {"threshold": 0.5, "scoreThreshold": 0.1, "numDetections": 3, "sigma": 0.5})
    iou = torch.tensor(2.0) / torch.tensor(6.0)
    scaled = torch.tensor(0.8) * torch.exp(-(iou * iou) / 0.5)
    assert idx.tolist() == [[0, 1, 1]] and cls.tolist() == [[0, 1, 0]]
    assert torch.equal(sc, torch.stack([torch.tensor(0.9), torch.tensor(0.7), scaled])[None])
    assert count.tolist() == [3]


def test_nms_runs_in_a_wrapped_inference_model_as_outside():
    class Detector(torch.nn.Module):
        def forward(self, scores, boxes):
            return poptorch.custom_op([scores.sigmoid(), boxes], "Nms", "ai.graphcore", 1,
                                      nms_examples(len(scores), 8), {"threshold": 0.45,
                                                           "scoreThreshold": 0.55,
                                                           "numDetections": 8})
    scores, boxes = nms_inputs(7, B=4)
    wrapped = poptorch.inferenceModel(Detector(), poptorch.Options().deviceIterations(4))
    for got, expected in zip(wrapped(scores, boxes), Detector()(scores, boxes)):
        assert torch.equal(got, expected)
    with pytest.raises(poptorch.CustomOpError, match=r"numDetections \(50\) must be between 1"):
        poptorch.custom_op([scores, boxes], "Nms", "ai.graphcore", 1, nms_examples(4, 50),
                           {"threshold": 0.5, "numDetections": 50})


def ctc_inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    lp = torch.randn(12, 3, 6, generator=g).log_softmax(-1).to(dtype).requires_grad_()
    targets = torch.randint(1, 6, (3, 4), generator=g)
    return lp, targets, torch.tensor([12, 9, 11]), torch.tensor([4, 2, 3])


@pytest.mark.parametrize("reduction", ["Sum", "Mean", "None"])
def test_ctc_is_torchs_ctc_loss_and_its_gradient(reduction):
    """With "None" the loss is one per sequence and the gradient output each sequence's own
    (a sequence's loss reads only its own column of log_probs: the gradient of their sum)."""
    lp, targets, lengths, target_lengths = ctc_inputs()
    shape = (3,) if reduction == "None" else ()
    loss, grad = poptorch.custom_op([lp, targets, lengths, target_lengths], "Ctc",
                                    "ai.graphcore", 1, [torch.zeros(shape), lp],
                                    {"reduction": reduction, "blank": 0,
                                     "enableReducedClassesInLabel": True})
    expected = F.ctc_loss(lp, targets, lengths, target_lengths, reduction=reduction.lower())
    assert loss.shape == expected.shape == shape
    assert torch.equal(loss, expected)
    assert torch.equal(grad, torch.autograd.grad(expected.sum(), lp, retain_graph=True)[0])
    assert torch.equal(torch.autograd.grad(loss.sum(), lp)[0], grad)


@pytest.mark.parametrize("out_type, loss_dtype", [("UNDEFINED", torch.float16),
                                                  ("FLOAT", torch.float32)])
def test_a_float16_ctc_is_computed_in_float32(out_type, loss_dtype):
    """16-bit log-probabilities: the loss computed in float32, returned in their type unless
    ``outDataType`` names another; the gradient output in their type."""
    lp, targets, lengths, target_lengths = ctc_inputs(torch.float16)
    loss, grad = poptorch.custom_op([lp, targets, lengths, target_lengths], "Ctc",
                                    "ai.graphcore", 1, [torch.zeros((), dtype=loss_dtype), lp],
                                    {"reduction": "Sum", "blank": 0, "outDataType": out_type})
    wide = lp.detach().float().requires_grad_()
    expected = F.ctc_loss(wide, targets, lengths, target_lengths, reduction="sum")
    assert loss.dtype == loss_dtype and grad.dtype == torch.float16
    assert torch.equal(loss, expected.to(loss_dtype))
    assert torch.equal(grad, torch.autograd.grad(expected, wide)[0].half())


class Speech(torch.nn.Module):
    """Conformer's loss head: a CTC loss over two stages' log-probabilities (``plain``: torch's
    ``ctc_loss`` in its place)."""

    def __init__(self, plain=False):
        super().__init__()
        self.encoder, self.head = torch.nn.Linear(5, 8), torch.nn.Linear(8, 6)
        self.plain = plain
        if not plain:
            poptorch.BeginBlock(self.head, ipu_id=1)

    def forward(self, x, targets, lengths, target_lengths):
        lp = self.head(torch.tanh(self.encoder(x))).log_softmax(-1).transpose(0, 1)
        if self.plain:
            loss = F.ctc_loss(lp, targets, lengths, target_lengths, reduction="sum")
        else:
            loss = poptorch.custom_op([lp, targets, lengths, target_lengths], "Ctc",
                                      "ai.graphcore", 1, [torch.zeros(()), lp],
                                      {"reduction": "Sum", "blank": 0})[0]
        return poptorch.identity_loss(loss / x.shape[0], reduction="mean")


def test_a_ctc_loss_trains_as_torchs_across_two_stages():
    torch.manual_seed(0)
    net, plain = Speech(), Speech(plain=True)
    plain.load_state_dict(net.state_dict())
    G, b = 4, 2
    g = torch.Generator().manual_seed(2)
    x, targets = torch.randn(G * b, 10, 5, generator=g), torch.randint(1, 6, (G * b, 3),
                                                                       generator=g)
    lengths = torch.full((G * b,), 10)
    target_lengths = torch.randint(1, 4, (G * b,), generator=g)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(G)
    train = poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.1))
    loss = train(x, targets, lengths, target_lengths)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for k in range(G):
        s = slice(k * b, (k + 1) * b)
        expected = plain(x[s], targets[s], lengths[s], target_lengths[s])
        (expected / G).backward()
    optimizer.step()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=0)
    for (name, p), q in zip(net.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    train.destroy()
