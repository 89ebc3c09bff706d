"""The Keras face: fit, evaluate and predict give the PopTorch face's and plain PyTorch's numbers.

Every training here is run three times from the same initial weights: through
``keras.Model.fit``, through a hand-written loop over ``trainingModel`` with the
Options that [Note: Keras face] prescribes, and in plain PyTorch. The first two
run the same engine on the same micro-batches and agree bit for bit, always.
Plain PyTorch agrees bit for bit when every step is one batch (G × replicas = 1).
When a step sums several batches' gradients it agrees to 1e-6: the engine's
traced stage graphs can round the last bit of a summed gradient differently from
eager autograd (measured: at most 1 ulp, e.g. 4e-9 on a gradient, 6e-8 on the
weights after two epochs), and replicas add their own sums in another order.
"""

from __future__ import annotations

import copy
import doctest
import logging
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import poptorch_lite as poptorch
from poptorch_lite import keras
from poptorch_lite.frontends import keras as keras_model
from poptorch_lite.frontends import (dry_run, keras_callbacks, keras_data, keras_ipu, keras_losses,
                                     keras_stages)

from keras_models import (EPS, P, Step, _config, assert_same_weights, build, data, layers, orders,
                          plain, poptorch_loop, sgd, wrapper)


# B, steps_per_execution, G, replicas, stages, schedule, kind
MATRIX = [
    (2, 1, 1, 1, 1, P.Grouped, "sequential"),
    (4, 4, 1, 1, 1, P.Grouped, "model"),
    (3, 6, 2, 1, 1, P.Grouped, "sequential"),
    (2, 8, 2, 2, 1, P.Grouped, "sequential"),
    (2, 8, 4, 1, 2, P.Grouped, "sequential"),
    (3, 8, 4, 2, 2, P.Grouped, "model"),
    (2, 8, 4, 1, 2, P.Interleaved, "sequential"),
    (2, 8, 4, 2, 2, P.Interleaved, "functional"),
    (2, 8, 4, 1, 2, P.ZeroBubble, "functional"),
    (2, 6, 3, 1, 2, P.Sequential, "functional"),
    (2, 4, 2, 2, 2, P.Sequential, "sequential"),
]


@pytest.mark.parametrize("B,spe,G,R,S,schedule,kind", MATRIX)
def test_fit_equals_the_poptorch_face_and_plain_pytorch(B, spe, G, R, S, schedule, kind):
    n, epochs = B * spe * 2, 2
    x, y = data(n)
    model = build(kind, S, ipus=R * S if R > 1 else None)
    face_net, ref_net = copy.deepcopy(model.module), copy.deepcopy(model.module)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=G,
                                 pipeline_schedule=schedule)
    model.compile(sgd, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  ["accuracy"], steps_per_execution=spe)
    torch.manual_seed(7)
    history = model.fit(x, y, batch_size=B, epochs=epochs, verbose=0)
    assert wrapper(model, "train").options.replication_factor == R

    torch.manual_seed(7)
    order_list = orders(n, epochs, True)
    face_losses = poptorch_loop(face_net, x, y, B, spe, G, R, schedule, order_list)
    assert_same_weights(model.module, face_net)
    per_epoch = len(face_losses) // epochs
    assert history.history["loss"] == [sum(face_losses[e * per_epoch:(e + 1) * per_epoch])
                                       / per_epoch for e in range(epochs)]

    ref = plain(ref_net, x, y, B, G, R, order_list)
    assert_same_weights(model.module, ref_net, exact=G * R == 1)
    assert history.history["accuracy"] == ref["accuracy"]
    if G * R == 1:
        assert history.history["loss"] == ref["loss"]
    else:
        assert history.history["loss"] == pytest.approx(ref["loss"], abs=1e-6)
    assert history.epoch == [0, 1]


def test_recomputation_and_offloading_keep_the_numbers():
    B, spe, G = 2, 8, 4
    x, y = data(B * spe)
    model = build("sequential", 2)
    ref_net = copy.deepcopy(model.module)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=G,
                                 recomputation_mode=keras.RecomputationMode.Auto,
                                 offload_weight_update_variables=True)
    model.compile(sgd, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=spe)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", poptorch.IpuOnlyWarning)
        model.fit(x, y, batch_size=B, verbose=0, shuffle=False)
    opts = wrapper(model, "train").options
    assert opts.auto_recomputation == 3
    assert opts.TensorLocations.location_optimizer == {"onChip": 0}
    plain(ref_net, x, y, B, G, 1, orders(B * spe, 1, False))
    assert_same_weights(model.module, ref_net)


