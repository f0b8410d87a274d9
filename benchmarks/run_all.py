#!/usr/bin/env python
"""Run every kpool benchmark: ``python benchmarks/run_all.py [--quick | --dry-run] [--out PATH|auto]``.

Same options as ``python -m kpool.bench`` / ``kpool bench`` (this script only makes sure
``src/`` is importable when kpool is not installed).
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import kpool  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "src"))
    os.environ["PYTHONPATH"] = str(ROOT / "src") + (os.pathsep + os.environ["PYTHONPATH"]
                                                     if os.environ.get("PYTHONPATH") else "")

from kpool.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
