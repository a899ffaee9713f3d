import sys

from luwu.cli import main

sys.exit(main())