@pytest.mark.parametrize("S,R", [(1, 1), (2, 2)])
def test_evaluate_and_predict_equal_inference_calls(S, R):
    B, spe = 4, 4
    x, y = data(B * spe * 3)
    model = build("sequential", S, ipus=S * R)
    model.module.append(torch.nn.Dropout(0.5))  # evaluate and predict run in eval mode
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  ["accuracy"], steps_per_execution=spe)
    loss, acc = model.evaluate(x, y, batch_size=B, verbose=0)
    predictions = model.predict(x, batch_size=B)
    assert model.module.training  # the user's flag is left as it was

    net = copy.deepcopy(model.module).eval()
    opts = poptorch.Options().deviceIterations(spe // R).replicationFactor(R)
    opts.outputMode(poptorch.OutputMode.All).setExecutionStrategy(poptorch.PipelinedExecution())
    infer, infer_net = poptorch.inferenceModel(Step(net), opts), poptorch.inferenceModel(
        net, opts.clone())
    outs, losses = [], []
    for e in range(3):
        rows = slice(e * B * spe, (e + 1) * B * spe)
        out, l = infer(x[rows], y[rows])
        assert torch.equal(infer_net(x[rows]), out)
        outs.append(out)
        losses += l.tolist()
    out = torch.cat(outs)
    assert torch.equal(predictions, out)
    # plain PyTorch doing the same arithmetic: the network on each micro-batch of B rows
    assert torch.equal(predictions, torch.cat([net(x[k:k + B]).detach()
                                               for k in range(0, len(x), B)]))
    assert loss == sum(losses) / len(losses)
    assert acc == float((out.argmax(-1) == y).sum()) / len(y)
    assert model.evaluate(x, y, batch_size=B, verbose=0, return_dict=True) == {
        "loss": loss, "accuracy": acc}
    model.compile("sgd", "mse", steps_per_execution=spe)  # no metrics: the loss alone
    assert isinstance(model.evaluate(x, F.one_hot(y, 4).float(), batch_size=B, verbose=0), float)


def test_history_holds_loss_metrics_and_their_val_forms_per_epoch():
    x, y = data(64)
    xv, yv = data(32, seed=2)
    model = build("sequential", 1)
    model.compile(sgd, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  ["accuracy"], steps_per_execution=4)
    history = model.fit(x, y, batch_size=4, epochs=3, initial_epoch=1, verbose=0,
                        validation_data=(xv, yv))
    assert model.history is history
    assert history.epoch == [1, 2]
    assert sorted(history.history) == ["accuracy", "loss", "val_accuracy", "val_loss"]
    assert all(len(v) == 2 for v in history.history.values())
    loss, acc = model.evaluate(xv, yv, batch_size=4, verbose=0)
    assert history.history["val_loss"][-1] == loss
    assert history.history["val_accuracy"][-1] == acc


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __getattribute__(self, name):
        if name.startswith("on_") and name not in ("on_batch_begin", "on_batch_end"):
            def record(*args):
                self.calls.append((name, *(a for a in args[:1] if isinstance(a, int))))
                if name == "on_train_batch_end":
                    self.calls.append(("loss", args[1]["loss"]))
            return record
        return super().__getattribute__(name)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_batch_hooks_fire_per_execution_or_per_batch(asynchronous):
    B, spe = 2, 4
    x, y = data(B * 8)
    model = build("sequential", 1)
    model.compile(sgd, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=spe)
    model.set_asynchronous_callbacks(asynchronous)
    rec = Recorder()
    history = model.fit(x, y, batch_size=B, epochs=2, verbose=0, callbacks=[rec], shuffle=False)
    assert rec.model is model and rec.params == {"epochs": 2, "steps": 8, "verbose": 0}
    ends = [c for c in rec.calls if c[0] == "on_train_batch_end"]
    if asynchronous:
        batch_hooks = [h for k in range(8) for h in (("on_train_batch_begin", k),
                                                     ("on_train_batch_end", k))]
    else:
        batch_hooks = [("on_train_batch_begin", 0), ("on_train_batch_end", 3),
                       ("on_train_batch_begin", 4), ("on_train_batch_end", 7)]
    calls = [c for c in rec.calls if c[0] != "loss"]
    assert calls == [("on_train_begin",),
                     ("on_epoch_begin", 0), *batch_hooks, ("on_epoch_end", 0),
                     ("on_epoch_begin", 1), *batch_hooks, ("on_epoch_end", 1),
                     ("on_train_end",)]
    assert len(ends) == len(batch_hooks)
    last_loss = [c[1] for c in rec.calls if c[0] == "loss"][-1]
    assert last_loss == history.history["loss"][-1]  # the running mean at the epoch's end


def test_learning_rate_scheduler_sets_each_epochs_rate():
    B, spe = 2, 4
    x, y = data(B * spe)
    model = build("sequential", 1)
    ref_net = copy.deepcopy(model.module)
    model.compile(sgd, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  ["accuracy"], steps_per_execution=spe)
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 / (epoch + 1))
    history = model.fit(x, y, batch_size=B, epochs=3, verbose=0, callbacks=[schedule],
                        shuffle=False)
    assert history.history["lr"] == [0.1, 0.05, 0.1 / 3]
    ref = plain(ref_net, x, y, B, 1, 1, orders(B * spe, 3, False), lambda e: 0.1 / (e + 1))
    assert history.history["loss"] == ref["loss"]
    assert_same_weights(model.module, ref_net)
    one_arg = keras.callbacks.LearningRateScheduler(lambda epoch: 0.01)
    model.fit(x, y, batch_size=B, epochs=1, verbose=0, callbacks=[one_arg])
    assert model.optimizer.param_groups[0]["lr"] == 0.01


