"""The Keras tutorials' programs, line by line on torch layers, against plain PyTorch (issue 21).

Each test writes a tutorial's code shape (Keras on IPU, the Keras-with-IPUs guide, TF2
MNIST) with torch layers and compares what ``fit`` / ``evaluate`` / ``predict`` leave
with plain PyTorch doing the same arithmetic.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import poptorch_lite as poptorch
from poptorch_lite import keras
from poptorch_lite.frontends import keras_ipu, keras_losses


@pytest.fixture(autouse=True)
def no_configured_system():
    keras_ipu.reset_ipu_system()
    yield
    keras_ipu.reset_ipu_system()


def layers(seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU(),
            torch.nn.Linear(8, 4)]


def data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def per_sample(out, y):
    return keras_losses.sparse_categorical_crossentropy(y, out, from_logits=True)


def plain_fit(net, batches, per_step, weights=None):
    """Plain PyTorch: a step per ``per_step`` batches (gradients summed, then / per_step)."""
    opt = sgd(net.parameters())
    losses = []
    for s in range(0, len(batches), per_step):
        opt.zero_grad()
        for k in range(s, s + per_step):
            x, y = batches[k]
            loss = per_sample(net(x), y)
            loss = (loss * weights[k]).mean() if weights is not None else loss.mean()
            loss.backward()
            losses.append(float(loss.detach()))
        for p in net.parameters():
            p.grad.div_(per_step)
        opt.step()
    return losses


def assert_same(a, b, atol=1e-6):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=atol, rtol=0)


def split(x, y, b):
    return [(x[k:k + b], y[k:k + b]) for k in range(0, len(x), b)]


# -- 1. configure_ipu_system() is the process's system; IPUStrategy() uses it -------------------

def test_ipu_strategy_without_an_argument_uses_the_configured_system():
    # The tutorials: config = IPUConfig(); config.auto_select_ipus = 2;
    # config.configure_ipu_system(); strategy = IPUStrategy(); with strategy.scope(): ...
    config = keras.IPUConfig()
    config.auto_select_ipus = 2
    config.configure_ipu_system()
    config.auto_select_ipus = 8  # a snapshot: the system keeps 2
    strategy = keras.IPUStrategy()
    with strategy.scope():
        model = keras.Sequential(layers())
        ref = copy.deepcopy(model.module)
        model.compile(sgd, LOSS, steps_per_execution=4)
        x, y = data(16)
        model.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    (train,) = model._wrappers.values()
    assert train.options.replication_factor == 2  # 2 IPUs / 1 stage
    plain_fit(ref, split(x, y, 2), per_step=2)  # a step: one batch on each of 2 replicas
    assert_same(model.module, ref)

    with keras.IPUStrategy().scope():  # a 2-stage pipeline on the 2 IPUs: one replica
        piped = keras.Sequential(layers())
    piped.set_pipeline_stage_assignment([0, 0, 1, 1, 1])
    piped.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    ref = copy.deepcopy(piped.module)
    piped.compile(sgd, LOSS, steps_per_execution=4)
    piped.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    assert next(iter(piped._wrappers.values())).options.replication_factor == 1
    plain_fit(ref, split(x, y, 2), per_step=4)
    assert_same(piped.module, ref)


def test_without_a_configured_system_a_strategy_takes_one_ipu_per_stage():
    with keras.IPUStrategy().scope():
        assert keras.Sequential(layers())._ipu.ipus is None


# -- 2. steps_per_execution beyond the data is truncated, with a warning ----------------------

def test_steps_per_execution_larger_than_the_data_is_truncated_as_keras_does():
    # The tutorial compiles for fit with steps_per_execution and evaluates a smaller test set.
    model = keras.Sequential(layers())
    model.compile(sgd, LOSS, ["accuracy"], steps_per_execution=8)
    x, y = data(32)
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    x_test, y_test = data(12, seed=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, accuracy = model.evaluate(x_test, y_test, batch_size=4, verbose=0)
    assert [str(w.message) for w in caught if w.category is poptorch.PoptorchLiteWarning] == [
        "evaluate: steps_per_execution (8) is larger than the 3 steps of this pass over the "
        "data; truncating it to 3 for this call, as Keras does"]
    with torch.no_grad():
        out = [model.module(x_test[k:k + 4]) for k in range(0, 12, 4)]
        expected = sum(float(per_sample(o, y_test[k * 4:k * 4 + 4]).mean())
                       for k, o in enumerate(out)) / 3
    assert loss == pytest.approx(expected, abs=1e-6)
    assert accuracy == pytest.approx(float((torch.cat(out).argmax(-1) == y_test).double().mean()))
    assert model._spe == 8  # the compiled value stays for the next fit
    with pytest.warns(poptorch.PoptorchLiteWarning, match="predict: steps_per_execution"):
        assert model.predict(x_test, batch_size=4).shape == (12, 4)


# -- 4. one reading of steps_per_execution: steps of all replicas together --------------------

class Steps(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(batch)


def test_steps_count_every_replicas_batches_everywhere():
    # batch 2 per replica, 2 replicas, steps_per_execution 4: an execution is 4 steps of 2
    # samples (2 on each replica), 8 samples; an epoch of 32 samples is 16 steps.
    with keras.IPUStrategy(keras.IPUConfig(2)).scope():
        model = keras.Sequential(layers())
    ref = copy.deepcopy(model.module)
    model.compile(sgd, LOSS, steps_per_execution=4)
    cb = Steps()
    x, y = data(32)
    model.fit(x, y, batch_size=2, shuffle=False, verbose=0, callbacks=[cb])
    (train,) = model._wrappers.values()
    assert cb.params["steps"] == 16
    assert cb.ends == [3, 7, 11, 15]  # the last step of each execution
    assert poptorch.combined_batch_size(train.options, 2) == 4 * 2  # spe x batch_size
    plain_fit(ref, split(x, y, 2), per_step=2)
    assert_same(model.module, ref)


# -- 5. stage-assignment tooling ---------------------------------------------------------------

class OutOfOrder(torch.nn.Module):
    """A functional model whose layers are declared in another order than they run."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(8, 4)  # declared first, runs last
        self.body = torch.nn.Linear(6, 8)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def test_a_functional_models_assignment_follows_the_order_its_layers_run():
    model = keras.Model(OutOfOrder())
    ref = copy.deepcopy(model.module)
    x, y = data(32)
    with pytest.raises(poptorch.InputError, match="call the model once on a batch"):
        model.get_pipeline_stage_assignment()
    model(x[:4])  # one call: the order is known (no state changes)
    assignment = model.get_pipeline_stage_assignment()
    assert [(a.layer, a.pipeline_stage) for a in assignment] == [
        (model.module.body, None), (model.module.head, None)]
    for a, stage in zip(assignment, [0, 1]):
        a.pipeline_stage = stage
    model.set_pipeline_stage_assignment(assignment)
    assert [a.pipeline_stage for a in model.get_pipeline_stage_assignment()] == [0, 1]
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    model.compile(sgd, LOSS, steps_per_execution=4)
    model.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    assert model._stages == 2
    plain_fit(ref, split(x, y, 2), per_step=4)
    assert_same(model.module, ref)


