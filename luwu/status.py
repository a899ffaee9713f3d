"""``python -m luwu.status status|top ...``: the same as ``luwu status|top`` (kept for scripts).

The work is done by :mod:`luwu.ops.monitor`; the command line is :mod:`luwu.cli.status`
and :mod:`luwu.cli.top`.
"""

import sys

from luwu.cli import main

if __name__ == "__main__":
    sys.exit(main())
