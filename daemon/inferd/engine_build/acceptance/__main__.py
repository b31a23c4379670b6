"""``python -m inferd.engine_build.acceptance``: the same as ``inferd acceptance stuck-build``
(and the entry of the signal scenarios' build child)."""

import contextlib
import sys

from inferd.engine_build.acceptance.runner import main

with contextlib.suppress(KeyboardInterrupt):
    sys.exit(main())
