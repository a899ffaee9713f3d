"""``python -m luwu.launcher up|down ...``: the same as ``luwu up|down`` (kept for scripts).

The work is done by :mod:`luwu.ops.daemons` (start, wait, stop), :mod:`luwu.ops.supervisor`
and :mod:`luwu.ops.rundir`; the command line is :mod:`luwu.cli.updown`.
"""

import sys

from luwu.cli import main

if __name__ == "__main__":
    sys.exit(main())
