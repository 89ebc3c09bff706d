"""The TF1 face (``poptorch_lite.pipeline``): the PopTorch face's numbers, and plain PyTorch's."""

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

import poptorch_lite as poptorch
from poptorch_lite.frontends import Pipeline

from models import data, reference_training

WIDTH, CLASSES = 8, 4


class Dense(torch.nn.Module):
    """A TF1-style stage: takes (activations, labels), returns them for the next stage."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x, labels):
        return torch.relu(self.fc(x)), labels


class Head(torch.nn.Module):
    """The last stage: computes the loss from its inputs and returns (logits, loss)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(WIDTH, CLASSES)

    def forward(self, x, labels):
        out = self.fc(x)
        return out, F.cross_entropy(out, labels)


def stages(S: int, seed: int = 0) -> list:
    torch.manual_seed(seed)
    return [Dense() for _ in range(S - 1)] + [Head()]


class Annotated(torch.nn.Module):
    """The same stages written for the PopTorch face: stage k in Block("stage<k>")."""

    def __init__(self, layers, mapping):
        super().__init__()
        self.layers, self.mapping = torch.nn.ModuleList(layers), mapping

    def forward(self, x, labels):
        values = (x, labels)
        for k, layer in enumerate(self.layers):
            with poptorch.Block(f"stage{k}", ipu_id=self.mapping[k]):
                values = layer(*values)
        return values


class Plain(torch.nn.Module):
    """The same stages as plain PyTorch."""

    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x, labels):
        values = (x, labels)
        for layer in self.layers:
            values = layer(*values)
        return values


def annotated_options(mapping, schedule, recompute, G, D):
    strategy = poptorch.PipelinedExecution(
        *[poptorch.Stage(f"stage{k}").ipu(ipu).recompute(recompute)
          for k, ipu in enumerate(mapping)], schedule=schedule)
    opts = poptorch.Options().deviceIterations(D).setExecutionStrategy(strategy)
    opts.Training.gradientAccumulation(G)
    return opts.outputMode(poptorch.OutputMode.All)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module):
    pa, pb = [p for _, p in a.named_parameters()], [p for _, p in b.named_parameters()]
    assert len(pa) == len(pb)
    for p, q in zip(pa, pb):
        assert torch.equal(p, q)


CASES = [  # (stages, device_mapping, schedule, G, repeat_count, recompute)
    (2, None, "grouped", 3, 1, False),
    (2, None, "grouped", 4, 2, True),
    (3, None, "interleaved", 5, 2, False),
    (3, [0, 1, 0], "interleaved", 6, 1, True),
    (4, [0, 0, 1, 1], "grouped", 3, 2, False),
    (4, [0, 1, 1, 0], "gpipe", 8, 1, True),
    (4, [0, 1, 1, 0], "zero_bubble", 8, 1, True),  # virtual stages: ZBV's V
    (3, [0, 1, 0], "zero_bubble", 5, 2, False),     # and a loop
    (4, [0, 1, 1, 0], "zero_bubble", 4, 1, False),  # below 2S-1: only Grouped and Interleaved need it
    (3, None, "sequential", 1, 3, False),
    (3, [0, 1, 0], "sequential", 2, 2, True),
    (1, None, "grouped", 2, 2, False),
]


