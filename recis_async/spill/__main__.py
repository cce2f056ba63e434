"""``python -m recis_async.spill``: the command of :mod:`recis_async.trace.spill.__main__`."""

import sys

from ..trace.spill.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
