"""Magics for the communication of the live ranks.

%dt_bandwidth                          # all_reduce sweep 1 KiB .. 16 MiB, x4 (nccl-tests style)
%dt_bandwidth --min 8 --max 64M --label "after NCCL_ALGO=Ring"
%dt_bandwidth --compare                # every sweep so far on one figure (A/B of settings)
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from dtlab.analysis.bandwidth import DTYPE_NAMES, compare_sweeps
from dtlab.views.bandwidth_views import bandwidth_figure, bandwidth_table
from dtlab.views.magic_support import current_session, dtlab_magics

UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """``8``, ``1K``, ``16M``, ``1G`` (binary units) -> bytes; UsageError otherwise."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    number, unit = (text[:-1], text[-1]) if text[-1:] in UNITS and text[-1:] else (text, "")
    try:
        value = float(number) * UNITS[unit]
    except ValueError:
        raise UsageError(f"cannot read the size {text!r}: write e.g. 8, 1K, 16M") from None
    if value < 1:
        raise UsageError(f"a size must be at least 1 byte, got {text!r}")
    return int(value)


@dtlab_magics
class CommMagics(Magics):
    @line_magic
    @magic_arguments()
    @argument("--min", default="1K", help="smallest message per rank (default 1K)")
    @argument("--max", default="16M", help="largest message per rank (default 16M)")
    @argument("--factor", type=int, default=4, help="size step (default 4)")
    @argument("--iters", type=int, default=20, help="timed all_reduces per size (default 20)")
    @argument("--dtype", default="float32", choices=DTYPE_NAMES, help="element type")
    @argument("--label", default=None, help="name of this sweep (e.g. the setting under test)")
    @argument("--compare", action="store_true", help="plot every sweep so far; run none")
    def dt_bandwidth(self, line):
        """All_reduce time and bus bandwidth per message size on the live ranks."""
        args = parse_argstring(self.dt_bandwidth, line)
        dt = current_session()
        if args.compare:
            if not dt.sweeps:
                raise UsageError("no sweep yet: run %dt_bandwidth first")
            for sweep in dt.sweeps[1:]:
                try:
                    print(compare_sweeps(dt.sweeps[0], sweep))
                except ValueError as e:  # swept other sizes: the figure still shows both
                    print(f"{sweep.label} vs {dt.sweeps[0].label}: {e}")
            return bandwidth_figure(dt.sweeps)
        sweep = dt.bandwidth_sweep(
            min_bytes=parse_size(args.min),
            max_bytes=parse_size(args.max),
            factor=args.factor,
            iters=args.iters,
            dtype=args.dtype,
            label=args.label,
        )
        display(bandwidth_table(sweep))
        return bandwidth_figure([sweep])
