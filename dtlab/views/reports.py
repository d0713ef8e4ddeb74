"""Text and tables for the attached job: what a run did, what the analysis found."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dtlab.analysis.conditions import describe_condition
from dtlab.analysis.evidence import ranked
from dtlab.analysis.ranks import label_ranks
from dtlab.records import Finding, JobInfo, RunResult, ScriptStatus
from dtlab.views.tables import Table


def job_summary(infos: Mapping[int, JobInfo]) -> str:
    info = infos[min(infos)]
    if len({i.params for i in infos.values()}) > 1:  # one pipeline stage per rank
        from dtlab.views.partition_tables import pipeline_summary

        return pipeline_summary(infos)
    numel = sum(p.numel for p in info.params)
    wrapped = f"{info.wrapper}({info.model})" if info.wrapper else info.model
    extras = [x for x in (info.scheduler, "GradScaler" if info.scaler else None) if x]
    record = "per-parameter recording on" if info.record else "recording off"
    return (
        f"attached on {label_ranks(infos)}: {wrapped}, {len(info.params)} parameters "
        f"({numel:,} values), {info.optimizer}{''.join(', ' + x for x in extras)}; {record}"
    )


def script_summary(status: ScriptStatus) -> str:
    """Where the script stopped on the ranks, and what dtlab did for it."""
    name = status.path.rsplit("/", 1)[-1]
    lines = []
    if status.paused:
        wrapped = status.wrapper and status.wrapper not in status.optimizers  # a DeepSpeedEngine
        model = f"{status.wrapper}({status.model})" if wrapped else status.model
        took = f" after {status.setup_s:.1f} s of set-up" if status.setup_s is not None else ""
        lines.append(
            f"{name} paused on {label_ranks(status.states)} at step 0{took}: about to make "
            f"its first optimizer step ({', '.join(status.optimizers)} on {model}); "
            "%dt_step N runs its next steps, %dt_continue to its end, and %%dt cells see "
            "its globals as `script`"
        )
    else:
        lines.extend(_script_endings(status, name))
    lines.extend(f"note: {n}" for n in status.notes)
    return "\n".join(lines)


def _script_endings(status: ScriptStatus, name: str) -> list[str]:
    by_end: dict[str, list[int]] = {}
    for rank, outcome in status.outcomes.items():
        o = outcome or {}
        if o.get("kind") == "exited":
            what = f"exited with code {o.get('code')}" + (
                f" ({o['evalue']})" if o.get("evalue") else ""
            )
        elif o.get("kind") == "failed":
            what = f"failed: {o.get('ename')}: {o.get('evalue')} ({status.where(rank)})"
        else:
            what = "finished"
        by_end.setdefault(what, []).append(rank)
    lines = [
        f"{name} {what} on {label_ranks(ranks)} after {status.steps[ranks[0]]} optimizer steps"
        for what, ranks in by_end.items()
    ]
    if not any(status.steps.values()):
        calls = (
            status.backward_calls.get(min(status.backward_calls), 0) if status.backward_calls else 0
        )
        lines.append(
            f"it never called optimizer.step() ({calls} backward() calls): there was "
            "no step for dtlab to pause at"
        )
    return lines


def run_summary(result: RunResult, trace) -> str:
    """One line: how many steps, how fast, how it stopped, the loss spread at the end."""
    n = result.num_steps
    per_step = f" ({result.seconds / n * 1e3:.1f} ms/step)" if n else ""
    line = f"steps {result.first_step + 1}-{result.last_step} in {result.seconds:.2f} s{per_step}"
    if n == 1:
        line = f"step {result.last_step} in {result.seconds * 1e3:.1f} ms"
    if result.stopped == "until":
        where = label_ranks(result.hit_ranks) if result.hit_ranks else "the ranks"
        line += f"; stopped: {describe_condition(result.condition)} on {where}"
    elif result.stopped == "pause":
        line += "; paused (every rank stopped after the same step)"
    elif result.stopped == "timeout":
        line += "; timed out: every rank paused after the same step"
    elif result.stopped == "ended":
        line += "; the script ended (run %dt_script again for another run)"
    elif result.condition is not None:
        line += f"; {describe_condition(result.condition)} never held"
    losses = {r: rec.loss for r, rec in trace.at(result.last_step).items()} if trace else {}
    return line + _loss_part(losses, trace)


def _loss_part(losses: dict[int, float], trace) -> str:
    """The ranks' losses at the last step: their range, one value when they agree, and
    for a pipeline the last stage's (the only stage that computes it)."""
    if not losses:
        return ""
    stages = {tuple(p.name for p in job.params) for job in trace.jobs.values()}
    if len(stages) > 1:  # one stage per rank: the loss is the last stage's
        last = max(losses)
        return f"; loss {losses[last]:.4g} (last stage, rank {last})"
    low, high = min(losses, key=losses.get), max(losses, key=losses.get)
    if losses[low] == losses[high] or len(losses) == 1:
        return f"; loss {losses[low]:.4g}" + (" on every rank" if len(losses) > 1 else "")
    return f"; loss {losses[low]:.4g} (rank {low}) .. {losses[high]:.4g} (rank {high})"