def test_recompiling_with_another_steps_per_execution_keeps_weights_and_optimizer_state():
    B = 2
    x, y = data(B * 8)
    model = build("sequential", 1)
    ref_net = copy.deepcopy(model.module)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = sgd(model.module.parameters())
    model.compile(opt, loss, steps_per_execution=2)
    model.fit(x, y, batch_size=B, verbose=0, shuffle=False)
    first = wrapper(model, "train")
    model.compile(opt, loss, steps_per_execution=8)
    assert not first.isCompiled()  # destroyed; the next fit wraps again
    assert model.optimizer is opt and len(opt.state) > 0
    model.evaluate(x, y, batch_size=B, verbose=0)
    model.fit(x, y, batch_size=B, verbose=0, shuffle=False)
    assert wrapper(model, "train").options.device_iterations == 8
    plain(ref_net, x, y, B, 1, 1, orders(B * 8, 2, False))
    assert_same_weights(model.module, ref_net)

    by_name = build("sequential", 1)
    by_name.compile("adam", loss, steps_per_execution=2)
    adam = by_name.optimizer
    by_name.fit(x, y, batch_size=B, verbose=0)
    by_name.compile("adam", loss, steps_per_execution=4)  # the same name keeps the optimizer
    assert by_name.optimizer is adam and len(adam.state) > 0
    by_name.compile("sgd", loss, steps_per_execution=4)
    assert isinstance(by_name.optimizer, poptorch.optim.SGD)


def test_keras_optimizer_names_have_keras_defaults():
    model = build("sequential", 1)
    model.compile("sgd", "mse")
    assert isinstance(model.optimizer, poptorch.optim.SGD)
    assert (model.optimizer.defaults["lr"], model.optimizer.defaults["momentum"]) == (0.01, 0)
    model.compile("adam", "mse")
    d = model.optimizer.defaults
    assert isinstance(model.optimizer, poptorch.optim.Adam)
    assert (d["lr"], d["betas"], d["eps"]) == (0.001, (0.9, 0.999), 1e-7)
    model.compile("RMSprop", "mse")
    d = model.optimizer.defaults
    assert isinstance(model.optimizer, poptorch.optim.RMSprop)
    assert (d["lr"], d["alpha"], d["eps"], d["momentum"]) == (0.001, 0.9, 1e-7, 0)
    model.compile(keras.optimizers.SGD(learning_rate=0.5, momentum=0.9), "mse")
    assert (model.optimizer.defaults["lr"], model.optimizer.defaults["momentum"]) == (0.5, 0.9)


