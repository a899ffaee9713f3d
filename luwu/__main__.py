"""``python -m luwu``: the ``luwu`` command."""

import sys

from luwu.cli import main

sys.exit(main())
