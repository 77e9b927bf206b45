"""`python -m workers.cli`: the `das` command without its console script."""

import sys

from workers.cli import main

sys.exit(main())
