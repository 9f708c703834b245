"""``python -m feedline ARGS`` is the ``feedline`` command."""

import sys

from feedline.commands.main import main

sys.exit(main())
