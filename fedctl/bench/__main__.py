"""``python -m fedctl.bench``: the same as ``fedctl bench``."""

import sys

from fedctl.bench.main import main

sys.exit(main())
