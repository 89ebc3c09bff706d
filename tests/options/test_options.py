"""Options, execution strategies and enums: values, validation, freezing, files."""

import ast
import doctest
import pathlib
import warnings

import pytest
import torch

from poptorch_lite import errors
from poptorch_lite.options import (device as device_options, ipu as ipu_options,
                                   groups as option_groups, options, base as options_base,
                                   config as options_config)
from poptorch_lite import enums, phases, strategies
from poptorch_lite.enums import (AnchorMode, AutoStage, CommGroupType, ConnectionType, Liveness,
                                 OutputMode, PipelineSchedule, ReductionType, SyncPattern)
from poptorch_lite.options.ipu import TensorLocationSettings
from poptorch_lite.options.device import IpuDeviceMap
from poptorch_lite.options.options import Options, batch_factor, combined_batch_size
from poptorch_lite.phases import ParallelPhasedExecution, Phase, SerialPhasedExecution
from poptorch_lite.strategies import ExecutionStrategy, PipelinedExecution, ShardedExecution, Stage

PACKAGE = pathlib.Path(enums.__file__).parent


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    """Fresh warn-once record, torch RNG state kept, no environment that Options reads."""
    for var in ("POPTORCH_DEFAULT_OPTIONS", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    errors._warned.clear()
    rng = torch.get_rng_state()  # randomSeed() seeds torch; leave other tests unaffected
    yield
    torch.set_rng_state(rng)
    errors._warned.clear()


# -- defaults, chaining, read-back -------------------------------------------------


def test_defaults():
    o = Options()
    assert (o.device_iterations, o.replication_factor, o.input_group_size) == (1, 1, 1)
    assert o.input_group_type is CommGroupType.Consecutive
    assert o.Training.gradient_accumulation == 1
    assert o.Training.reduction_type is ReductionType.Mean
    assert o.Training.accumulation_and_replication_reduction_type is ReductionType.Mean
    assert o.output_mode is OutputMode.Default and o.defaultOutputMode()
    assert o.output_return_period == 1
    assert o.random_seed is None
    assert o.auto_round_num_ipus is False
    assert o.broadcast_buffers is True
    assert o.auto_recomputation == 0
    assert (o.Distributed.processId, o.Distributed.numProcesses) == (0, 1)
    assert o.ipu_devices is None
    assert o.connection_type is ConnectionType.Always
    assert o.is_frozen is False
    s = o.execution_strategy
    assert type(s) is PipelinedExecution
    assert (s.stages, s.auto_stage, s.schedule, s.pipelined) == (
        [], AutoStage.SameAsIpu, PipelineSchedule.Grouped, True)
    assert Options().execution_strategy is not s  # one strategy per Options


@pytest.mark.parametrize("call, read, expected", [
    (lambda o: o.deviceIterations(20), lambda o: o.device_iterations, 20),
    (lambda o: o.replicationFactor(4), lambda o: o.replication_factor, 4),
    (lambda o: o.replicationFactor(4).inputReplicaGrouping(2, CommGroupType.Orthogonal),
     lambda o: (o.input_group_size, o.input_group_type), (2, CommGroupType.Orthogonal)),
    (lambda o: o.outputMode(OutputMode.All), lambda o: o.output_mode, OutputMode.All),
    (lambda o: o.outputMode(OutputMode.EveryN, 5),
     lambda o: (o.output_mode, o.output_return_period), (OutputMode.EveryN, 5)),
    (lambda o: o.outputMode(3), lambda o: o.output_mode, OutputMode.Sum),
    (lambda o: o.anchorMode(AnchorMode.Final), lambda o: o.output_mode, OutputMode.Final),
    (lambda o: o.randomSeed(123), lambda o: o.random_seed, 123),
    (lambda o: o.broadcastBuffers(False), lambda o: o.broadcast_buffers, False),
    (lambda o: o.setExecutionStrategy(ShardedExecution("A")),
     lambda o: repr(o.execution_strategy), "ShardedExecution(Stage('A'))"),
    (lambda o: o._Popart.set("autoRecomputation", 3), lambda o: o.auto_recomputation, 3),
    (lambda o: o.set_ipu_devices("cpu"), lambda o: o.ipu_devices[3], torch.device("cpu")),
])
def test_core_setter_chains_and_reads_back(call, read, expected):
    o = Options()
    result = call(o)
    assert result is o or result is o._Popart
    assert read(o) == expected


def test_sub_group_setters_chain_on_their_group():
    o = Options()
    t = o.Training.gradientAccumulation(4).accumulationAndReplicationReductionType(
        ReductionType.Sum)
    assert t is o.Training
    assert (t.gradient_accumulation, t.reduction_type) == (4, ReductionType.Sum)
    d = o.Distributed.configureProcessId(2, 3)
    assert d is o.Distributed and (d.processId, d.numProcesses) == (2, 3)
    assert o.Distributed.disable() is o.Distributed
    assert (o.Distributed.processId, o.Distributed.numProcesses) == (0, 1)
    assert o.Training.accumulationReductionType(ReductionType.Mean).reduction_type \
        is ReductionType.Mean


def test_walkthrough_chain():
    # ex:tutorials/.../walkthrough.py; useIpuModel means separate memories here: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o = Options().deviceIterations(20).replicationFactor(2).randomSeed(123).useIpuModel(True)
    assert (o.device_iterations, o.replication_factor, o.random_seed, o.use_model) == (
        20, 2, 123, True)


def test_random_seed_seeds_torch():
    Options().randomSeed(7)
    a = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(a, torch.rand(3))


def test_attribute_assignment_goes_through_setter():
    o = Options()
    o.replication_factor = 4
    o.Training.gradient_accumulation = 3
    o.auto_recomputation = 3
    o.ipu_devices = ["cpu"]
    with pytest.warns(errors.PoptorchLiteWarning, match="only used with OutputMode.EveryN"):
        o.output_return_period = 7  # not EveryN: ignored
    assert (o.replication_factor, o.Training.gradient_accumulation, o.auto_recomputation) == (
        4, 3, 3)
    assert o.ipu_devices == {0: torch.device("cpu")}
    with pytest.raises(errors.OptionsError,
                       match=r"replicationFactor must be a positive int, got 0; "
                             r"call opts.replicationFactor\(1\) or more"):
        o.replication_factor = 0
    assert o.replication_factor == 4


def test_unknown_attribute_is_refused_with_a_suggestion():
    o = Options()
    with pytest.raises(errors.OptionsError,
                       match=r"no settable option 'device_iteration'.*"
                             r"did you mean 'device_iterations'"):
        o.device_iteration = 2
    with pytest.raises(errors.OptionsError, match="no settable option 'gradient_accumulations'"):
        o.Training.gradient_accumulations = 2
    with pytest.raises(errors.OptionsError, match="module_namescope_enabled"):
        o.module_namescope_enabled = False  # read-only: set with disableModuleNamescope()
    with pytest.raises(AttributeError, match="Options has no option 'nope'"):
        o.nope


@pytest.mark.parametrize("call, message", [
    (lambda o: o.deviceIterations(0),
     "deviceIterations must be a positive int, got 0; call opts.deviceIterations(1) or more"),
    (lambda o: o.deviceIterations(True), "deviceIterations must be a positive int, got True"),
    (lambda o: o.deviceIterations(2.0), "deviceIterations must be a positive int, got 2.0"),
    (lambda o: o.replicationFactor("2"), "replicationFactor must be a positive int, got '2'"),
    (lambda o: o.Training.gradientAccumulation(-3),
     "gradientAccumulation must be a positive int, got -3; call "
     "opts.Training.gradientAccumulation(1) or more"),
    (lambda o: o.Training.accumulationAndReplicationReductionType(ReductionType.NoReduction),
     "must be set to poptorch.ReductionType.Mean or poptorch.ReductionType.Sum, got "
     "<ReductionType.NoReduction: 2>"),
    (lambda o: o.Training.accumulationAndReplicationReductionType("Average"),
     "must be a poptorch.ReductionType (one of ReductionType.Sum, ReductionType.Mean, "
     "ReductionType.NoReduction), got 'Average'"),
    (lambda o: o.outputMode(OutputMode.EveryN), "period must be a positive int, got None"),
    (lambda o: o.outputMode(OutputMode.EveryN, 0), "period must be a positive int, got 0"),
    (lambda o: o.outputMode(9), "outputMode must be a poptorch.OutputMode"),
    (lambda o: o.randomSeed(-1), "randomSeed needs an int in [0, 2**64), got -1"),
    (lambda o: o.randomSeed("1"), "randomSeed needs an int in [0, 2**64), got '1'"),
    (lambda o: o.setExecutionStrategy("pipelined"),
     "setExecutionStrategy needs a poptorch execution strategy, got 'pipelined' (str)"),
    (lambda o: o.broadcastBuffers(1), "broadcastBuffers needs a bool, got 1 (int)"),
    (lambda o: o.inputReplicaGrouping(2, CommGroupType.All), "inputReplicaGrouping(2, "),
    (lambda o: o.inputReplicaGrouping(0), "inputReplicaGrouping must be a positive int, got 0"),
    (lambda o: o._Popart.set("autoRecomputation", -1),
     "autoRecomputation must be a non-negative int (PopART's RecomputationType), got -1"),
    (lambda o: o.Distributed.configureProcessId(4, 4),
     "Distributed.configureProcessId(4, 4): the process id must be an int with "
     "0 <= process_id < 4"),
    (lambda o: o.Distributed.configureProcessId(0, 0),
     "configureProcessId num_processes must be a positive int, got 0"),
])
def test_validation_messages(call, message):
    with pytest.raises(errors.OptionsError) as info:
        call(Options())
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_output_mode_period_with_other_mode_is_ignored_with_a_warning():
    o = Options()
    with pytest.warns(errors.PoptorchLiteWarning, match="only used with OutputMode.EveryN"):
        o.outputMode(OutputMode.All, 4)
    assert (o.output_mode, o.output_return_period) == (OutputMode.All, 1)


def test_input_replica_grouping_batch_factor():
    o = Options().deviceIterations(3).replicationFactor(4).inputReplicaGrouping(2)
    o.Training.gradientAccumulation(5)
    assert batch_factor(o) == 3 * 2 * 5
    o.inputReplicaGrouping(3)
    with pytest.raises(errors.OptionsError,
                       match=r"inputReplicaGrouping\(3\) must divide replicationFactor\(4\)"):
        batch_factor(o)


@pytest.mark.parametrize("B, D, R, g, G, expected", [
    (1, 1, 1, 1, 1, 1),
    (8, 2, 2, 1, 3, 96),
    (16, 10, 1, 1, 1, 160),
    (4, 1, 4, 2, 2, 16),
    (4, 2, 4, 4, 1, 8),
])
def test_combined_batch_size(B, D, R, g, G, expected):
    o = Options().deviceIterations(D).replicationFactor(R).inputReplicaGrouping(g)
    o.Training.gradientAccumulation(G)
    assert combined_batch_size(o, B) == expected
    assert batch_factor(o) == expected // B


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, None])
def test_combined_batch_size_refuses_bad_micro_batch(bad):
    with pytest.raises(errors.BatchSizeError, match=f"got {bad!r}"):
        combined_batch_size(Options(), bad)