def findings_table(findings: Sequence[Finding]) -> Table:
    rows = tuple(
        (f.severity, f.kind, label_ranks(f.ranks), _since_column(f), f.summary, f.fix)
        for f in findings
    )
    notes = () if findings else ("no problem found in the records so far",)
    headers = ("severity", "kind", "ranks", "since step", "what", "fix")
    return Table("findings", headers, rows, notes)


def doctor_summary(results: Sequence, *, reasons: bool = True, named: bool = False) -> str:
    """How many checks passed, found something or could not look, then the findings
    ranked, most severe first. "every check passed" only when every check looked;
    ``named``: a problem was named above (a hang, a death), so none is "no problem". The
    checks that could not look follow, those sharing a reason in one line (a pipeline's
    five checks of replicas); ``reasons=False`` names them only (a table says why).
    One line per item: ``wrapped`` fits it to a width."""
    findings = ranked([f for r in results for f in r.findings])
    passed = [r for r in results if r.outcome == "passed"]
    unchecked = [r for r in results if r.outcome == "not checked"]
    found = [r for r in results if r.outcome == "found"]
    counts = ", ".join(
        part
        for part in (
            f"{len(found)} found something" if found else "",
            f"{len(passed)} passed" if passed else "",
            f"{len(unchecked)} not checked" if unchecked else "",
        )
        if part
    )
    lines = []
    none = "no other problem in the step records" if named else "no problem found"
    if not findings and not unchecked:
        lines.append(f"{none}: every check passed ({counts}; --explain shows what each looked at)")
    elif not findings:
        lines.append(f"{none} in what could be checked: {counts}")
    else:
        lines.append(f"{len(findings)} finding(s) ({counts}), most severe first:")
        for number, f in enumerate(findings, 1):
            lines.append(f"{number}. [{f.severity}] {f.summary}{_since(f)}")
    for r in results:
        if r.check == "earlier_steps":  # a long run: the window has moved
            lines.append(f"earlier steps: read from {r.looked_at}")
    if unchecked and not reasons:
        names = ", ".join(r.check for r in unchecked)
        lines.append(f"not checked: {names} (the table below says why)")
    elif unchecked:
        for group in unchecked_groups(unchecked):
            lines.append(f"not checked: {', '.join(group.checks)}: {group.because}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Unchecked:
    """Checks that could not look for one reason (``%dt_doctor`` says it once)."""

    checks: tuple[str, ...]  # in report order
    why: str  # the reason, without "not checked: "
    needs: str  # what would let them look, or ""
    looked_at: str  # what they read (the same for all, or "")

    @property
    def because(self) -> str:
        return self.why + (f" (to check: {self.needs})" if self.needs else "")


def unchecked_groups(results: Sequence) -> list[Unchecked]:
    """The checks of ``results`` that could not look, grouped by their reason and what
    would let them look, each group where its first check stands."""
    groups: dict[tuple[str, str], list] = {}
    for r in results:
        if r.outcome == "not checked":
            groups.setdefault((_why_not(r), r.needs), []).append(r)
    return [
        Unchecked(
            tuple(r.check for r in members),
            why,
            needs,
            members[0].looked_at if len({r.looked_at for r in members}) == 1 else "",
        )
        for (why, needs), members in groups.items()
    ]


def _why_not(result) -> str:
    return result.passed_because.removeprefix("not checked: ")


def _since(f: Finding) -> str:
    """When it began, unless the summary says: a step, or launch for the environment."""
    if f.step is None:
        return " (from launch)" if f.kind == "environment" else ""
    return "" if f"step {f.step}" in f.summary else f" (since step {f.step})"


def _since_column(f: Finding) -> str:
    if f.step is None:
        return "launch" if f.kind == "environment" else "-"
    return str(f.step)


def checks_table(results: Sequence) -> Table:
    """What each check read, and its verdict or why it passed (``%dt_doctor --explain``).
    Checks that could not look for the same reason share one row (a pipeline's checks
    of replicas), where the first of them stands."""
    groups = {group.checks[0]: group for group in unchecked_groups(results)}
    grouped = {name for group in groups.values() for name in group.checks}
    rows = []
    for r in results:
        if r.check in groups:
            g = groups[r.check]
            rows.append((", ".join(g.checks), "not checked", g.looked_at, g.because))
        elif r.check not in grouped:
            why = (
                "; ".join(f.summary for f in r.findings)
                if r.findings
                else r.passed_because + (f" (to check: {r.needs})" if r.needs else "")
            )
            rows.append((r.check, r.verdict, r.looked_at, why))
    return Table("checks", ("check", "verdict", "looked at", "why"), tuple(rows))


def checkpoints_table(infos: Sequence) -> Table:
    """``dt.checkpoints()`` as a table: complete ones, and what is wrong with the others;
    with a mirror, where each one is and how its copy stands."""
    mirrored = any(c.copies for c in infos)
    rows = tuple(
        (
            str(c.step),
            c.status,
            "-" if c.loss is None else f"{c.loss:.4f}",
            f"{c.size_bytes / 2**20:.1f} MiB",
            label_ranks(c.ranks) if c.ranks else "-",
            c.tag or "",
            c.path.name,
            *((c.copies or "", c.mirror or "") if mirrored else ()),
            c.problem or "",
        )
        for c in infos
    )
    notes = () if infos else ("no checkpoint yet: %dt_checkpoint saves one",)
    headers = ("step", "status", "loss", "size", "written by", "tag", "folder")
    headers += ("copies", "mirror") if mirrored else ()
    return Table("checkpoints", (*headers, "problem"), rows, notes)


def replay_summary(result) -> str:
    """One paragraph for ``dt.replay``: identical or where it first differs, and speed."""
    head = (
        f"replayed steps {result.first_step}-{result.last_step} from the checkpoint of "
        f"step {result.checkpoint.step}: "
    )
    text = head + (
        "identical to the original run" if result.identical else result.comparison.summary()
    )
    if result.original_step_s and result.replay_step_s:
        ratio = result.replay_step_s / result.original_step_s
        text += (
            f" (median step {result.replay_step_s * 1e3:.1f} ms, the original "
            f"{result.original_step_s * 1e3:.1f} ms: {ratio:.2f}x)"
        )
    return text


def hang_table(report) -> Table:
    """``dt.hang_report()`` per rank: step, where it is, the last collectives it entered."""
    rows = []
    for rank in sorted(set(report.reports) | set(report.dead)):
        rep = report.reports.get(rank)
        calls = rep.collectives if rep else ()
        last = [c for c in calls if c.group == "default_pg"][-1:] + [
            c for c in calls if not c.done and c.group != "default_pg"
        ][-1:]
        shown = (
            "; ".join(
                f"{c.op} #{c.seq} on {c.group} {'done' if c.done else 'WAITING'}" for c in last
            )
            or "-"
        )
        step = "-" if rep is None or rep.step is None else str(rep.step)
        rows.append((str(rank), step, report.verdict.where.get(rank, "?"), shown))
    notes = (report.verdict.summary,)
    return Table(
        "what every rank is doing", ("rank", "step", "where", "collectives"), tuple(rows), notes
    )


def restart_summary(world_size: int, event: dict) -> str:
    """One restart (``dt.restart``, or an automatic one): where the job is now."""
    if event.get("rerun"):
        return _rerun_summary(world_size, event)
    where = (
        f"step {event['step']} from {event['checkpoint']}"
        if event["checkpoint"]
        else "step 0 (no checkpoint)"
    )
    return f"restarted {world_size} ranks in {event['seconds']:.1f} s; the job is at {where}"


def _rerun_summary(world_size: int, event: dict) -> str:
    """A script job's restart: run again to its step, and whether its weights got there."""
    resumed = event.get("resumed_at") or 0
    if resumed and resumed >= event["step"]:  # its checkpoint is past what dtlab had heard
        return (
            f"restarted {world_size} ranks in {event['seconds']:.1f} s; the script ran again "
            f"and resumed itself from its checkpoint at step {resumed} (DeepSpeed's "
            f"load_checkpoint), past step {event['step']}, the last step every rank had "
            "reported before the failure: not compared with the first run (the run again made "
            f"no step both runs recorded); the job is at step {resumed}"
        )
    line = f"restarted {world_size} ranks in {event['seconds']:.1f} s; the script ran again" + (
        f", resumed itself from its checkpoint at step {resumed} (DeepSpeed's load_checkpoint) "
        f"and went on to step {event['step']}"
        if resumed
        else f" to step {event['step']}"
    )
    if event["differ"]:
        cause = (
            "its checkpoint did not bring back everything the steps after it read"
            if resumed
            else "the script is not deterministic (or read something that changed)"
        )
        why = f" ({event['why']})" if event.get("why") else ""
        hint = "; %dt_resume_check names what" if resumed else ""
        return (
            f"{line}, but its parameters differ from the first run's there on "
            f"{label_ranks(event['differ'])}: {cause}{why}{hint}; the job is at that step anyway"
        )
    if event["compared"]:
        return f"{line}: its parameters are bit for bit those of the first run"
    return f"{line} (not compared with the first run: it was not recorded at that step)"


def held_summary(step: int, trace) -> str:
    """A connected job just held: where, and the ranks' losses there."""
    losses = {r: rec.loss for r, rec in trace.at(step).items()} if len(trace) else {}
    return f"every rank paused after step {step}" + _loss_part(losses, trace)


def connected_stacks(stacks: dict[int, str], frames: int = 12) -> str:
    """Where each rank of a connected job is: its script's thread (the main one), the
    innermost ``frames`` frames; ranks at the same place said once."""
    by_place: dict[str, list[int]] = {}
    for rank, text in sorted(stacks.items()):
        by_place.setdefault(_held_or_running(text, frames), []).append(rank)
    return "\n".join(f"{label_ranks(ranks)}:\n    {place}" for place, ranks in by_place.items())


def _held_or_running(text: str, frames: int) -> str:
    """A held rank's script stack (agent/batch_engine.py stacks(): "Script held after
    step N ...", most recent call last), its innermost frames; else the main thread's."""
    if not text.startswith("Script held after step"):
        return script_stack(text, frames)
    lines = text.split("\n\n", 1)[0].splitlines()
    return "\n    ".join([lines[0], *lines[1:][-2 * frames :]])


def script_stack(stacks: str, n: int = 8) -> str:
    """The innermost frames of the main thread, where the script runs: faulthandler lists
    threads newest first, so it is the last (after the watchdog's own, the engine's, ...),
    and "Current thread" when a fatal signal came on it."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stacks)[1:]
    if not blocks:
        return last_lines(stacks, n)
    lines = blocks[-1].strip().split("\n\n")[0].splitlines()  # (not what follows it)
    return "\n    ".join(lines[: n + 1])


def last_lines(text: str, n: int) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n    ".join(lines[-n:])
