"""Magics for checkpoints of the attached job.

%dt_checkpoint                   # save the full state now (every rank writes its part)
%dt_checkpoint --every 50        # and every 50 steps during runs (--every 0 stops)
%dt_checkpoint --list [--verify] # the catalogue: complete, partial or corrupt
%dt_checkpoint --load 40         # rewind the job to step 40 (or "latest")
%dt_checkpoint --to s3://b/p     # save this one to another root (a folder or a bucket)
%dt_resume_check [--steps 10] [--same-engines]   # does resuming match going on?
%dt_replay FROM [TO]             # re-run steps from a checkpoint and compare
%dt_bisect GOOD BAD              # the first step (and module) whose outcome differs
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from dtlab.views.magic_support import current_session, dtlab_magics
from dtlab.views.progress import delayed_progress
from dtlab.views.reports import checkpoints_table, replay_summary


def which_checkpoint(text: str):
    """``latest`` | a step | a folder | ``none`` (None: no checkpoint) as the API takes it."""
    if text in ("latest", "none"):
        return None if text == "none" else text
    try:
        return int(text)
    except ValueError:
        return text  # a folder path


@dtlab_magics
class CheckpointMagics(Magics):
    @line_magic
    @magic_arguments()
    @argument(
        "--every",
        type=int,
        default=None,
        metavar="K",
        help="also save every K steps during runs (0 stops)",
    )
    @argument("--list", action="store_true", help="list the checkpoints instead of saving")
    @argument("--verify", action="store_true", help="with --list: read every file's checksum")
    @argument(
        "--load",
        default=None,
        metavar="STEP",
        help="rewind the job to the checkpoint of STEP, 'latest', or a folder",
    )
    @argument("--tag", default=None, help="a label kept in the manifest")
    @argument(
        "--to",
        default=None,
        metavar="ROOT",
        help="save this checkpoint under ROOT (a folder or s3://bucket/prefix)",
    )
    @argument(
        "--mirror",
        default=None,
        metavar="URL",
        help="copy every checkpoint under the (local) root to URL (s3://bucket/prefix) in "
        "the background from now on ('off' stops)",
    )
    def dt_checkpoint(self, line):
        """Save the job's full state on every rank (model, optimizer, scheduler, scaler,
        RNGs, data position, step), list the checkpoints, or load one."""
        args = parse_argstring(self.dt_checkpoint, line)
        session = current_session()
        if args.every is not None and args.every < 0:
            raise UsageError(f"--every takes a number of steps >= 0, got {args.every}")
        chosen = [
            flag
            for flag, on in (
                ("--list/--verify", args.list or args.verify),
                ("--load", args.load is not None),
                ("--every", args.every is not None),
                ("--tag/--to", args.tag is not None or args.to is not None),
                ("--mirror", args.mirror is not None),
            )
            if on
        ]
        if len(chosen) > 1:
            raise UsageError(
                f"{' and '.join(chosen)} do different things: use one at a time "
                "(--tag labels a save: %dt_checkpoint --tag NAME)"
            )
        if args.list or args.verify:
            display(checkpoints_table(session.checkpoints(verify=args.verify)))
            return
        if args.load is not None:
            loaded = session.load_checkpoint(which_checkpoint(args.load))
            print(
                f"job rewound to step {loaded['step']} from {loaded['path']}; restored "
                f"{', '.join(loaded['restored'])}"
            )
            for note in dict.fromkeys(n for r in loaded["ranks"].values() for n in r["notes"]):
                print(f"note: {note}")
            return
        if args.mirror is not None:
            session.checkpoint_mirror = None if args.mirror == "off" else args.mirror
            if session.mirror is None:
                print("no mirror: checkpoints stay in the local root only")
            else:
                print(
                    f"mirroring every checkpoint under {session.checkpoint_root} to "
                    f"{session.checkpoint_mirror} in the background (dt.mirror.status(); "
                    "%dt_checkpoint --list says which are local, mirrored or both)"
                )
            return
        if args.every is not None:
            session.checkpoint_every(args.every)
            print(f"saving every {args.every} steps" if args.every else "periodic saves off")
            return
        saved = session.checkpoint(tag=args.tag, to=args.to)
        print(
            f"checkpoint of step {saved.step}: {saved.where} "
            f"({saved.size_bytes / 2**20:.1f} MiB, ranks {list(saved.ranks)})"
        )

    @line_magic
    @magic_arguments()
    @argument("--steps", type=int, default=10, help="steps to run after the save (default 10)")
    @argument(
        "--same-engines",
        action="store_true",
        help="restore into the live engines instead of fresh ones",
    )
    def dt_resume_check(self, line):
        """Save now, run on, restore into fresh engines, run the same steps, and compare
        every step: "identical", or the first thing that differs and why."""
        args = parse_argstring(self.dt_resume_check, line)
        if args.steps < 1:
            raise UsageError(f"--steps must be at least 1, got {args.steps}")
        report = current_session().resume_check(
            args.steps, fresh=not args.same_engines, progress=delayed_progress()
        )
        print(report.summary())
        return report

    @line_magic
    @magic_arguments()
    @argument("first", type=int, help="first step to re-run")
    @argument("last", type=int, nargs="?", default=None, help="last step (default: the latest)")
    def dt_replay(self, line):
        """Re-run steps from the newest checkpoint before them and compare with the run."""
        args = parse_argstring(self.dt_replay, line)
        result = current_session().replay(args.first, args.last)
        print(replay_summary(result))
        return result

    @line_magic
    @magic_arguments()
    @argument("good", type=int, help="a step known good (a checkpoint at or before it)")
    @argument("bad", type=int, help="a step known bad")
    @argument(
        "--against",
        default="replay",
        choices=("replay", "ranks"),
        help="compare the run with its replay (default) or the ranks",
    )
    def dt_bisect(self, line):
        """The first step after GOOD whose outcome differs, and within it the module."""
        args = parse_argstring(self.dt_bisect, line)
        found = current_session().bisect(args.good, args.bad, against=args.against)
        print(found.verdict if found.step else f"no difference: {found.verdict}")
        return found