@pytest.mark.parametrize("S, mapping, schedule, G, D, recompute", CASES)
def test_equal_to_the_annotated_model_and_to_plain_pytorch(S, mapping, schedule, G, D, recompute):
    tf1 = stages(S)
    ann, plain = copy.deepcopy(tf1), copy.deepcopy(tf1)
    ipus = mapping or list(range(S))
    x, y = data(4 * G * D, WIDTH, CLASSES)

    pipe = poptorch.pipeline(tf1, gradient_accumulation_count=G, repeat_count=D,
                             optimizer=sgd, pipeline_schedule=schedule, device_mapping=mapping,
                             recomputation_mode="Auto" if recompute else None, outfeed_loss=True)
    losses = pipe(x, y)

    model = Annotated(ann, ipus)
    wrapped = poptorch.trainingModel(model, annotated_options(ipus, schedule, recompute, G, D),
                                     sgd(model.parameters()))
    _, ann_losses = wrapped(x, y)

    ref = Plain(plain)
    _, ref_losses, _ = reference_training(ref, sgd(ref.parameters()), x, y, D, G, 1)

    assert losses.shape == (D * G,)
    assert torch.equal(losses, ann_losses)
    assert torch.equal(losses, torch.stack(ref_losses))
    assert_same_weights(pipe.model, model)
    assert_same_weights(pipe.model, ref)
    stats = pipe.training_model.runStatistics()
    assert stats.schedule == schedule
    # consecutive stages on one IPU merge, as in IPU TF, except as ZeroBubble's virtual stages
    merged = 1 + sum(a != b for a, b in zip(ipus, ipus[1:]))
    assert len(stats.peak_stash_depth) == (S if schedule == "zero_bubble" else merged)


def test_several_calls_keep_matching_plain_pytorch():
    tf1 = stages(3)
    plain = Plain(copy.deepcopy(tf1))
    pipe = poptorch.pipeline(tf1, gradient_accumulation_count=5, repeat_count=2,
                             optimizer=lambda params: torch.optim.Adam(params, lr=0.01),
                             outfeed_loss=True)
    optimizer = torch.optim.Adam(plain.parameters(), lr=0.01)
    for seed in range(3):
        x, y = data(4 * 5 * 2, WIDTH, CLASSES, seed=seed)
        losses = pipe(x, y)
        _, ref_losses, _ = reference_training(plain, optimizer, x, y, 2, 5, 1)
        assert torch.equal(losses, torch.stack(ref_losses))
    assert_same_weights(pipe.model, plain)


def test_sum_reduction_is_tf1s_default_arithmetic():
    tf1 = stages(2)
    plain = Plain(copy.deepcopy(tf1))
    pipe = poptorch.pipeline(tf1, gradient_accumulation_count=3, optimizer=sgd,
                             reduction_method=poptorch.ReductionType.Sum)
    x, y = data(4 * 3, WIDTH, CLASSES)
    pipe(x, y)
    reference_training(plain, sgd(plain.parameters()), x, y, 1, 3, 1, mean=False)
    assert_same_weights(pipe.model, plain)


def test_function_stages_with_a_loss_function_of_outputs_and_labels():
    # The tutorial's layer functions: closures over layers, labels given to `loss`.
    torch.manual_seed(0)
    l1, l2, l3 = (torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH),
                  torch.nn.Linear(WIDTH, CLASSES))
    plain = copy.deepcopy(torch.nn.Sequential(l1, torch.nn.ReLU(), l2, torch.nn.ReLU(), l3))
    layers = [l1, l2]

    def stage1(x):
        for layer in layers:
            x = torch.relu(layer(x))
        return x

    def stage2(h):
        return l3(h)

    params = list(l1.parameters()) + list(l2.parameters()) + list(l3.parameters())
    pipe = poptorch.pipeline([stage1, stage2], gradient_accumulation_count=3, repeat_count=2,
                             optimizer=sgd(params), loss=F.cross_entropy, outfeed_loss=True)
    x, y = data(4 * 3 * 2, WIDTH, CLASSES)
    losses = pipe(x, y)
    assert sorted(n for n, _ in pipe.model.named_children()) == ["stage0_0", "stage0_1",
                                                                "stage1_0"]
    optimizer = sgd(plain.parameters())
    ref = []
    for d in range(2):
        optimizer.zero_grad()
        for j in range(3):
            k = slice((d * 3 + j) * 4, (d * 3 + j + 1) * 4)
            loss = F.cross_entropy(plain(x[k]), y[k])
            loss.backward()
            ref.append(loss.detach())
        for p in plain.parameters():
            p.grad.div_(3)
        optimizer.step()
    assert torch.equal(losses, torch.stack(ref))
    for p, q in zip(params, plain.parameters()):
        assert torch.equal(p, q)


