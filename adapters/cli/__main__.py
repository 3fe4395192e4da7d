"""``python -m ortspec.adapters.cli``: the ``ortspec`` command."""

import sys

from .main import main

sys.exit(main())
