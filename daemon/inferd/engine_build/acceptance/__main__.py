"""``python -m inferd.engine_build.acceptance``: the same as ``inferd acceptance stuck-build``
(and the entry of the signal scenarios' build child)."""

import contextlib
import sys

from inferd.process_start import prepare_process

prepare_process()  # as `inferd acceptance` does (inferd.cli.main): fds 0-2 first
from inferd.engine_build.acceptance.runner import main  # noqa: E402

with contextlib.suppress(KeyboardInterrupt):
    sys.exit(main())