# -- Distributed ---------------------------------------------------------------------


def test_distributed_reads_ompi_environment(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    o = Options()
    assert (o.Distributed.processId, o.Distributed.numProcesses) == (2, 4)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "5")
    o.Distributed.setEnvVarNames("WORLD_SIZE", "RANK")
    assert (o.Distributed.processId, o.Distributed.numProcesses) == (5, 8)
    monkeypatch.setenv("RANK", "five")
    with pytest.raises(errors.OptionsError, match=r"Environment variable RANK='five' is not an int"):
        o.Distributed.setEnvVarNames("WORLD_SIZE", "RANK")


# -- freezing and cloning ------------------------------------------------------------


@pytest.mark.parametrize("change", [
    lambda o: o.deviceIterations(2),
    lambda o: o.deviceIterations(0),  # frozen is reported before validation
    lambda o: o.Training.gradientAccumulation(2),
    lambda o: o.Distributed.configureProcessId(0, 1),
    lambda o: o.Distributed.disable(),
    lambda o: o.Precision.enableStochasticRounding(True),
    lambda o: o.TensorLocations.numIOTiles(32),
    lambda o: o.Jit.traceModel(False),
    lambda o: o._Popart.set("autoRecomputation", 3),
    lambda o: o.useIpuModel(True),
    lambda o: o.set_ipu_devices("cpu"),
    lambda o: o.setExecutionStrategy(ShardedExecution()),
    lambda o: o.from_json('{"deviceIterations": 2}'),
    lambda o: o.loadFromFile("does-not-matter.conf"),
    lambda o: setattr(o, "replication_factor", 2),
    lambda o: setattr(o.Training, "gradient_accumulation", 2),
    lambda o: setattr(o, "no_such_option", 2),
])
def test_frozen_options_refuse_every_change(change):
    o = Options()
    o._freeze()
    assert o.is_frozen and o.Training.is_frozen and o._Popart.is_frozen
    before = o.toDict()
    with pytest.raises(errors.FrozenOptionsError,
                       match=r"Can't modify frozen Options: .*call opts.clone\(\) to get "
                             r"a modifiable copy"):
        change(o)
    assert o.toDict() == before