def _probabilities(n=8, k=4, seed=3):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(n, k, generator=g) * 4, -1)
    p[0, 1] = 0.0  # a zero probability: clipped to eps, not log(0)
    return p, torch.randint(0, k, (n,), generator=g)


def test_keras_name_losses_equal_keras_formulas():
    """Keras 3's formulas (its torch backend), written out independently here."""
    p, labels = _probabilities()
    onehot = F.one_hot(labels, 4).float()
    keras_log_p = torch.log(torch.clip(p / p.sum(-1, keepdim=True), EPS, 1 - EPS))
    cases = {
        "sparse_categorical_crossentropy": (labels, p, -(onehot * keras_log_p).sum(-1)),
        "categorical_crossentropy": (onehot, p, -(onehot * keras_log_p).sum(-1)),
        "binary_crossentropy": (onehot, p, -(onehot * torch.log(torch.clip(p, EPS, 1 - EPS)) + (
            1 - onehot) * torch.log(1 - torch.clip(p, EPS, 1 - EPS))).mean(-1)),
        "mse": (onehot, p, ((p - onehot) ** 2).mean(-1)),
        "mae": (onehot, p, (p - onehot).abs().mean(-1)),
    }
    for name, (y_true, y_pred, per_sample) in cases.items():
        fn = keras_losses.resolve_loss(name)
        torch.testing.assert_close(fn(y_pred, y_true), per_sample.mean(), atol=0, rtol=0,
                                   msg=name)
    logits = torch.log(p + 0.1)
    from_logits = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(labels, logits)
    assert torch.equal(from_logits, -(onehot * F.log_softmax(logits, -1)).sum(-1).mean())
    # torch's fused loss is the same value, summed in another order: to 1e-6
    torch.testing.assert_close(from_logits, F.cross_entropy(logits, labels), atol=1e-6, rtol=0)
    bce = keras.losses.BinaryCrossentropy(from_logits=True)(onehot, logits)
    assert torch.equal(bce, F.binary_cross_entropy_with_logits(
        logits, onehot, reduction="none").mean(-1).mean())
    # Keras 3 renormalises p before clipping; for a softmax that is nll of the clipped log
    soft = torch.softmax(torch.log(p + 0.1), -1)
    torch.testing.assert_close(keras_losses.resolve_loss("sparse_categorical_crossentropy")(
        soft, labels), F.nll_loss(torch.log(soft.clamp(EPS, 1 - EPS)), labels), atol=1e-6, rtol=0)
    # a (n, 1) label column is the same as (n,)
    assert torch.equal(keras_losses.sparse_categorical_crossentropy(labels[:, None], p),
                       keras_losses.sparse_categorical_crossentropy(labels, p))


def test_accuracy_picks_the_sparse_categorical_or_binary_form():
    p, labels = _probabilities()
    sparse = (p.argmax(-1) == labels).float()
    assert torch.equal(keras_losses.accuracy(labels, p), sparse)
    assert torch.equal(keras_losses.accuracy(labels[:, None], p), sparse)
    assert torch.equal(keras_losses.accuracy(F.one_hot(labels, 4).float(), p), sparse)
    col = p[:, :1]
    binary = ((col > 0.5).float() == (labels[:, None] % 2).float()).float().mean(-1)
    assert torch.equal(keras_losses.accuracy((labels[:, None] % 2).float(), col), binary)


def test_numpy_arrays_datasets_and_dataloaders_train_as_tensors_do():
    B, spe = 2, 4
    x, y = data(B * spe * 2)
    results = []
    for inputs in [(x, y), (x.numpy().astype(np.float64), y.numpy()),
                   (torch.utils.data.TensorDataset(x, y), None),
                   (torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                                batch_size=B), None)]:
        model = build("sequential", 1)
        model.compile(sgd, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=spe)
        model.fit(*inputs, batch_size=B, verbose=0, shuffle=False)
        results.append(model.module)
    for other in results[1:]:
        assert_same_weights(results[0], other)


def test_drop_remainder_drops_the_rest_with_one_warning():
    x, y = data(21)
    model = build("sequential", 1)
    model.compile(sgd, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=4, epochs=2, verbose=0, drop_remainder=True,
                  steps_per_epoch=4)
    ours = [w for w in caught if issubclass(w.category, poptorch.PoptorchLiteWarning)]
    assert [str(w.message) for w in ours] == [
        "fit: drop_remainder=True drops 1 of the 21 samples (not a multiple of batch_size x "
        "replicas = 4)"]