def test_dict_outputs_give_keywords_and_a_bound_method_is_a_stage():
    torch.manual_seed(0)
    head = Head()

    def stage1(x, labels):
        return {"x": x * 2, "labels": labels}

    pipe = poptorch.pipeline([stage1, head.forward], gradient_accumulation_count=3,
                             optimizer=sgd, outfeed_loss=True)
    x, y = data(12, WIDTH, CLASSES)
    with torch.no_grad():  # one step after the 3 micro-batches: losses use the first weights
        expected = torch.stack([head(2 * x[k:k + 4], y[k:k + 4])[1] for k in range(0, 12, 4)])
    assert torch.equal(pipe(x, y), expected)
    assert [n for n, _ in pipe.model.named_children()] == ["stage1_0"]


def test_the_loss_is_the_last_of_a_list_too():
    torch.manual_seed(0)
    fc = torch.nn.Linear(WIDTH, CLASSES)
    pipe = poptorch.pipeline([lambda x, y: [fc(x), F.cross_entropy(fc(x), y)]],
                             gradient_accumulation_count=2, optimizer=sgd(fc.parameters()),
                             outfeed_loss=False)
    x, y = data(8, WIDTH, CLASSES)
    with torch.no_grad():
        expected = [F.cross_entropy(fc(x[k:k + 4]), y[k:k + 4]) for k in (0, 4)]
    logits, losses = pipe(x, y)
    assert logits.shape == (8, CLASSES) and torch.equal(losses, torch.stack(expected))


def test_outfeed_of_outputs_and_inference_equal_plain_pytorch():
    tf1 = stages(2)
    plain = Plain(copy.deepcopy(tf1))
    G, D = 3, 2
    x, y = data(4 * G * D, WIDTH, CLASSES)
    train = poptorch.pipeline(tf1, gradient_accumulation_count=G, repeat_count=D,
                              optimizer=sgd, outfeed_loss=False)
    logits, losses = train(x, y)  # the last stage's outputs, every micro-batch
    assert logits.shape == (4 * G * D, CLASSES) and losses.shape == (G * D,)
    ref_outs, ref_losses, _ = reference_training(plain, sgd(plain.parameters()), x, y, D, G, 1)
    assert torch.equal(logits, torch.cat(ref_outs)) and torch.equal(losses, torch.stack(ref_losses))

    logits, losses = train.inference(x, y)  # every argument goes to the first stage
    with torch.no_grad():
        expected = [plain(x[k:k + 4], y[k:k + 4]) for k in range(0, 4 * G * D, 4)]
    assert torch.equal(logits, torch.cat([o for o, _ in expected]))
    assert torch.equal(losses, torch.stack([l for _, l in expected]))


def test_an_inference_only_pipeline():
    torch.manual_seed(0)
    body, head = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, CLASSES)
    pipe = poptorch.pipeline([body, lambda h: head(torch.relu(h))], gradient_accumulation_count=1,
                             repeat_count=4, device_mapping=[1, 0])
    assert pipe.training_model is None
    x, _ = data(8 * 4, WIDTH, CLASSES)
    out = pipe.inference(x)
    with torch.no_grad():
        assert torch.equal(out, torch.cat([head(torch.relu(body(x[k:k + 8])))
                                           for k in range(0, 32, 8)]))
    assert pipe.inference_model.runStatistics().timeline.stream_names[:2] == [
        "ipu0 (cpu)", "ipu1 (cpu)"]


def test_the_batch_arithmetic_of_a_call_and_the_dataloader():
    pipe = poptorch.pipeline(stages(2), gradient_accumulation_count=4, repeat_count=3,
                             optimizer=sgd, outfeed_loss=True)
    x, y = data(12 * 5, WIDTH, CLASSES)
    loader = poptorch.DataLoader(pipe.options, torch.utils.data.TensorDataset(x, y), batch_size=5)
    bx, by = next(iter(loader))
    assert bx.shape == (5 * 4 * 3, WIDTH)
    assert pipe(bx, by).shape == (12,)