def test_frozen_error_is_an_attribute_error():
    o = Options()
    o._freeze()
    with pytest.raises(AttributeError):
        o.deviceIterations(2)


def test_clone_is_an_unfrozen_equal_deep_copy():
    o = Options().deviceIterations(4).setExecutionStrategy(PipelinedExecution("A", "B"))
    o.Training.gradientAccumulation(3)
    o._freeze()
    c = o.clone()
    assert c.toDict() == o.toDict()
    assert not c.is_frozen and not c.Training.is_frozen and o.is_frozen
    c.deviceIterations(8).Training.gradientAccumulation(5)
    c.execution_strategy.stage("A").ipu(1)
    assert (o.device_iterations, o.Training.gradient_accumulation) == (4, 3)
    assert o.execution_strategy.stage("A").ipu_id is None


def test_to_dict_and_repr():
    o = Options().deviceIterations(4).set_ipu_devices({0: "cpu"})
    d = o.toDict()
    assert d["device_iterations"] == 4
    assert d["ipu_devices"] == {0: "cpu"}
    assert d["Training"]["gradient_accumulation"] == 1
    assert d["execution_strategy"] == (
        "PipelinedExecution(AutoStage.SameAsIpu, schedule=PipelineSchedule.Grouped)")
    text = repr(o)
    assert text.startswith("Options(device_iterations=4, ")
    assert "Training=_TrainingOptions(gradient_accumulation=1, " in text


# -- IPU-only options ----------------------------------------------------------------

IPU_ONLY = [
    ("Options.autoRoundNumIPUs", lambda o: o.autoRoundNumIPUs(True), "auto_round_num_ipus", True),
    ("Options.enableExecutableCaching", lambda o: o.enableExecutableCaching("/tmp/c"),
     "executable_cache_dir", "/tmp/c"),
    ("Options.connectionType", lambda o: o.connectionType(ConnectionType.Never),
     "connection_type", ConnectionType.Never),
    ("Options.useIpuId", lambda o: o.useIpuId(3), "ipu_id", 3),
    ("Options.useOfflineIpuTarget", lambda o: o.useOfflineIpuTarget(2),
     "connection_type", ConnectionType.Never),
    ("Options.syncPattern", lambda o: o.syncPattern(SyncPattern.SinglePipeline),
     "sync_pattern", SyncPattern.SinglePipeline),
    ("Options.logCycleCount", lambda o: o.logCycleCount(True), "log_cycle_count", True),
    ("Options.enableProfiling", lambda o: o.enableProfiling(), "profile_dir", "."),
    ("Options.logDir", lambda o: o.logDir("/tmp/l"), "log_dir", "/tmp/l"),
    ("Options.maxRepeatLogs", lambda o: o.maxRepeatLogs(3), "max_repeat_logs", 3),
    ("Options.modelName", lambda o: o.modelName("m"), "model_name", "m"),
    ("Options.enableStableNorm", lambda o: o.enableStableNorm(True), "stable_norm", True),
    ("Options.showCompilationProgressBar", lambda o: o.showCompilationProgressBar(False),
     "show_compilation_progress_bar", False),
    ("Options.relaxOptimizerAttributesChecks", lambda o: o.relaxOptimizerAttributesChecks(),
     "relax_optimizer_attributes_checks", True),
    ("Options.sourceLocationExcludes", lambda o: o.sourceLocationExcludes(["x"]),
     "source_location_excludes", ["x"]),
    ("Options.appendToLocationExcludes", lambda o: o.appendToLocationExcludes("y", "z"),
     "source_location_excludes",
     ["install/poptorch", "site-packages/torch", "site-packages/poptorch", "y", "z"]),
    ("Options.disableModuleNamescope", lambda o: o.disableModuleNamescope(),
     "module_namescope_enabled", False),
    ("Options.setAvailableMemoryProportion",
     lambda o: o.setAvailableMemoryProportion({"IPU0": 0.5, "IPU12": 0.25}),
     "available_memory_proportion", {0: 0.5, 12: 0.25}),
    ("Options._Popart.set('enableStochasticRounding')",
     lambda o: o._Popart.set("enableStochasticRounding", True), None, None),
    ("Options._Popart.setEngineOptions", lambda o: o._Popart.setEngineOptions({"a": "1"}),
     None, None),
    ("Options._Popart.setPatterns", lambda o: o._Popart.setPatterns({"P": True}), None, None),
    ("Options.Precision.enableFloatingPointExceptions",
     lambda o: o.Precision.enableFloatingPointExceptions(True), None, None),
    ("Options.Precision.enableStochasticRounding",
     lambda o: o.Precision.enableStochasticRounding(True), None, None),
    ("Options.Precision.setPartialsType", lambda o: o.Precision.setPartialsType(torch.half),
     None, None),
    ("Options.Precision.halfFloatCasting",
     lambda o: o.Precision.halfFloatCasting(enums.HalfFloatCastingBehavior.HalfUpcastToFloat),
     None, None),
    ("Options.Precision.runningStatisticsAlwaysFloat",
     lambda o: o.Precision.runningStatisticsAlwaysFloat(False), None, None),
    ("Options.TensorLocations.numIOTiles", lambda o: o.TensorLocations.numIOTiles(64), None, None),
    ("Options.TensorLocations.setActivationLocation",
     lambda o: o.TensorLocations.setActivationLocation(TensorLocationSettings()), None, None),
    ("Options.TensorLocations.setWeightLocation",
     lambda o: o.TensorLocations.setWeightLocation(TensorLocationSettings()), None, None),
    ("Options.TensorLocations.setOptimizerLocation",
     lambda o: o.TensorLocations.setOptimizerLocation(
         TensorLocationSettings().minElementsForOffChip(10)), None, None),
    ("Options.TensorLocations.setAccumulatorLocation",
     lambda o: o.TensorLocations.setAccumulatorLocation(TensorLocationSettings()), None, None),
    ("Options.Jit.traceModel", lambda o: o.Jit.traceModel(False), None, None),
    ("Options.Training.setMeanAccumulationAndReplicationReductionStrategy",
     lambda o: o.Training.setMeanAccumulationAndReplicationReductionStrategy(
         enums.MeanReductionStrategy.Running), None, None),
    ("Options.Training.setConvolutionDithering",
     lambda o: o.Training.setConvolutionDithering(True), None, None),
]


