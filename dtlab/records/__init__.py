"""Everything that travels between the ranks and the notebook, or is stored, in one place.

Records are frozen dataclasses of plain data (str, int, float, tuples, dicts of str): they
pickle cheaply through ipyparallel, read back from JSON, and tests build them by hand
without a cluster. This package imports neither torch nor any notebook library, so both
ends (agent/ on the ranks, control/ and analysis/ in the notebook) share it. It starts no
thread: a live Trace's run folder is written by the notebook's
:mod:`dtlab.control.run_folder_writer`, through the ``FolderSink`` it is given.

========================  ==================================================================
module                    holds
========================  ==================================================================
``records.ranks``         an engine's facts, a rank's plan and self-description, cell output
``records.steps``         what a rank measures each optimizer step; conditions, run results
``records.wire``          the protocol between notebook and ranks: envelope, messages, relay
                          framing, sidecar messages, agreement cadence
``records.words``         ``Word``: the base of enums of words (str, written as its text)
``records.findings``      the doctor's evidence, each check's verdict, its findings
``records.hangs``         what a rank's sidecar says it is doing (stack, collectives)
``records.scripts``       where a user's own script stands on every rank
``records.stages``        a pipeline job's per-stage reports, block costs, schedule events
``records.plans``         pipeline partition plans (which blocks each stage holds)
``records.row``           one step record as a fixed-layout numpy row (``ROW``)
``records.packed``        a batch of step records as binary rows: the wire's frames
``records.rank_records``  a rank's records, made into objects only when read
``records.columns``       every rank's rows as columns (what the doctor reads)
``records.summaries``     one row per step across ranks (the steps a Trace's window left)
``records.step_files``    a run folder's rows as Parquet parts
``records.trace``         a job's step records by rank, in memory (a window of steps)
``records.run_folder``    a Trace's run folder: its format, header, reader; ``FolderSink``
``records.checkpoints``   checkpoint folders on disk: names, manifest, checksums, catalogue
========================  ==================================================================

The dataclasses are re-exported here (``from dtlab.records import StepRecord``);
``trace``, ``run_folder`` and ``checkpoints`` are imported as modules.
"""

from __future__ import annotations

from dtlab.records.findings import CheckResult, Evidence, Finding
from dtlab.records.hangs import CollectiveCall, HangReport, HangVerdict, RankReport
from dtlab.records.plans import Plan, PlanError
from dtlab.records.ranks import CellOutput, EngineFacts, RankInfo, RankPlan, RemoteFailure
from dtlab.records.scripts import ScriptStatus
from dtlab.records.stages import BlockCost, ScheduleEvent, StageReport
from dtlab.records.steps import (
    Condition,
    DeepSpeedInfo,
    InitialState,
    JobInfo,
    MeshInfo,
    ParamInfo,
    RunResult,
    StepMemory,
    StepRecord,
    StepTimes,
    combine_fingerprints,
    step_record_from_dict,
    step_record_to_dict,
)

__all__ = [
    "BlockCost",
    "CellOutput",
    "CheckResult",
    "CollectiveCall",
    "Condition",
    "EngineFacts",
    "Evidence",
    "Finding",
    "HangReport",
    "HangVerdict",
    "InitialState",
    "DeepSpeedInfo",
    "JobInfo",
    "MeshInfo",
    "ParamInfo",
    "Plan",
    "PlanError",
    "RankInfo",
    "RankPlan",
    "RankReport",
    "RemoteFailure",
    "RunResult",
    "ScheduleEvent",
    "ScriptStatus",
    "StageReport",
    "StepMemory",
    "StepRecord",
    "StepTimes",
    "combine_fingerprints",
    "step_record_from_dict",
    "step_record_to_dict",
]
