"""Magics for a job started by ``torchrun ... -m dtlab.run`` (control/connect.py).

%dt_connect RUN_DIR     # connect to the running job (read-only once it has ended): `dt`
%dt_disconnect          # continue it if paused, leave it running
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from dtlab.control import connect
from dtlab.views.magic_support import dtlab_magics, seconds


@dtlab_magics
class ConnectMagics(Magics):
    @line_magic
    @magic_arguments()
    @argument("run_dir", help="the job folder dtlab.run printed (runs/<script>-<time>/)")
    @argument("--timeout", type=seconds, default=connect.CONNECT_TIMEOUT_S, help="seconds to wait")
    @argument(
        "--lease",
        type=seconds,
        default=connect.LEASE_S,
        help="seconds after which a job this notebook paused goes on, should it stop answering",
    )
    def dt_connect(self, line):
        """Connect to a job started by `torchrun ... -m dtlab.run` and bind it to `dt`:
        dt.pause(), dt.step(n), dt.run_code(code), dt.continue_(), dt.doctor(), dt.trace."""
        from dtlab import cli

        args = parse_argstring(self.dt_connect, line)
        try:
            job = connect.connect(args.run_dir, timeout=args.timeout, lease_s=args.lease)
        except connect.ConnectError as e:
            raise UsageError(str(e)) from None
        try:
            for text in cli.describe(cli.load(str(job.folder))):  # hang reports first
                print(text)
        except ValueError as e:
            print(f"(its records cannot be read yet: {e})")
        self.shell.user_ns["dt"] = job
        print(repr(job))
        return None

    @line_magic
    def dt_disconnect(self, line):
        """Continue the connected job if it is paused, and leave it running."""
        job = connect.current_or_none()
        if job is None:
            print("not connected to a job; nothing to leave")
            return
        job.disconnect()
        print(f"disconnected; the job in {job.folder} runs on")
