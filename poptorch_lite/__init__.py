"""poptorch_lite: PopTorch's programming model on stock PyTorch.

``import poptorch_lite as poptorch`` and annotate, wrap and train as with
PopTorch. The flow of a call: annotations -> compiler (trace, partition) ->
runtime (placement, schedule, executor) -> wrapper; CONTRIBUTING.md maps the modules.
"""

from . import keras, optim
from . import ops_namespace  # registers torch.ops.poptorch.*
from .annotations import (BeginBlock, Block, BlockFunction, module_repr, recomputationCheckpoint,
                          removeBlocks)
from .checkpoint import CheckpointInfo, load_checkpoint, save_checkpoint
from .custom_args import ICustomArgParser, registerCustomArgParser
from .custom_ops import custom_op, register_custom_op
from .data import AsynchronousDataAccessor, DataLoader
from .distributed import is_main_process
from .enums import (AnchorMode, AutoStage, CommGroupType, ConnectionType, DataLoaderMode,
                    HalfFloatCastingBehavior, MultiConvPlanType, Liveness, MatMulSerializationMode,
                    MeanReductionStrategy, OutputMode, OverlapMode, PipelineSchedule, ReductionType,
                    SharingStrategy, SyncPattern, VariableRetrievalMode)
from .errors import (BatchSizeError, BlockError, ChannelError, CheckpointError, ConfigFileError,
                     CustomOpError,
                     DataLoaderError, DeviceError, Error, ExecutionError, FrozenOptionsError,
                     InputError, IpuOnlyWarning, LossError, OfflineDeviceError, OptimizerError,
                     OptionsAssertionError, OptionsError,
                     PipelineError, PoptorchLiteWarning, RecoverableError, ScheduleError,
                     TraceError, UnknownAttributeError, UnrecoverableError, WrapError)
from .frontends import (BalancePlan, IPUInfeedQueue, IPUOutfeedQueue, OptimizerFunctionOutput,
                        balance_by_time, pipeline,
                        print_pipeline_stage_assignment_summary, set_pipeline_stage_assignment,
                        split_at, stage_summary)
from .ops import (Attribute, MultiConv, NameScope, for_loop, identity_loss, ipuHardwareIsAvailable,
                  ipuHardwareVersion, ipu_print_tensor, isRunningOnIpu, nop, serializedMatMul,
                  setLogLevel, set_available_memory, set_overlap_for_input, set_overlap_for_output)
from .options import Options, TensorLocationSettings, combined_batch_size
from .phases import ParallelPhasedExecution, Phase, SerialPhasedExecution
from .strategies import ExecutionStrategy, PipelinedExecution, ShardedExecution, Stage
from .wrap import inferenceModel, load, trainingModel
from .wrapper import PoplarExecutor

__version__ = "0.1.0"

__all__ = [
    "AnchorMode", "AsynchronousDataAccessor", "Attribute", "AutoStage", "BatchSizeError", "BeginBlock", "Block",
    "BalancePlan", "BlockError", "BlockFunction", "ChannelError", "CheckpointError", "CheckpointInfo", "CommGroupType",
    "ConfigFileError", "ConnectionType", "CustomOpError", "DataLoader", "DataLoaderError", "DataLoaderMode",
    "DeviceError", "Error", "ExecutionError", "ExecutionStrategy", "FrozenOptionsError",
    "HalfFloatCastingBehavior", "ICustomArgParser", "IPUInfeedQueue", "IPUOutfeedQueue", "InputError",
    "IpuOnlyWarning", "MultiConvPlanType", "Liveness", "LossError", "MatMulSerializationMode",
    "MeanReductionStrategy", "MultiConv", "NameScope", "OfflineDeviceError", "OptimizerError",
    "OptimizerFunctionOutput", "OptionsAssertionError",
    "Options", "OptionsError", "OutputMode", "OverlapMode", "ParallelPhasedExecution", "Phase",
    "PipelineError", "PipelineSchedule", "PipelinedExecution", "PoplarExecutor",
    "PoptorchLiteWarning", "RecoverableError", "ReductionType", "ScheduleError",
    "SerialPhasedExecution", "ShardedExecution", "SharingStrategy", "Stage", "SyncPattern",
    "TensorLocationSettings", "TraceError", "VariableRetrievalMode", "UnknownAttributeError", "UnrecoverableError",
    "WrapError", "balance_by_time", "combined_batch_size", "custom_op", "for_loop", "identity_loss",
    "inferenceModel",
    "ipuHardwareIsAvailable", "ipuHardwareVersion", "ipu_print_tensor", "isRunningOnIpu",
    "is_main_process", "keras", "load",
    "load_checkpoint", "module_repr", "nop", "optim", "pipeline", "print_pipeline_stage_assignment_summary",
    "recomputationCheckpoint", "registerCustomArgParser", "register_custom_op", "removeBlocks", "save_checkpoint", "serializedMatMul",
    "setLogLevel", "set_available_memory", "set_overlap_for_input", "set_overlap_for_output",
    "set_pipeline_stage_assignment", "split_at", "stage_summary", "trainingModel",
]