@pytest.mark.parametrize("name, call, attribute, expected", IPU_ONLY,
                         ids=[row[0] for row in IPU_ONLY])
def test_ipu_only_option_is_stored_and_warns_exactly_once(name, call, attribute, expected):
    o = Options()
    with warnings.catch_warnings(record=True) as first:
        warnings.simplefilter("always")
        assert call(o) is not None
    assert [type(w.message) for w in first] == [errors.IpuOnlyWarning]
    text = str(first[0].message)
    shown = name if name.endswith(")") else f"{name}()"
    assert text.startswith(f"{shown} only tunes IPU hardware and has no effect in poptorch_lite")
    if attribute is not None:
        assert getattr(o, attribute) == expected
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        call(Options())
    assert again == []


def test_offloading_the_optimizer_and_the_ipu_model_have_a_meaning_and_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o = Options().useIpuModel(True)
        o.TensorLocations.setOptimizerLocation(TensorLocationSettings().useOnChipStorage(False))
        o.Training.stopOnNonFiniteLoss(True)
        o.allOrNothingCalls(True)
    assert (o.use_model, o.TensorLocations.offload_optimizer, o.Training.stop_on_non_finite_loss,
            o.all_or_nothing_calls) == (True, True, True, True)
    assert Options().TensorLocations.offload_optimizer is False
    for setter in (lambda: Options().useIpuModel(1), lambda: Options().allOrNothingCalls("yes"),
                   lambda: Options().Training.stopOnNonFiniteLoss(None)):
        with pytest.raises(errors.OptionsError, match="needs a bool"):
            setter()


def test_ipu_only_values_in_groups_read_back():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o = Options()
        o.Precision.setPartialsType(torch.half).enableStochasticRounding(True)
        o.TensorLocations.numIOTiles(192).setOptimizerLocation(
            TensorLocationSettings().useOnChipStorage(False).minElementsForOffChip(10))
        o._Popart.set("someKey", [1, 2])
        o.Training.setMeanAccumulationAndReplicationReductionStrategy(2)
    assert o.Precision.partials_type is torch.float16
    assert o.Precision.stochastic_rounding is True
    assert o.TensorLocations.num_io_tiles == 192
    assert o.TensorLocations.location_optimizer == {"onChip": 0, "minElementsForOffChip": 10}
    assert o._Popart.options == {"someKey": [1, 2]}
    assert o.Training.mean_reduction_strategy is enums.MeanReductionStrategy.PostAndLoss


def test_never_says_what_it_does():
    with pytest.warns(errors.IpuOnlyWarning, match="compiles but refuses to run"):
        Options().connectionType(ConnectionType.Never)


