"""``python -m tokenmesh``: the same as the ``tokenmesh`` command."""

import sys

from tokenmesh.cli import main

sys.exit(main())
