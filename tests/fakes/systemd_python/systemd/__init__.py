"""Stand-in for the ``systemd`` package of systemd-python 235 (``systemd.daemon``
only), for tests of the notify backend selection on a machine where the real
distribution, which needs libsystemd-dev to build, is not installed.

Put ``tests/fakes/systemd_python`` first on ``PYTHONPATH`` of a subprocess.
It is a regular package (it has this ``__init__``), exactly as the real one is,
so it wins over a namespace folder named ``systemd`` elsewhere on the path.
"""
