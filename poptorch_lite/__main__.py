"""``python -m poptorch_lite run script.py [args]``: see :mod:`poptorch_lite.cli`."""

import sys

from .cli import main

sys.exit(main())
