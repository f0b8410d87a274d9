"""``python -m kpool``: the ``kpool`` console script (``kpool.cli``)."""

import sys

from .cli import main

sys.exit(main())