def test_the_steps_per_execution_hint_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(keras_model, "_HINTED", set())
    model = build("sequential", 1)
    with caplog.at_level(logging.WARNING, logger="poptorch_lite"):
        model.compile("sgd", "mse")
        model.compile("sgd", "mse", steps_per_execution=2)
        model.compile("sgd", "mse")
    assert [r.getMessage() for r in caplog.records] == [
        "steps_per_execution is 1: every batch is an execution of its own, with a round trip "
        "to the host; compile(..., steps_per_execution=N) runs N batches per execution and is "
        "faster"]


def test_ipu_strategy_gives_ipus_over_stages_replicas():
    with keras.IPUStrategy(_config(8)).scope():
        model = keras.Sequential(layers())
    model.set_pipeline_stage_assignment([0, 0, 1, 1, 1])
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    model.compile("sgd", "mse", steps_per_execution=16)
    x = torch.randn(64, 6)
    model.fit(x, torch.zeros(64, 4), batch_size=2, verbose=0)
    assert wrapper(model, "train").options.replication_factor == 4
    assert model.predict(x, batch_size=2).shape == (64, 4)
    assert wrapper(model, "predict").options.device_iterations == 4  # 16 / 4 replicas
    outside = keras.Sequential(layers())
    assert outside._ipu.ipus is None
    with keras.IPUStrategy(keras.IPUConfig(auto_select_ipus=6)).scope():
        assert keras.Sequential(layers())._ipu.ipus == 6
    with pytest.raises(poptorch.OptionsError, match="IPUConfig.auto_select_ipus must be a "
                                                    "positive int, got 0"):
        keras.IPUStrategy(keras.IPUConfig(0))


def test_summary_and_stage_assignment_summary(capsys):
    model = build("model", 2)
    model.summary()
    model.print_pipeline_stage_assignment_summary()
    assert capsys.readouterr().out.splitlines() == [
        'Model: "Sequential"',
        "layer | type   | parameters",
        "------+--------+-----------",
        "0     | Linear | 56",
        "1     | ReLU   | 0",
        "2     | Linear | 72",
        "3     | ReLU   | 0",
        "4     | Linear | 36",
        "Total params: 164",
        "Trainable params: 164",
        "Non-trainable params: 0",
        "layer | type   | stage | parameters",
        "------+--------+-------+-----------",
        "0     | Linear | 0     | 56",
        "1     | ReLU   | 0     | 0",
        "2     | Linear | 1     | 72",
        "3     | ReLU   | 1     | 0",
        "4     | Linear | 1     | 36",
    ]


# -- refusals: each before any state changes -----------------------------------------------

def compiled(spe=4, G=1, schedule=P.Grouped, stages=1, ipus=None):
    model = build("sequential", stages, ipus=ipus)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=G,
                                 pipeline_schedule=schedule)
    model.compile("sgd", "sparse_categorical_crossentropy", steps_per_execution=spe)
    return model