def test_a_failing_first_call_changes_nothing():
    torch.manual_seed(0)
    fc = torch.nn.Linear(WIDTH, CLASSES)
    before = copy.deepcopy(fc.state_dict())
    pipe = poptorch.pipeline([fc, lambda out: out], gradient_accumulation_count=3,
                             optimizer=sgd(fc.parameters()))  # the last stage returns no scalar
    x, _ = data(12, WIDTH, CLASSES)
    with pytest.raises(poptorch.LossError, match=r"must be a scalar tensor, got a tensor of "
                                                 r"shape \(4, 4\)"):
        pipe(x)
    for k, v in fc.state_dict().items():
        assert torch.equal(v, before[k])


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(computational_stages=[]), poptorch.OptionsError, "non-empty list"),
    (dict(computational_stages=[1]), poptorch.InputError, r"computational_stages\[0\] is int"),
    (dict(gradient_accumulation_count=0), poptorch.OptionsError,
     "gradient_accumulation_count must be a positive int, got 0"),
    (dict(repeat_count=1.5), poptorch.OptionsError, "repeat_count must be a positive int"),
    (dict(device_mapping=[0]), poptorch.OptionsError, "device_mapping has 1 entries for 2"),
    (dict(device_mapping=[0, -1]), poptorch.OptionsError, r"device_mapping\[1\] is -1"),
    (dict(gradient_accumulation_count=2), poptorch.PipelineError,
     r"gradient_accumulation_count\(2\) is too small for the Grouped schedule of 2"),
    (dict(gradient_accumulation_count=2, pipeline_schedule="bogus"), poptorch.OptionsError,
     "Unknown pipeline schedule"),
    (dict(recomputation_mode="often"), poptorch.OptionsError, "recomputation_mode 'often'"),
    (dict(outfeed_loss=1), poptorch.OptionsError, "outfeed_loss needs a bool"),
    (dict(loss="mse"), poptorch.InputError, "loss must be None or a function"),
    (dict(optimizer="sgd"), poptorch.OptimizerError, "optimizer must be a torch.optim"),
    (dict(optimizer=torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)),
     poptorch.OptimizerError, r"trains a parameter of shape \(1, 1\) that no stage uses"),
])
def test_refusals_before_anything_is_wrapped(kwargs, error, match):
    layers = stages(2)
    args = dict(computational_stages=layers, gradient_accumulation_count=3, optimizer=sgd) | kwargs
    base = poptorch.Options()
    with pytest.raises(error, match=match):
        poptorch.pipeline(**args, options=base)
    assert not base.is_frozen
    assert poptorch.trainingModel(Plain(layers), poptorch.Options())  # nothing was wrapped


def test_stages_that_share_a_parameter_must_share_an_ipu():
    shared = Dense()
    with pytest.raises(poptorch.OptionsError, match="stages 0 and 2 share a parameter"):
        poptorch.pipeline([shared, Dense(), shared, Head()], gradient_accumulation_count=7,
                          optimizer=sgd)
    poptorch.pipeline([shared, Dense(), shared, Head()], gradient_accumulation_count=7,
                      optimizer=sgd, device_mapping=[0, 1, 0, 1])


SHARED = torch.nn.ModuleDict({"body": torch.nn.Linear(WIDTH, WIDTH),
                               "head": torch.nn.Linear(WIDTH, CLASSES)})


def shared_body(x, labels):  # reaches the whole global SHARED, uses its body
    return torch.relu(SHARED["body"](x)), labels


def shared_head(h, labels):
    return F.cross_entropy(SHARED["head"](h), labels)


def test_functions_sharing_out_one_models_layers_over_ipus():
    plain = copy.deepcopy(SHARED)
    pipe = poptorch.pipeline([shared_body, shared_head], gradient_accumulation_count=3,
                             optimizer=sgd(SHARED.parameters()))
    x, y = data(12, WIDTH, CLASSES)
    pipe(x, y)
    assert [n for n, _ in pipe.model.named_children()] == ["stage0_0"]  # registered once
    optimizer = sgd(plain.parameters())
    for k in range(0, 12, 4):
        F.cross_entropy(plain["head"](torch.relu(plain["body"](x[k:k + 4]))), y[k:k + 4]).backward()
    for p in plain.parameters():
        p.grad.div_(3)
    optimizer.step()
    for p, q in zip(SHARED.parameters(), plain.parameters()):
        assert torch.equal(p, q)
    assert pipe.training_model.runStatistics().timeline.stream_names == ["ipu0 (cpu)",
                                                                         "ipu1 (cpu)"]