def test_an_assignment_before_any_batch_is_applied_in_call_order():
    model = keras.Model(OutOfOrder())
    ref = copy.deepcopy(model.module)
    model.set_pipeline_stage_assignment([0, 1])  # body, head: the order they run
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    model.compile(sgd, LOSS, steps_per_execution=4)
    x, y = data(16)
    model.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    assert model._stages == 2
    plain_fit(ref, split(x, y, 2), per_step=4)
    assert_same(model.module, ref)


class OutOfOrderNorm(torch.nn.Module):
    """Declared head first, with running statistics the order-finding run must not touch."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(8, 4)
        self.norm = torch.nn.BatchNorm1d(8)
        self.body = torch.nn.Linear(6, 8)

    def forward(self, x):
        return self.head(self.norm(torch.relu(self.body(x))))


def test_finding_the_call_order_changes_no_buffer_and_no_random_state():
    model = keras.Model(OutOfOrderNorm())
    ref = copy.deepcopy(model.module)
    x, y = data(16)
    rng = torch.get_rng_state()
    model(x[:4])
    ref(x[:4])  # the user's own call runs, as in Keras
    assert [a.layer for a in model.get_pipeline_stage_assignment()] == [
        model.module.body, model.module.norm, model.module.head]
    assert torch.equal(torch.get_rng_state(), rng)
    model.set_pipeline_stage_assignment([0, 1, 1])
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    model.compile(sgd, LOSS, steps_per_execution=4)
    model.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    plain_fit(ref, split(x, y, 2), per_step=4)
    for (name, t), u in zip(model.module.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(t, u, atol=1e-6, rtol=0, msg=name)


class Staged(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        with keras.PipelineStage(0):
            x = torch.relu(self.a(x))
        with keras.PipelineStage(1):
            return self.b(x)


def test_the_summary_of_a_pipeline_stage_model_prints_its_stages():
    model = keras.Model(Staged())
    model.compile(sgd, LOSS, steps_per_execution=4)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    model.fit(*data(16), batch_size=2, verbose=0)
    lines = []
    model.print_pipeline_stage_assignment_summary(print_fn=lines.append)
    assert lines == ["layer | type   | stage | parameters",
                     "------+--------+-------+-----------",
                     "a     | Linear | 0     | 56",
                     "b     | Linear | 1     | 36"]
    assert [a.pipeline_stage for a in model.get_pipeline_stage_assignment()] == [0, 1]


def test_sequential_assignment_objects_and_reset():
    model = keras.Sequential(layers())
    assert [a.pipeline_stage for a in model.get_pipeline_stage_assignment()] == [None] * 5
    model.set_pipeline_stage_assignment([0, 0, 1, 1, 1])
    got = model.get_pipeline_stage_assignment()
    assert [a.layer for a in got] == list(model.module) and \
        [a.pipeline_stage for a in got] == [0, 0, 1, 1, 1]
    model.reset_pipeline_stage_assignment()
    model.compile(sgd, LOSS, steps_per_execution=2)
    model.fit(*data(8), batch_size=2, verbose=0)
    assert model._stages == 1


# -- 6. data: streams ---------------------------------------------------------------------------

class Repeat(torch.utils.data.IterableDataset):
    """A dataset.repeat(): the samples again and again, no length."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        while True:
            yield from zip(self.x, self.y)


