"""``python -m qswap.cli``: the same entry point as the ``qswap`` script."""

import sys

from qswap.cli import main

sys.exit(main())