def test_base_options_are_cloned_and_their_accumulation_does_not_reach_inference():
    base = poptorch.Options().randomSeed(7)
    base.Training.gradientAccumulation(4)
    pipe = poptorch.pipeline(stages(2), gradient_accumulation_count=3, repeat_count=2,
                             optimizer=sgd, options=base)
    assert not base.is_frozen and base.Training.gradient_accumulation == 4
    assert (pipe.options.device_iterations, pipe.options.Training.gradient_accumulation) == (2, 3)
    x, y = data(4 * 6, WIDTH, CLASSES)
    logits, losses = pipe.inference(x, y)
    assert logits.shape == (24, CLASSES) and losses.shape == (6,)


def test_no_optimizer_and_too_few_micro_batches_for_inference():
    pipe = poptorch.pipeline(stages(3), gradient_accumulation_count=1, repeat_count=2)
    x, y = data(8, WIDTH, CLASSES)
    with pytest.raises(poptorch.WrapError, match="this pipeline has no optimizer"):
        pipe(x, y)
    with pytest.raises(poptorch.PipelineError, match="needs at least 3 micro-batches per call"):
        pipe.inference(x, y)


def test_a_loss_function_needs_the_labels():
    pipe = poptorch.pipeline([torch.nn.Linear(WIDTH, CLASSES)], gradient_accumulation_count=1,
                             optimizer=sgd, loss=F.cross_entropy)
    with pytest.raises(poptorch.InputError, match=r"pipe\(\*inputs, labels\); got 1 argument"):
        pipe(torch.randn(4, WIDTH))


def test_pipeline_is_a_pipeline_and_destroy_releases_both_models():
    layers = stages(2)
    pipe = poptorch.pipeline(layers, gradient_accumulation_count=3, optimizer=sgd)
    assert isinstance(pipe, Pipeline)
    pipe(*data(12, WIDTH, CLASSES))
    pipe.destroy()
    assert not pipe.training_model.isCompiled()


def test_mnist_splits_functional_route_equals_the_annotated_route():
    # examples/mnist_splits.py --functional builds its stages through poptorch.pipeline.
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
    import mnist_splits

    results = []
    for functional in (False, True):
        args = mnist_splits.parser.parse_args(
            ["--splits", "dense128", "dense64", "--device-iterations", "2"]
            + (["--functional"] if functional else []))
        torch.manual_seed(args.seed)
        model = mnist_splits.MLP()
        optimizer = poptorch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        trainer = mnist_splits.training_model(args, model, optimizer)
        g = torch.Generator().manual_seed(0)
        calls = [(torch.randn(80, 1, 28, 28, generator=g), torch.randint(0, 10, (80,), generator=g))
                 for _ in range(2)]
        results.append(([trainer(x, y) for x, y in calls], model.state_dict()))
        trainer.destroy()
    (annotated, weights), (functional, tf1_weights) = results
    for (out_a, loss_a), (out_f, loss_f) in zip(annotated, functional):
        # Both return every micro-batch: the annotated model with OutputMode.All (the
        # example's, for its progress bar), the pipeline as its outfeed.
        assert out_a.shape == out_f.shape == (80, 10) and loss_a.shape == loss_f.shape == (10,)
        assert torch.equal(out_a, out_f) and torch.equal(loss_a, loss_f)
    assert weights.keys() == tf1_weights.keys()
    assert all(torch.equal(weights[k], tf1_weights[k]) for k in weights)


def test_docstring_examples_run():
    import doctest

    from poptorch_lite.frontends import tf1, tf1_feeds, tf1_stages
    for module in (tf1, tf1_feeds, tf1_stages):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


# -- the TF1 tutorial's own program shape (steps 3 and 4), translated to torch layers ---------
# The layers live in a global object the layer functions reach; the stage functions call the
# layer functions, and step 4's make_pipeline_stage closure builds the stages from the list
# discover_layers() finds in globals(). No stage holds a module directly.