def test_an_infinite_iterable_dataset_with_steps_per_epoch():
    model = keras.Sequential(layers())
    ref = copy.deepcopy(model.module)
    model.compile(sgd, LOSS, steps_per_execution=3)
    x, y = data(10)
    with pytest.raises(poptorch.BatchSizeError, match="pass steps_per_epoch=N"):
        model.fit(Repeat(x, y), batch_size=2, verbose=0)
    model.fit(Repeat(x, y), batch_size=2, epochs=2, steps_per_epoch=6, verbose=0)
    order = torch.arange(24) % 10  # 2 epochs x 6 steps x 2 samples, continuing
    plain_fit(ref, split(x[order], y[order], 2), per_step=1)
    assert_same(model.module, ref)


def test_a_finite_loader_continues_across_epochs_with_steps_per_epoch():
    # TF's iterator continues from one epoch to the next; at its end a new pass starts.
    model = keras.Sequential(layers())
    ref = copy.deepcopy(model.module)
    model.compile(sgd, LOSS, steps_per_execution=2)
    x, y = data(12)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2)
    model.fit(loader, epochs=3, steps_per_epoch=4, verbose=0)  # 12 steps over 6 batches
    order = torch.cat([torch.arange(12), torch.arange(12)])
    plain_fit(ref, split(x[order], y[order], 2), per_step=1)
    assert_same(model.module, ref)


def test_fit_with_an_asynchronous_data_accessor_equals_tensors():
    x, y = data(16)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2)
    models = []
    for inputs in [(x, y), (poptorch.AsynchronousDataAccessor(loader), None)]:
        model = keras.Sequential(layers())
        model.compile(sgd, LOSS, steps_per_execution=4)
        model.fit(*inputs, batch_size=2, epochs=2, shuffle=False, verbose=0)
        models.append(model.module)
    inputs[0].terminate()
    assert_same(models[0], models[1], atol=0)


# -- 7. the porting table's IPU-only keywords --------------------------------------------------

