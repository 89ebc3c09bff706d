"""Compiled stages ([Note: compiled stages]): Options.compileStages, against plain PyTorch.

The compiled column of the transparency matrix runs Inductor, within 1e-4 relative of plain
eager PyTorch over 20 steps, dropout masks included; its configurations share one model
structure and micro-batch shape, so they share the compiled graphs (one compile per stage
graph for the whole file). The rest use ``aot_eager`` (AOTAutograd's compiled forward and
backward, run by eager kernels: quick to compile) where what matters is the mechanism.
"""

import logging
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.fx as fx

import poptorch_lite as poptorch
from poptorch_lite.compiler import compiled_stages
from poptorch_lite.errors import OptionsError

from models import BlockMLP, data, microbatch_seeds, reference_training, twin

STEPS = 20


@pytest.fixture
def every_stage_compiles(monkeypatch):
    """The test models are far below what pays for compiling: compile them anyway."""
    monkeypatch.setattr(compiled_stages, "PAYS_FROM", 0)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 for two zero tensors)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    scale = b.norm().item()
    return (a - b).norm().item() / scale if scale else (a - b).norm().item()


def compiled_opts(schedule, G, D, R=1, recompute=False, backend="inductor", sharded=False):
    strategy = poptorch.ShardedExecution() if sharded else poptorch.PipelinedExecution(
        schedule=schedule)
    opts = poptorch.Options().setExecutionStrategy(strategy).deviceIterations(D)
    opts.replicationFactor(R).set_ipu_devices("cpu").compileStages(True, backend)
    opts.Training.gradientAccumulation(G)
    if recompute:
        opts._Popart.set("autoRecomputation", 3)
    return opts


def program_of(wrapper):
    return next(iter(wrapper._state.programs.values()))


# -- the option -----------------------------------------------------------------------------

def test_the_option_is_off_by_default_and_refuses_an_unknown_backend():
    opts = poptorch.Options()
    assert (opts.compile_stages, opts.compile_backend) == (False, None)
    assert poptorch.Options().compileStages().compile_stages is True
    with pytest.raises(OptionsError, match=r"backend 'tvm' is not one of \['inductor', "
                                           r"'aot_eager', 'eager'\]"):
        opts.compileStages(True, backend="tvm")
    assert (opts.compile_stages, opts.compile_backend) == (False, None)  # nothing changed
    with pytest.raises(OptionsError, match="compileStages"):
        opts.compileStages("yes")


def test_the_option_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS",
                       '{"compile_stages": true, "compile_backend": "aot_eager"}')
    opts = poptorch.Options()
    assert (opts.compile_stages, opts.compile_backend) == (True, "aot_eager")


def test_off_the_stages_run_their_traced_graphs_eagerly():
    torch.manual_seed(0)
    model = BlockMLP(2)
    opts = poptorch.Options().set_ipu_devices("cpu")
    opts.Training.gradientAccumulation(4)
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    train(*data(8))
    program = program_of(train)
    assert program.compiled is None
    assert all(type(st.module).__mro__[1] is fx.GraphModule
               for st in program.executor.work.stages)


# -- the compiled column of the transparency matrix (Inductor) ------------------------------

COLUMN = [  # (schedule, recompute, replicas, sharded)
    ("grouped", False, 1, False), ("interleaved", True, 1, False),
    ("zero_bubble", False, 1, False), ("zero_bubble", True, 1, False),
    ("gpipe", False, 2, False), ("sequential", False, 1, True),
]