REFUSALS = {
    "not a multiple of batch_size x replicas": (
        lambda: compiled(), lambda m: m.fit(*data(30), batch_size=4, verbose=0),
        poptorch.BatchSizeError,
        "fit: the data set has 30 samples, not a multiple of batch_size (4) x replicas (1) = 4; "
        "trim it as the tutorial's make_divisible does (x = x[:28], y = y[:28]), or pass "
        "drop_remainder=True to drop the last 2"),
    "batches not a multiple of steps_per_execution": (
        lambda: compiled(spe=4), lambda m: m.fit(*data(24), batch_size=4, verbose=0),
        poptorch.BatchSizeError,
        "fit: 6 batches per epoch is not a multiple of steps_per_execution (4); pass "
        "steps_per_epoch=4, trim the data set to a multiple of batch_size x steps_per_execution "
        "= 16 samples, or compile with a steps_per_execution that divides 6"),
    "steps_per_epoch beyond the data": (
        lambda: compiled(spe=4), lambda m: m.fit(*data(32), batch_size=4, steps_per_epoch=12,
                                                 verbose=0),
        poptorch.BatchSizeError,
        "fit: steps_per_epoch=12 asks for more batches than the 8 of batch_size 4 the data set "
        "holds; pass steps_per_epoch=8 or less"),
    "steps_per_execution not a multiple of G x replicas": (
        lambda: compiled(spe=6, G=4), lambda m: m.fit(*data(48), batch_size=2, verbose=0),
        poptorch.OptionsError,
        "steps_per_execution (6) must be a multiple of gradient_accumulation_steps_per_replica "
        "(4) x replicas (1) = 4: compile(..., steps_per_execution=8)"),
    "Grouped needs G a multiple of 2 x stages": (
        lambda: compiled(spe=6, G=6, stages=2), lambda m: m.fit(*data(24), batch_size=2,
                                                                verbose=0),
        poptorch.PipelineError,
        "the Grouped pipeline schedule needs gradient_accumulation_steps_per_replica to be a "
        "multiple of 2 x stages = 4, got 6: call set_pipelining_options("
        "gradient_accumulation_steps_per_replica=8)"),
    "Interleaved needs G a multiple of stages": (
        lambda: compiled(spe=6, G=3, schedule=P.Interleaved, stages=2),
        lambda m: m.fit(*data(24), batch_size=2, verbose=0),
        poptorch.PipelineError,
        "the Interleaved pipeline schedule needs gradient_accumulation_steps_per_replica to be a "
        "multiple of the 2 stages and at least 2 x stages - 1 = 3, got 3: call "
        "set_pipelining_options(gradient_accumulation_steps_per_replica=4)"),
    "auto_select_ipus a multiple of stages": (
        lambda: compiled(spe=8, G=4, stages=2, ipus=3),
        lambda m: m.fit(*data(32), batch_size=2, verbose=0),
        poptorch.OptionsError,
        "auto_select_ipus (3) must be a multiple of the model's 2 pipeline stages: select 2 or "
        "another multiple of 2 IPUs (each replica of the pipeline takes 2)"),
    "fit before compile": (
        lambda: build("sequential", 1), lambda m: m.fit(*data(32), verbose=0),
        poptorch.WrapError,
        "You must compile your model with a loss before training/testing: call "
        "model.compile(optimizer, loss=...)"),
    "x and y lengths differ": (
        lambda: compiled(), lambda m: m.fit(data(32)[0], data(16)[1], verbose=0),
        poptorch.InputError,
        "fit: x has 32 samples but y has 16; give one target per sample"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_name_the_values_and_change_nothing(case):
    make, call, cls, message = REFUSALS[case]
    model = make()
    before = copy.deepcopy(model.module.state_dict())
    state = (model._ipu, model._spe, dict(model._wrappers), model.optimizer, model.history)
    rng = torch.get_rng_state()
    with pytest.raises(cls) as info:
        call(model)
    assert str(info.value) == message
    assert all(torch.equal(v, before[k]) for k, v in model.module.state_dict().items())
    assert state == (model._ipu, model._spe, dict(model._wrappers), model.optimizer,
                     model.history)
    assert torch.equal(torch.get_rng_state(), rng)


def test_invalid_compile_and_options_change_nothing():
    model = compiled(spe=4)
    opt, ipu = model.optimizer, model._ipu
    for bad in [lambda: model.compile("nadam", "mse"), lambda: model.compile("sgd", "hinge"),
                lambda: model.compile("sgd", "mse", ["f1"]),
                lambda: model.compile("sgd", "mse", steps_per_execution=0),
                lambda: model.set_pipelining_options(pipeline_schedule="gpipe"),
                lambda: model.set_pipelining_options(recomputation_mode="yes"),
                lambda: model.set_gradient_accumulation_options(0)]:
        with pytest.raises(poptorch.Error):
            bad()
        assert (model.optimizer, model._ipu, model._spe) == (opt, ipu, 4)


def test_doctests_of_the_keras_modules():
    for module in (keras_model, keras_ipu, keras_losses, keras_callbacks, keras_data,
                   keras_stages, dry_run):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, module.__name__


def test_a_dataloader_that_drops_its_last_batch_and_adding_a_layer():
    x, y = data(21)
    model = build("sequential", 1)
    model.compile(sgd, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=5)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4,
                                         drop_last=True)
    assert model.fit(loader, verbose=0).history["loss"]  # 5 whole batches, no refusal
    model.add(torch.nn.Softmax(-1))
    with pytest.raises(poptorch.WrapError):  # the optimizer does not know the new parameters
        model.fit(loader, verbose=0)