def test_the_porting_tables_keywords_are_accepted_with_one_warning_each():
    model = keras.Sequential(layers())
    names = sorted(keras_ipu.IPU_ONLY_KEYWORDS)
    ref = copy.deepcopy(model.module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.set_pipelining_options(**{n: 1 for n in names})
        model.set_gradient_accumulation_options(replicated_optimizer_state_sharding=True)
    ours = [str(w.message) for w in caught if w.category is poptorch.IpuOnlyWarning]
    assert ours == [f"set_pipelining_options({n}=...) only tunes IPU memory or Poplar and has "
                    f"no effect in poptorch_lite; ignored" for n in names]  # once each
    with pytest.raises(poptorch.OptionsError, match="unknown keyword 'offload_everything'"):
        model.set_pipelining_options(offload_everything=True)
    model.compile(sgd, LOSS, steps_per_execution=2)
    x, y = data(8)
    model.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    plain_fit(ref, split(x, y, 2), per_step=1)
    assert_same(model.module, ref)


# -- 8. the smaller points ----------------------------------------------------------------------

def test_sample_weight_weights_each_samples_loss_as_keras():
    model = keras.Sequential(layers())
    ref = copy.deepcopy(model.module)
    model.compile(sgd, "sparse_categorical_crossentropy", steps_per_execution=2)
    model.module.append(torch.nn.Softmax(-1))
    ref.append(torch.nn.Softmax(-1))
    x, y = data(8)
    w = torch.linspace(0.0, 2.0, 8)
    model.fit(x, y, batch_size=2, shuffle=False, verbose=0, sample_weight=w)
    opt = sgd(ref.parameters())
    for k in range(0, 8, 2):
        opt.zero_grad()
        loss = (keras_losses.sparse_categorical_crossentropy(y[k:k + 2], ref(x[k:k + 2])) *
                w[k:k + 2]).sum() / 2
        loss.backward()
        opt.step()
    assert_same(model.module, ref)


def test_compile_takes_keras_positional_order_and_loss_weights():
    model = keras.Sequential(layers())
    ref = copy.deepcopy(model.module)
    model.compile(sgd, LOSS, None, [0.5], steps_per_execution=2)  # 4th: loss_weights
    x, y = data(8)
    model.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    opt = sgd(ref.parameters())
    for k in range(0, 8, 2):
        opt.zero_grad()
        (0.5 * per_sample(ref(x[k:k + 2]), y[k:k + 2]).mean()).backward()
        opt.step()
    assert_same(model.module, ref)
    with pytest.raises(poptorch.OptionsError, match="weighted_metrics"):
        model.compile(sgd, LOSS, weighted_metrics=["accuracy"])


def test_recomputation_mode_names_and_the_ipu_config_attributes():
    model = keras.Sequential(layers())
    model.set_pipelining_options(recomputation_mode="RecomputeAndBackpropagateInterleaved")
    assert model._ipu.recompute is keras.RecomputationMode.RecomputeAndBackpropagateInterleaved
    model.set_pipelining_options(recomputation_mode="auto")
    assert model._ipu.recompute is keras.RecomputationMode.Auto
    config = keras.IPUConfig()
    config.selection_order = "SNAKE"
    config.device_connection.type = "ON_DEMAND"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config.configure_ipu_system()
    assert {str(w.message) for w in caught if w.category is poptorch.IpuOnlyWarning} == {
        "IPUConfig.selection_order is IPU-only (the order of physical IPUs); ignored",
        "IPUConfig.device_connection is IPU-only (when to attach to the IPUs); ignored"}


def test_truncation_keeps_a_multiple_of_accumulation_times_replicas():
    with keras.IPUStrategy(keras.IPUConfig(2)).scope():
        model = keras.Sequential(layers())
    ref = copy.deepcopy(model.module)
    model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=2)
    model.compile(sgd, LOSS, steps_per_execution=16)
    x, y = data(24)  # 12 steps of 2: truncated to 12, a multiple of G x replicas = 4
    with pytest.warns(poptorch.PoptorchLiteWarning, match="truncating it to 12 for this call"):
        model.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    plain_fit(ref, split(x, y, 2), per_step=4)
    assert_same(model.module, ref)
    # 10 steps: truncated to 8, a multiple of 4, and the refusal says what runs
    with pytest.warns(poptorch.PoptorchLiteWarning, match="truncating it to 8"), \
            pytest.raises(poptorch.BatchSizeError, match="pass steps_per_epoch=8"):
        model.fit(*data(20), batch_size=2, verbose=0)