@pytest.mark.parametrize("schedule,recompute,R,sharded", COLUMN)
def test_compiled_training_matches_plain_pytorch_within_1e_4(schedule, recompute, R, sharded,
                                                            every_stage_compiles):
    """20 steps (two calls of deviceIterations 10) with dropout and BatchNorm: losses, every
    parameter and buffer and the optimizer state within 1e-4 relative of plain eager
    PyTorch seeded per micro-batch, so the dropout masks are plain PyTorch's."""
    torch.manual_seed(0)  # BatchNorm's buffers differ between replicas: not replicated
    model, G, D = BlockMLP(2, dropout=0.3, batchnorm=R == 1), 4, STEPS // 2
    ref = twin(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opts = compiled_opts(schedule, G // R if not sharded else G, D, R, recompute,
                         sharded=sharded).outputMode(poptorch.OutputMode.All)
    train = poptorch.trainingModel(model, opts, opt)
    for call in range(2):
        x, y = data(8 * G * D, seed=call)  # BatchNorm over 8 rows: over 2 it is ill-conditioned
        torch.manual_seed(10 + call)
        _, losses = train(x, y)
        torch.manual_seed(10 + call)
        seeds = microbatch_seeds(D, G)
        _, ref_losses, _ = reference_training(ref, ref_opt, x, y, D, G // R if not sharded
                                              else G, R if not sharded else 1, seeds=seeds)
        assert relative(losses.flatten(), torch.stack(ref_losses).flatten()) < 1e-4
    # compiled here, or by an earlier test of the column with the same stage graph
    assert set(program_of(train).compiled.summary().values()) <= {"compiled", "reused"}
    train.copyWeightsToHost()
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert relative(a, b) < 1e-4, name
    if R == 1:
        assert int(model.bn.num_batches_tracked) == G * STEPS
    for p, q in zip(model.parameters(), ref.parameters()):
        assert relative(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"]) < 1e-4


def test_compiled_inference_matches_plain_pytorch(every_stage_compiles):
    torch.manual_seed(0)
    model = BlockMLP(2, batchnorm=True).eval()
    opts = poptorch.Options().deviceIterations(3).set_ipu_devices("cpu").compileStages(True)
    x, y = data(12)
    out, loss = poptorch.inferenceModel(model, opts)(x, y)
    ref_out = torch.cat([model(x[k:k + 4], y[k:k + 4])[0] for k in range(0, 12, 4)])
    assert relative(out, ref_out) < 1e-5


# -- when a stage stays eager ---------------------------------------------------------------

def test_a_stage_too_small_to_pay_stays_eager_and_the_log_says_why(caplog):
    """The user guide's one Linear(6, 2): compiling cannot pay, so its stage runs the traced
    graph eagerly, bit-exact to the default path."""
    torch.manual_seed(0)
    model = BlockMLP(1)
    ref = twin(model)
    opts = poptorch.Options().set_ipu_devices("cpu").compileStages(True)
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    plain = poptorch.trainingModel(ref, poptorch.Options().set_ipu_devices("cpu"),
                                   torch.optim.SGD(ref.parameters(), lr=0.1))
    x, y = data(2)
    with caplog.at_level(logging.INFO, logger="poptorch_lite"):
        assert torch.equal(train(x, y)[1], plain(x, y)[1])
    assert program_of(train).compiled.summary() == {0: "eager"}
    (line,) = [r.getMessage() for r in caplog.records if "runs eagerly" in r.getMessage()]
    flops, made = compiled_stages.work(program_of(plain).executor.work.stages[0].module,
                                       _stage_args(plain, x, y))
    assert line.startswith(f"compileStages: stage 0 runs eagerly: its forward does {flops} "
                           f"FLOPs and makes {made} elements per micro-batch, under the "
                           f"{compiled_stages.PAYS_FROM} from which compiling pays")
    assert 0 < flops + made < compiled_stages.PAYS_FROM


def _stage_args(wrapper, x, y):
    """Stage 0's arguments for a one-stage BlockMLP (parameters, then the inputs)."""
    st = program_of(wrapper).executor.work.stages[0]
    params = dict(wrapper._state.model.named_parameters())
    values = {"input:0": x, "input:1": y}
    return tuple(values[n] if n.startswith("input:") else params[n.split(":", 1)[1]]
                 for n in st.inputs)


def test_a_stage_the_backend_refuses_runs_eagerly_and_the_log_names_it(
        monkeypatch, caplog, every_stage_compiles):
    """The refusal comes on the stage's first call, before any of its ops ran: the call's
    numbers are the eager path's, exactly, and the log names the stage and the reason."""
    def refusing(name, random):
        def compile_graph(gm, example_inputs):
            if any(n.target is torch.ops.aten.addmm.default and "layers_2" in str(n.args)
                   for n in gm.graph.nodes):
                raise NotImplementedError("no kernel for this graph")
            return gm.forward
        return compile_graph
    monkeypatch.setattr(compiled_stages, "_backend", refusing)
    torch.manual_seed(0)
    model = BlockMLP(2, batchnorm=True)
    ref = twin(model)
    opts = compiled_opts("grouped", 4, 2, backend="aot_eager")
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    plain_opts = poptorch.Options().deviceIterations(2).set_ipu_devices("cpu")
    plain_opts.Training.gradientAccumulation(4)
    plain = poptorch.trainingModel(ref, plain_opts, torch.optim.SGD(ref.parameters(), lr=0.1))
    x, y = data(16)
    with caplog.at_level(logging.INFO, logger="poptorch_lite"):
        assert torch.equal(train(x, y)[1], plain(x, y)[1])
    train.copyWeightsToHost()
    plain.copyWeightsToHost()
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        assert torch.equal(a, b)
    assert program_of(train).compiled.summary() == {0: "compiled", 1: "failed"}
    (line,) = [r for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert line.levelno == logging.WARNING
    assert line.getMessage().startswith(
        "compileStages: stage 1 runs eagerly: aot_eager could not compile its forward: "
        "NotImplementedError: no kernel for this graph")


# -- once -----------------------------------------------------------------------------------

def test_a_second_wrapper_reuses_the_compiled_stages_and_a_recompile_is_logged(
        monkeypatch, caplog, every_stage_compiles):
    compiles = []
    real = compiled_stages._backend

    def counting(name, random):
        inner = real(name, random)

        def compile_graph(gm, example_inputs):
            compiles.append(torch.is_grad_enabled())
            return inner(gm, example_inputs)
        return compile_graph
    monkeypatch.setattr(compiled_stages, "_backend", counting)
    compiled_stages.clear_cache()
    x, y = data(16)
    losses = []
    with caplog.at_level(logging.INFO, logger="poptorch_lite"):
        for k in range(2):
            torch.manual_seed(0)
            model = BlockMLP(2)
            opts = compiled_opts("grouped", 4, 2, backend="aot_eager")
            train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
            losses.append(train(x, y)[1])
            assert program_of(train).compiled.summary() == (
                {0: "compiled", 1: "compiled"} if k == 0 else {0: "reused", 1: "reused"})
            assert len(compiles) == 2  # one per stage graph, by the first wrapper only
        assert torch.equal(losses[0], losses[1])
        assert "stage 0 reused (aot_eager" in caplog.text
        # The same structure in inference: the training graphs again, without grad mode.
        infer = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(2)
                                        .set_ipu_devices("cpu").compileStages(True, "aot_eager"))
        infer(x[:4], y[:4])
        infer(x[:4], y[:4])
    assert compiles[2:] == [False, False]  # each stage graph recompiled once
    report = program_of(infer).compiled
    assert report.recompiles == 2 and report.summary() == {0: "reused", 1: "reused"}
    recompiled = [r.getMessage() for r in caplog.records if "recompiled" in r.getMessage()]
    assert len(recompiled) == 2
    assert recompiled[0].startswith("compileStages: stage ")
    assert "grad mode False" in recompiled[0]


def test_the_first_call_logs_what_it_compiled_and_later_calls_nothing(caplog,
                                                                      every_stage_compiles):
    compiled_stages.clear_cache()
    torch.manual_seed(0)
    model = BlockMLP(2)
    train = poptorch.trainingModel(model, compiled_opts("grouped", 4, 2, backend="aot_eager"),
                                   torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = data(16)
    with caplog.at_level(logging.INFO, logger="poptorch_lite"):
        train(x, y)
        first = [r.getMessage() for r in caplog.records if "compileStages" in r.getMessage()]
        caplog.clear()
        train(x, y)
    assert len(first) == 1
    assert first[0].startswith("compileStages: stage 0 compiled (aot_eager, ")
    assert ", stage 1 compiled (aot_eager, " in first[0]
    assert "compileStages" not in caplog.text


# -- the command line -----------------------------------------------------------------------

def test_the_command_line_compiles_an_unmodified_script(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import poptorch
        print(poptorch.Options().compile_stages, poptorch.Options().compile_backend)
    """))
    out = subprocess.run([sys.executable, "-m", "poptorch_lite", "run", "--compile",
                          str(script)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "None"]
    out = subprocess.run([sys.executable, "-m", "poptorch_lite", "run", "--compile",
                          "--compile-backend", "aot_eager", str(script)],
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "aot_eager"]
