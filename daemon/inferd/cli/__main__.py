"""``python -m inferd.cli``: the ``inferd`` command."""

import sys

from inferd.cli.main import main

sys.exit(main())