def test_synthetic_data_sets_poparts_mode_as_poptorch_does_and_warns_once():
    """PopTorch: ``mode = 2 if enabled else 0; self._Popart.set("syntheticDataMode", mode)``."""
    with pytest.warns(errors.PoptorchLiteWarning, match=r"synthetic data \(RandomNormal\): the "
                      r"host's inputs are not used; the model sees random-normal data"):
        o = Options().enableSyntheticData(int(enums.SyntheticDataMode.RandomNormal))
    assert (o.synthetic_data_mode, o._Popart.options["syntheticDataMode"]) == (2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Options().enableSyntheticData(True).synthetic_data_mode == 2
        assert Options().enableSyntheticData(False).synthetic_data_mode == 0
        assert Options().synthetic_data_mode == enums.SyntheticDataMode.Off
    o = Options()
    o._Popart.set("syntheticDataMode", int(enums.SyntheticDataMode.Zeros))
    assert o.synthetic_data_mode is enums.SyntheticDataMode.Zeros


def test_auto_recomputation_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Options()._Popart.set("autoRecomputation", 3).options == {"autoRecomputation": 3}


@pytest.mark.parametrize("call, message", [
    (lambda o: o.TensorLocations.numIOTiles(30), "even number between 32 and 192, got 30"),
    (lambda o: o.TensorLocations.numIOTiles(33), "even number between 32 and 192, got 33"),
    (lambda o: o.TensorLocations.numIOTiles(194), "even number between 32 and 192, got 194"),
    (lambda o: o.setAvailableMemoryProportion({"GPU0": 0.5}), "Invalid key: 'GPU0'"),
    (lambda o: o.setAvailableMemoryProportion({"IPU0": "half"}),
     "the proportion for 'IPU0' must be a number"),
    (lambda o: o.Jit.traceModel(1), "Jit.traceModel needs a bool, got 1"),
    (lambda o: o.Precision.setPartialsType(torch.int32),
     "setPartialsType should be either torch.float or torch.half, got torch.int32"),
    (lambda o: o.Precision.runningStatisticsAlwaysFloat(1),
     "runningStatisticsAlwaysFloat needs a bool, got 1"),
    (lambda o: o.connectionType("Sometimes"), "connectionType must be a poptorch.ConnectionType"),
    (lambda o: o.useIpuId(-1), "useIpuId needs a non-negative int, got -1"),
    (lambda o: o.TensorLocations.setWeightLocation({"onChip": 1}),
     "setWeightLocation needs a poptorch.TensorLocationSettings, got {'onChip': 1}"),
    (lambda o: TensorLocationSettings().useIOTilesToLoad("yes"),
     "useIOTilesToLoad needs a bool, got 'yes'"),
    (lambda o: TensorLocationSettings().minElementsForOffChip(-5),
     "minElementsForOffChip needs a non-negative int, got -5"),
])
def test_ipu_only_validation(call, message):
    with pytest.raises(errors.OptionsError) as info:
        call(Options())
    assert message in str(info.value)


def test_tensor_location_settings_chain():
    s = TensorLocationSettings().useOnChipStorage(False).useReplicatedTensorSharding() \
        .useIOTilesToLoad(False).useIOTilesToStore().minElementsForReplicatedTensorSharding(4)
    assert s.toDict() == {"onChip": 0, "useReplicatedTensorSharding": 1, "useIOTilesToLoad": 0,
                          "useIOTilesToStore": 1, "minElementsForReplicatedTensorSharding": 4}
    assert "onChip" not in s.useOnChipStorage(None).toDict()


def test_replicated_tensor_sharding_of_the_optimizer_is_stored_without_a_warning():
    """It is a memory feature here too ([Note: sharded optimizer state]), not an IPU tuning."""
    o = Options()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        o.TensorLocations.setOptimizerLocation(
            TensorLocationSettings().useReplicatedTensorSharding(True))
    assert seen == []
    assert o.TensorLocations.location_optimizer == {"useReplicatedTensorSharding": 1}


# -- set_ipu_devices -----------------------------------------------------------------


def test_set_ipu_devices_forms():
    cpu = torch.device("cpu")
    o = Options().set_ipu_devices({1: "cuda:1", 0: torch.device("cpu")})
    assert isinstance(o.ipu_devices, IpuDeviceMap)
    assert list(o.ipu_devices.items()) == [(0, cpu), (1, torch.device("cuda", 1))]
    assert 2 not in o.ipu_devices and o.ipu_devices.get(2) is None
    with pytest.raises(KeyError):
        o.ipu_devices[2]
    # An index-less "cuda" is the current CUDA device, so that it compares equal to the
    # device of a tensor there (cuda:0 where CUDA is absent).
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    assert Options().set_ipu_devices(["cpu", "cuda"]).ipu_devices == {
        0: cpu, 1: torch.device("cuda", current)}
    assert Options().set_ipu_devices("cuda").ipu_devices[3] == torch.device("cuda", current)
    assert Options().set_ipu_devices(("cpu",)).ipu_devices == {0: cpu}
    every = Options().set_ipu_devices(cpu).ipu_devices
    assert (5 in every, every[5], every.get(9), len(every)) == (True, cpu, cpu, 0)
    assert repr(every) == "IpuDeviceMap(every IPU: device(type='cpu'))"


@pytest.mark.parametrize("bad, message", [
    ("nonsense", "'nonsense' for every IPU is not a torch device"),
    ({0: "cpu", 1: "gpu:0"}, "'gpu:0' for IPU 1 is not a torch device"),
    ([0], "0 for IPU 0 is not a torch device"),
    ({-1: "cpu"}, "IPU ids must be non-negative ints, got -1"),
    ({True: "cpu"}, "IPU ids must be non-negative ints, got True"),
    ([], "needs a device, a non-empty list of devices"),
    (3, "needs a device, a non-empty list of devices"),
])
def test_set_ipu_devices_refuses(bad, message):
    with pytest.raises(errors.OptionsError) as info:
        Options().set_ipu_devices(bad)
    assert message in str(info.value)


# -- loadFromFile --------------------------------------------------------------------


def test_load_from_file_accepts_every_form(tmp_path):
    conf = tmp_path / "poptorch.conf"
    conf.write_text("\n".join([
        "# a comment",
        "deviceIterations(4)",
        "",
        "   replicationFactor(2)   ",
        "Training.gradientAccumulation(3)",
        "Training.accumulationAndReplicationReductionType(poptorch.ReductionType.Sum)",
        "outputMode(poptorch.OutputMode.EveryN, 2)",
        "setExecutionStrategy(poptorch.PipelinedExecution(poptorch.Stage('a').ipu(1), "
        "['b', 'c'], 'd', schedule=poptorch.PipelineSchedule.Interleaved))",
        "_Popart.set('autoRecomputation', 3)",
        "Distributed.configureProcessId(1, 2)",
        "inputReplicaGrouping(1, poptorch_lite.CommGroupType.Orthogonal)",
        "set_ipu_devices({0: 'cpu', 1: 'cpu'})",
        "randomSeed(+5)",
        "broadcastBuffers(False)",
        "enableSyntheticData(True)",
        "setAvailableMemoryProportion({'IPU0': 0.5})",
        "TensorLocations.setOptimizerLocation(poptorch.TensorLocationSettings()"
        ".useOnChipStorage(False))",
        "Precision.setPartialsType(torch.half)",
    ]) + "\n")
    o = Options()
    with pytest.warns(errors.IpuOnlyWarning):
        assert o.loadFromFile(conf) is o
    assert (o.device_iterations, o.replication_factor, o.Training.gradient_accumulation) == (4, 2, 3)
    assert o.Training.reduction_type is ReductionType.Sum
    assert (o.output_mode, o.output_return_period) == (OutputMode.EveryN, 2)
    s = o.execution_strategy
    assert [st.blocks for st in s.stages] == [["a"], ["b", "c"], ["d"]]
    assert (s.stage("a").ipu_id, s.schedule) == (1, PipelineSchedule.Interleaved)
    assert o.auto_recomputation == 3
    assert (o.Distributed.processId, o.Distributed.numProcesses) == (1, 2)
    assert o.input_group_type is CommGroupType.Orthogonal
    assert o.ipu_devices == {0: torch.device("cpu"), 1: torch.device("cpu")}
    assert (o.random_seed, o.broadcast_buffers, o.synthetic_data) == (5, False, True)
    assert o.available_memory_proportion == {0: 0.5}
    assert o.TensorLocations.location_optimizer == {"onChip": 0}
    assert o.Precision.partials_type is torch.float16

    # Repeated calls accumulate: PopTorch's own docs/user_guide/poptorch.conf.
    second = tmp_path / "second.conf"
    second.write_text("deviceIterations(1)\nsetExecutionStrategy(poptorch.ShardedExecution())\n"
                      "replicationFactor(1)\nenableSyntheticData(True)\n")
    o.loadFromFile(str(second))
    assert (o.device_iterations, o.replication_factor, o.Training.gradient_accumulation) == (1, 1, 3)
    assert type(o.execution_strategy) is ShardedExecution
    assert o.execution_strategy.auto_stage is AutoStage.SameAsIpu


def test_load_from_file_phased_strategy_with_chained_methods(tmp_path):
    conf = tmp_path / "phased.conf"
    conf.write_text(
        "setExecutionStrategy(poptorch.ParallelPhasedExecution("
        "poptorch.Phase(poptorch.Stage('A'), poptorch.Stage('B')).ipus(0, 2), ['C'])"
        ".sendTensorsOffChipAfterFwd())\n")
    o = Options()
    with pytest.warns(errors.IpuOnlyWarning):
        o.loadFromFile(conf)
    s = o.execution_strategy
    assert type(s) is ParallelPhasedExecution
    assert [st.ipu_id for st in s.stages] == [0, 2, None]
    assert s.tensors_liveness is Liveness.OffChipAfterFwd


@pytest.mark.parametrize("line, reason", [
    ("__import__('os').system('touch PWNED')",
     "'__import__('os').system' is not a setter path such as 'Training.gradientAccumulation'"),
    ("__import__('os')", "'__import__' is not a setter of Options"),
    ("open('f')", "'open' is not a setter of Options"),
    ("unknownSetter(1)", "'unknownSetter' is not a setter of Options"),
    ("deviceIterations(", "syntax error"),
    ("deviceIterations(1) + 1", "the line is not a setter call"),
    ("deviceIterations", "the line is not a setter call"),
    ("clone()", "'clone' is not a setter of Options"),
    ("_freeze()", "'_freeze' is not a setter of Options"),
    ("loadFromFile('other.conf')", "'loadFromFile' is not a setter of Options"),
    ("Training.__class__(1)", "'__class__' is not a setter of Options.Training"),
    ("__class__.deviceIterations(1)", "'__class__' is not an option group of Options"),
    ("deviceIterations(__import__('os').getpid())", "'__import__' is not allowed; only poptorch"),
    ("deviceIterations(x)", "'x' is not allowed"),
    ("deviceIterations(*[1])", "'*' and '**' arguments are not allowed"),
    ("deviceIterations(0)", "deviceIterations must be a positive int, got 0"),
    ("outputMode(poptorch.OutputMode.Bogus)", "poptorch.OutputMode has no member 'Bogus'"),
    ("outputMode(poptorch.OutputMode.__class__)",
     "poptorch.OutputMode has no member '__class__'"),
    ("setExecutionStrategy(poptorch.Stage('a').__class__('b'))",
     "method '.__class__()' is not allowed on Stage"),
    ("setExecutionStrategy(poptorch.OutputMode(1))", "'poptorch.OutputMode' cannot be called"),
    ("setExecutionStrategy(os.system('x'))", "'os.system' is not allowed"),
    ("deviceIterations(lambda: 1)", "is not allowed; arguments must be literals"),
    ("deviceIterations([i for i in range(3)])", "is not allowed; arguments must be literals"),
    ("Precision.setPartialsType(torch.load('f'))", "'torch.load' is not allowed"),
    ("setExecutionStrategy(poptorch.Stage())", "Stage() needs at least one block id"),
    ("randomSeed(1, 2)", "takes 2 positional arguments but 3 were given"),
])
def test_load_from_file_refuses(tmp_path, monkeypatch, line, reason):
    monkeypatch.chdir(tmp_path)
    conf = tmp_path / "bad.conf"
    conf.write_text(f"# header\nreplicationFactor(2)\n{line}\ndeviceIterations(7)\n")
    o = Options()
    with pytest.raises(errors.ConfigFileError) as info:
        o.loadFromFile(conf)
    message = str(info.value)
    assert message.startswith(f"{conf}:3: invalid option line {line!r}: ")
    assert reason in message
    assert "fix or remove the line" in message
    assert o.replication_factor == 2 and o.device_iterations == 1  # stopped at line 3
    assert not (tmp_path / "PWNED").exists()


def test_load_from_file_missing_file(tmp_path):
    with pytest.raises(errors.ConfigFileError, match="Cannot read options file"):
        Options().loadFromFile(tmp_path / "missing.conf")


# -- JSON and POPTORCH_DEFAULT_OPTIONS ---------------------------------------------


def test_from_json_by_setter_path_and_attribute_path():
    o = Options().from_json(
        '{"deviceIterations": 3, "Training.gradient_accumulation": 2, '
        '"Distributed.configureProcessId": [1, 2], "outputMode": [1, 5], '
        '"Training.accumulationAndReplicationReductionType": "Sum", '
        '"set_ipu_devices": ["cpu"], "replication_factor": 4}')
    assert (o.device_iterations, o.Training.gradient_accumulation) == (3, 2)
    assert (o.Distributed.processId, o.Distributed.numProcesses) == (1, 2)
    assert (o.output_mode, o.output_return_period) == (OutputMode.EveryN, 5)
    assert o.Training.reduction_type is ReductionType.Sum
    assert o.ipu_devices == {0: torch.device("cpu")}
    assert o.replication_factor == 4


@pytest.mark.parametrize("text, message", [
    ("{not json", "from_json: invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"deviceIteration": 2}', "cannot set 'deviceIteration' to 2"),
    ('{"deviceIterations": 0}', "deviceIterations must be a positive int, got 0"),
    ('{"Nope.deviceIterations": 1}', "'Nope' is not an option group"),
    ('{"clone": 1}', "'clone' is not a setter of Options"),
])
def test_from_json_refuses(text, message):
    with pytest.raises(errors.OptionsError) as info:
        Options().from_json(text)
    assert message in str(info.value)


def test_poptorch_default_options_environment(monkeypatch):
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS",
                       '{"deviceIterations": 5, "Training.gradientAccumulation": 2}')
    o = Options()
    assert (o.device_iterations, o.Training.gradient_accumulation) == (5, 2)
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS", '{"deviceIterations": -1}')
    with pytest.raises(errors.OptionsError, match=r"POPTORCH_DEFAULT_OPTIONS: cannot set "
                                                  r"'deviceIterations' to -1"):
        Options()


# -- strategies ----------------------------------------------------------------------


def test_stage():
    s = Stage("B1", "B2")
    assert (s.blocks, s.ipu_id) == (["B1", "B2"], None)
    assert s.ipu(3) is s and s.ipu_id == 3
    s.blocks.append("X")
    assert s.blocks == ["B1", "B2"]
    assert repr(s) == "Stage('B1', 'B2').ipu(3)"


@pytest.mark.parametrize("make, message", [
    (lambda: Stage("a", 1), "Block IDs are supposed to be strings but got 1 (int)"),
    (lambda: Stage(), "Stage() needs at least one block id"),
    (lambda: Stage("a").ipu(-1), "Stage('a',).ipu() needs a non-negative int, got -1"),
    (lambda: Stage("a").ipu(True), "needs a non-negative int, got True"),
    (lambda: PipelinedExecution("a", 3), "arguments must be poptorch.Stage objects, block-id "
                                         "strings or lists of block ids, got 3 (int)"),
    (lambda: PipelinedExecution("a", ["b", 2]), "got ['b', 2] (list)"),
    (lambda: PipelinedExecution(AutoStage.AutoIncrement, "a"), "mixes <AutoStage.AutoIncrement"),
    (lambda: PipelinedExecution("a", schedule="1f1b"),
     "Unknown pipeline schedule '1f1b'; valid choices are 'sequential', 'grouped', "
     "'interleaved', 'gpipe'"),
    (lambda: Phase(Stage("a"), "b"), "All arguments of Phase must either be block ids"),
    (lambda: Phase(), "All arguments of Phase must either be block ids"),
    (lambda: Phase(Stage("a"), Stage("b")).ipus(0),
     "Phase contains 2 stages but you provided 1 ipus"),
    (lambda: SerialPhasedExecution(), "There is currently no AutoStage for SerialPhasedExecution"),
    (lambda: ParallelPhasedExecution(), "no AutoStage for ParallelPhasedExecution"),
    (lambda: SerialPhasedExecution(3), "Phases must be poptorch.Phase objects"),
    (lambda: SerialPhasedExecution(["a"]).phase(1), "Phases are identified by integers 0..0, got 1"),
    (lambda: SerialPhasedExecution(["a"]).useSeparateBackwardPhase(1),
     "useSeparateBackwardPhase needs a bool, got 1"),
    (lambda: SerialPhasedExecution(["a"]).setTensorsLiveness(1),
     "setTensorsLiveness needs a poptorch.Liveness, got 1"),
])
def test_strategy_argument_errors(make, message):
    with pytest.raises(errors.OptionsError) as info:
        make()
    assert message in str(info.value)


def test_pipelined_execution_explicit_stages():
    shared = Stage("B4").ipu(1)
    s = PipelinedExecution("B1", ["B2", "B3"], ("B5",), shared)
    assert [st.blocks for st in s.stages] == [["B1"], ["B2", "B3"], ["B5"], ["B4"]]
    assert s.stage("B4") is shared
    assert [s.stage_index(b) for b in ("B1", "B3", "B5", "B4", "nope")] == [0, 1, 2, 3, None]
    assert (s.auto_stage, s.schedule, s.pipelined) == (None, PipelineSchedule.Grouped, True)
    s.stage("B1").ipu(0)  # mnist.py: strategy.stage("B1").ipu(0)
    assert s.stages[0].ipu_id == 0
    assert isinstance(s, ExecutionStrategy)
    assert repr(s) == ("PipelinedExecution(Stage('B1').ipu(0), Stage('B2', 'B3'), Stage('B5'), "
                       "Stage('B4').ipu(1), schedule=PipelineSchedule.Grouped)")


def test_pipelined_execution_auto_stage():
    assert PipelinedExecution().auto_stage is AutoStage.SameAsIpu
    s = PipelinedExecution(AutoStage.AutoIncrement, schedule="GPipe")
    assert (s.auto_stage, s.stages, s.schedule) == (AutoStage.AutoIncrement, [],
                                                    PipelineSchedule.GPipe)
    with pytest.raises(errors.BlockError, match=r"Unknown Block 'B1': .*AutoStage.AutoIncrement"):
        s.stage("B1")


def test_block_in_two_stages_is_refused():
    with pytest.raises(errors.BlockError,
                       match=r"'b' associated with more than one stage \(stages 0 and 1 of "):
        PipelinedExecution(["a", "b"], Stage("b"))
    stage = Stage("x")
    with pytest.raises(errors.BlockError, match="'x' associated with more than one stage"):
        ShardedExecution(stage, stage)
    with pytest.raises(errors.BlockError, match="'a' associated with more than one stage"):
        SerialPhasedExecution(["a"], Phase(Stage("b"), Stage("a")))


def test_unknown_block_lists_the_known_ones():
    with pytest.raises(errors.BlockError,
                       match=r"Unknown Block 'z' list of expected Blocks: \['a', 'b'\]"):
        PipelinedExecution("a", "b").stage("z")


def test_sharded_execution():
    s = ShardedExecution("a", ["b", "c"])
    assert (s.schedule, s.pipelined, s.auto_stage) == (PipelineSchedule.Sequential, False, None)
    assert ShardedExecution().auto_stage is AutoStage.SameAsIpu
    assert repr(s) == "ShardedExecution(Stage('a'), Stage('b', 'c'))"


@pytest.mark.parametrize("name, member", [
    (PipelineSchedule.Interleaved, PipelineSchedule.Interleaved),
    ("sequential", PipelineSchedule.Sequential), ("GROUPED", PipelineSchedule.Grouped),
    (" Interleaved ", PipelineSchedule.Interleaved), ("GPipe", PipelineSchedule.GPipe),
])
def test_pipeline_schedule_parse(name, member):
    assert PipelineSchedule.parse(name) is member


@pytest.mark.parametrize("bad", ["1f1b", "", 3, None])
def test_pipeline_schedule_parse_refuses(bad):
    with pytest.raises(errors.OptionsError, match=f"Unknown pipeline schedule {bad!r}"):
        PipelineSchedule.parse(bad)


def test_phases():
    assert [s.blocks for s in Phase("A", "B").stages] == [["A", "B"]]
    p = Phase(Stage("A"), Stage("B")).ipus(0, 2)
    assert [s.ipu_id for s in p.stages] == [0, 2] and p.stage(1).blocks == ["B"]
    s = SerialPhasedExecution(p, ["C", "D"], [Stage("E"), Stage("F")], "G")
    assert [ph.stages for ph in s.phases][1][0].blocks == ["C", "D"]
    assert [st.blocks for st in s.stages] == [["A"], ["B"], ["C", "D"], ["E"], ["F"], ["G"]]
    assert s.phase(0) is p and s.stage_index("F") == 4
    assert (s.pipelined, s.schedule, s.auto_stage) == (False, PipelineSchedule.Sequential, None)
    # PopTorch's documented form: one list of Phases.
    listed = ParallelPhasedExecution([Phase(Stage("0"), Stage("1")), Phase(Stage("2"))])
    assert len(listed.phases) == 2 and listed.stage_index("2") == 2
    assert repr(SerialPhasedExecution(["a"])) == "SerialPhasedExecution(Phase(Stage('a')))"


def test_phased_ipu_only_methods_warn_once_and_chain():
    s = SerialPhasedExecution(["a"])
    with pytest.warns(errors.IpuOnlyWarning, match="useSeparateBackwardPhase"):
        assert s.useSeparateBackwardPhase() is s
    with pytest.warns(errors.IpuOnlyWarning, match="setTensorsLiveness"):
        assert s.setTensorsLiveness(Liveness.OffChipAfterEachPhase) is s
    assert (s.separate_backward_phase, s.tensors_liveness) == (True, Liveness.OffChipAfterEachPhase)
    p = ParallelPhasedExecution(["a"])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        p.useSeparateBackwardPhase(False)  # key is per class: first time for this class
        s.useSeparateBackwardPhase(False)  # second time for SerialPhasedExecution: silent
        assert p.sendTensorsOffChipAfterFwd().tensors_liveness is Liveness.OffChipAfterFwd
        p.sendTensorsOffChipAfterFwd(False)
    assert [str(w.message).split("(")[0] for w in seen] == [
        "ParallelPhasedExecution.useSeparateBackwardPhase",
        "ParallelPhasedExecution.sendTensorsOffChipAfterFwd"]
    assert p.tensors_liveness is Liveness.AlwaysLive


def test_parallel_phased_validate_ipus():
    s = ParallelPhasedExecution(Phase(Stage("A"), Stage("B")), ["C"], ["D"])
    s.phase(0).ipus(0, 2)
    s.validate_ipus()  # unresolved stages are not checked
    s.validate_ipus({"C": 1, "D": 4})
    with pytest.raises(errors.OptionsError,
                       match=r"even phases must run on even IPUs and odd phases on odd IPUs; "
                             r"phase 1 has Stage\('C'\) on IPU 2; put it on an odd IPU"):
        s.validate_ipus({"C": 2})
    s.phase(2).stage(0).ipu(3)
    with pytest.raises(errors.OptionsError, match=r"phase 2 has Stage\('D'\).ipu\(3\) on IPU 3"):
        s.validate_ipus()


# -- enums and module rules ----------------------------------------------------------


def test_enum_values_match_poptorch():
    assert [(m.name, m.value) for m in OutputMode] == [
        ("Final", 0), ("EveryN", 1), ("All", 2), ("Sum", 3), ("Default", 4)]
    assert AnchorMode is OutputMode
    assert [(m.name, m.value) for m in ReductionType] == [
        ("Sum", 0), ("Mean", 1), ("NoReduction", 2)]
    assert [(m.name, m.value) for m in enums.DataLoaderMode] == [
        ("Sync", 0), ("Async", 1), ("AsyncRebatched", 2)]
    assert [m.name for m in enums.MeanReductionStrategy] == ["Running", "Post", "PostAndLoss"]
    assert [m.name for m in ConnectionType] == ["Always", "OnDemand", "Never"]
    assert [m.name for m in SyncPattern] == ["Full", "SinglePipeline", "ReplicaAndLadder"]
    assert [m.name for m in CommGroupType] == ["All", "Consecutive", "Orthogonal", "NoGrouping"]
    assert [m.name for m in Liveness] == [
        "AlwaysLive", "OffChipAfterFwd", "OffChipAfterFwdNoOverlap", "OffChipAfterEachPhase"]
    assert [(m.name, m.value) for m in enums.SharingStrategy] == [
        ("SharedMemory", 0), ("FileSystem", 1), ("Fork", 2), ("ForkServer", 3)]
    assert [(m.name, m.value) for m in AutoStage] == [("SameAsIpu", 0), ("AutoIncrement", 1)]
    # PopTorch's three, then GPipe and ZeroBubble, poptorch_lite's own
    assert [(m.name, m.value) for m in PipelineSchedule] == [
        ("Sequential", "sequential"), ("Grouped", "grouped"), ("Interleaved", "interleaved"),
        ("GPipe", "gpipe"), ("ZeroBubble", "zero_bubble")]


@pytest.mark.parametrize("module", ["enums.py", "strategies.py", "phases.py"])
def test_module_does_not_import_torch(module):
    tree = ast.parse((PACKAGE / module).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.level == 0}
    assert "torch" not in imported


@pytest.mark.parametrize("module", [enums, strategies, phases, options_base, ipu_options,
                                    option_groups, options_config, options],
                         ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# -- the mean reduction strategy under PopTorch's stored name -----------------------------


@pytest.mark.parametrize("strategy", list(enums.MeanReductionStrategy))
def test_mean_reduction_strategy_by_poptorchs_stored_name(strategy, tmp_path):
    """Called as a setter (scripts do), read back as the value (PopTorch's own tests do)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", errors.IpuOnlyWarning)
        o = Options()
        assert o.Training.meanAccumulationAndReplicationReductionStrategy(strategy) is o.Training
        assert o.Training.mean_reduction_strategy is strategy
        assert o.Training.meanAccumulationAndReplicationReductionStrategy == strategy
        assert repr(o.Training.meanAccumulationAndReplicationReductionStrategy) == repr(strategy)
        assigned = Options()
        assigned.Training.meanAccumulationAndReplicationReductionStrategy = strategy
        conf = tmp_path / "poptorch.conf"
        conf.write_text(f"Training.meanAccumulationAndReplicationReductionStrategy("
                        f"poptorch.MeanReductionStrategy.{strategy.name})\n")
        from_file = Options().loadFromFile(str(conf))
    for other in (assigned, from_file, o.clone()):
        assert other.Training.mean_reduction_strategy is strategy
    o._freeze()
    with pytest.raises(errors.FrozenOptionsError):
        o.Training.meanAccumulationAndReplicationReductionStrategy(strategy)
    with pytest.raises(errors.OptionsError, match="must be a poptorch.MeanReductionStrategy"):
        Options().Training.meanAccumulationAndReplicationReductionStrategy("Fast")


@pytest.mark.parametrize("strategy", list(enums.MeanReductionStrategy))
def test_mean_reduction_strategy_trains_to_the_same_numbers(strategy):
    """When the mean divides is an IPU detail: every strategy gives the default's numbers."""
    def train(configure):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 2))
        o = Options()
        o.Training.gradientAccumulation(2)
        configure(o)
        from poptorch_lite import trainingModel

        class WithLoss(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.net = model

            def forward(self, x, y):
                return torch.nn.functional.mse_loss(self.net(x), y)

        trained = trainingModel(WithLoss(), o)
        loss = trained(torch.arange(12.).view(4, 3), torch.ones(4, 2))
        return loss, [p.detach().clone() for p in model.parameters()]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", errors.IpuOnlyWarning)
        default = train(lambda o: None)
        chosen = train(lambda o: o.Training.meanAccumulationAndReplicationReductionStrategy(strategy))
    torch.testing.assert_close(chosen, default, rtol=0, atol=0)


def test_poptorchs_private_and_module_level_names_of_options():
    """Names PopTorch's own tests and popdist read: Options._execution_strategy,
    poptorch.options.ConfigFileError and poptorch.options._DistributedOptions."""
    import poptorch_lite.options as options_package
    opts = Options().setExecutionStrategy(ShardedExecution())
    assert opts._execution_strategy is opts.execution_strategy
    assert options_package.ConfigFileError is errors.ConfigFileError
    assert isinstance(opts.Distributed, options_package._DistributedOptions)


def test_values_poptorch_refuses_with_an_assert_are_also_assertion_errors():
    """The hierarchy's rule (docs/ERRORS.md): where PopTorch raises a builtin, the class also
    derives from it; for numIOTiles PopTorch's is an AssertionError."""
    with pytest.raises(AssertionError, match="numIOTiles must be an even number between 32 "
                                             "and 192, got 10"):
        Options().TensorLocations.numIOTiles(10)
    assert issubclass(errors.OptionsAssertionError, errors.OptionsError)