class _Layers:
    def __init__(self):
        torch.manual_seed(3)
        self.dense256 = torch.nn.Linear(WIDTH, 16)
        self.dense128 = torch.nn.Linear(16, 12)
        self.dense32 = torch.nn.Linear(12, 8)
        self.logits = torch.nn.Linear(8, CLASSES)


MODEL = _Layers()


def layer1_flatten(learning_rate, images, labels):
    return learning_rate, images.flatten(1), labels


def layer2_dense256(learning_rate, activations, labels):
    return learning_rate, torch.relu(MODEL.dense256(activations)), labels


def layer3_dense128(learning_rate, activations, labels):
    return learning_rate, torch.relu(MODEL.dense128(activations)), labels


def layer5_dense32(learning_rate, activations, labels):
    return learning_rate, torch.relu(MODEL.dense32(activations)), labels


def layer6_logits(learning_rate, activations, labels):
    return learning_rate, MODEL.logits(activations), labels


def layer7_cel(learning_rate, logits, labels):
    return learning_rate, F.cross_entropy(logits, labels)


def optimizer_function(learning_rate, loss):
    return poptorch.OptimizerFunctionOutput(
        lambda params: torch.optim.SGD(params, lr=learning_rate), loss)


def discover_layers():
    """Step 4's discover_layers: the global functions named layer<idx>_<id>, by idx."""
    found = []
    for key, value in globals().items():
        if key.startswith("layer") and "_" in key and key[5:].split("_")[0].isdigit():
            idx, name = key[5:].split("_", 1)
            found.append({"func": value, "id": name, "idx": int(idx)})
    return sorted(found, key=lambda e: e["idx"])


def make_pipeline_stage(layers):
    def _stage(*args):
        for layer in layers:
            args = layer["func"](*args)
        return args
    return _stage


def plain_tutorial_model(model, x, y, lr, G, D):
    """Plain PyTorch: the same layers, SGD(lr), a step per G micro-batches (mean)."""
    params = [p for m in (model.dense256, model.dense128, model.dense32, model.logits)
              for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=lr)
    losses, b = [], len(x) // (G * D)
    for d in range(D):
        opt.zero_grad()
        for j in range(G):
            k = slice((d * G + j) * b, (d * G + j + 1) * b)
            h = torch.relu(model.dense128(torch.relu(model.dense256(x[k].flatten(1)))))
            loss = F.cross_entropy(model.logits(torch.relu(model.dense32(h))), y[k])
            loss.backward()
            losses.append(loss.detach())
        for p in params:
            p.grad.div_(G)
        opt.step()
    return torch.stack(losses)


@pytest.mark.parametrize("step", [3, 4])
def test_the_tf1_tutorials_stages_reach_their_layers_through_layer_functions(step):
    global MODEL
    MODEL = _Layers()
    plain = copy.deepcopy(MODEL)
    G, D, lr = 4, 2, 0.05
    if step == 3:
        def stage1(learning_rate, images, labels):
            r = layer1_flatten(learning_rate, images, labels)
            r = layer2_dense256(*r)
            return layer3_dense128(*r)

        def stage2(*r):
            r = layer5_dense32(*r)
            r = layer6_logits(*r)
            return layer7_cel(*r)
        computational_stages = [stage1, stage2]
    else:
        layers = discover_layers()
        assert [e["id"] for e in layers] == ["flatten", "dense256", "dense128", "dense32",
                                             "logits", "cel"]
        computational_stages = [make_pipeline_stage(layers[:3]), make_pipeline_stage(layers[3:])]
    x, y = data(5 * G * D, WIDTH, CLASSES)
    dataset = [(x[k:k + 5], y[k:k + 5]) for k in range(0, len(x), 5)]
    infeed = poptorch.IPUInfeedQueue(dataset)
    outfeed = poptorch.IPUOutfeedQueue()
    pipe = poptorch.pipeline(computational_stages=computational_stages,
                             gradient_accumulation_count=G, repeat_count=D,
                             inputs=[lr if step == 3 else torch.tensor(lr)],  # read as a number
                             infeed_queue=infeed, outfeed_queue=outfeed,
                             optimizer_function=optimizer_function,
                             pipeline_schedule=poptorch.PipelineSchedule.Grouped, name="Pipeline")
    assert pipe.name == "Pipeline" and pipe.training_model is not None  # built from the infeed
    assert [n for n, _ in pipe.model.named_children()] == [
        "stage0_0", "stage0_1", "stage1_0", "stage1_1"]
    result = pipe()  # the infeed gives the micro-batches; outfeed_loss is False, as in TF1
    learning_rates, losses = outfeed.dequeue()
    assert torch.equal(result[1], losses) and learning_rates == [pytest.approx(lr)]  # once
    expected = plain_tutorial_model(plain, x, y, lr, G, D)
    torch.testing.assert_close(losses, expected, atol=1e-6, rtol=0)
    for name in ("dense256", "dense128", "dense32", "logits"):
        for p, q in zip(getattr(MODEL, name).parameters(), getattr(plain, name).parameters()):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
    pipe.destroy()


