"""The tutorials' faces besides PopTorch's, built on ``trainingModel`` / ``inferenceModel``.

One module per face: ``splits`` (the stage-assignment helpers of the Keras and
TF1 tutorials), ``balance`` (stages balanced by measured time), ``tf1`` (TF1's pipeline of stage functions, with ``tf1_stages``, ``tf1_feeds``
and the shared ``dry_run``) and ``keras`` (with
``keras_ipu``, ``keras_data``, ``keras_losses`` and ``keras_callbacks``; public as
``poptorch_lite.keras``). Each face only builds PopTorch-face objects: one engine, the
same numbers.
"""

from .balance import BalancePlan, balance_by_time
from .splits import (print_pipeline_stage_assignment_summary, set_pipeline_stage_assignment,
                     split_at, stage_summary)
from .tf1 import Pipeline, pipeline
from .tf1_feeds import IPUInfeedQueue, IPUOutfeedQueue, OptimizerFunctionOutput

__all__ = ["BalancePlan", "IPUInfeedQueue", "IPUOutfeedQueue", "OptimizerFunctionOutput", "Pipeline", "pipeline",
           "balance_by_time", "print_pipeline_stage_assignment_summary",
           "set_pipeline_stage_assignment", "split_at", "stage_summary"]
