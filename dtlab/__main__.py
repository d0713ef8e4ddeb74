"""``python -m dtlab doctor RUN_DIR`` / ``python -m dtlab report RUN_DIR``: :mod:`dtlab.cli`."""

import sys

from dtlab.cli import main

if __name__ == "__main__":
    sys.exit(main())