class NormStage(torch.nn.Module):
    """A stage with running statistics and dropout: what a dry run must not disturb."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.drop = (torch.nn.Linear(WIDTH, WIDTH), torch.nn.BatchNorm1d(WIDTH),
                                       torch.nn.Dropout(0.5))

    def forward(self, x, labels):
        return self.drop(self.bn(self.fc(x))), labels


def test_the_dry_run_that_finds_a_function_stages_modules_changes_no_state():
    # The same stages as module stages (no dry run) and reached through functions (a dry
    # run at the first call): the same random stream, buffers, losses and weights, bit for bit.
    torch.manual_seed(0)
    modules = [NormStage(), Head()]
    reached = copy.deepcopy(modules)
    holder = {"layers": reached}

    def first(x, labels):
        return holder["layers"][0](x, labels)  # reached through a dict: found by running it

    def second(h, labels):
        return holder["layers"][1](h, labels)

    x, y = data(4 * 3 * 2, WIDTH, CLASSES)
    results = []
    for stage_list in ([*modules], [first, second]):
        torch.manual_seed(5)
        pipe = poptorch.pipeline(stage_list, gradient_accumulation_count=3, repeat_count=2,
                                 optimizer=sgd, outfeed_loss=True)
        results.append((pipe(x, y), torch.get_rng_state()))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    for a, b in zip(modules, reached):
        for (name, t), u in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(t, u), name


def test_an_infeed_continues_across_calls_and_starts_a_new_pass_at_its_end():
    tf1 = stages(2)
    plain = Plain(copy.deepcopy(tf1))
    x, y = data(4 * 3 * 3, WIDTH, CLASSES)  # 9 micro-batches: 3 calls of 3, then a new pass
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    pipe = poptorch.pipeline(tf1, gradient_accumulation_count=3, optimizer=sgd,
                             infeed_queue=poptorch.IPUInfeedQueue(loader), outfeed_loss=True)
    losses = torch.cat([pipe() for _ in range(4)])
    order = torch.cat([torch.arange(36), torch.arange(12)])
    _, ref, _ = reference_training(plain, sgd(plain.parameters()), x[order], y[order], 4, 3, 1)
    assert torch.equal(losses, torch.stack(ref))


def test_compile_makes_the_models_of_function_stages_before_the_first_call():
    tf1 = stages(2)
    twin = copy.deepcopy(tf1)
    x, y = data(4 * 3, WIDTH, CLASSES)
    results = []
    for layers, compile_first in ((tf1, True), (twin, False)):
        pipe = poptorch.pipeline([lambda a, b: layers[0](a, b), lambda a, b: layers[1](a, b)],
                                 gradient_accumulation_count=3, optimizer=sgd,
                                 outfeed_loss=True)
        assert pipe.training_model is None  # function stages: made at compile or first call
        if compile_first:
            pipe.compile(x, y)
            assert pipe.training_model.isCompiled()
        results.append(pipe(x, y))
    assert torch.equal(results[0], results[1])
    assert_same_weights(torch.nn.ModuleList(tf1), torch.nn.ModuleList(twin))
