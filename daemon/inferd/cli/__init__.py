"""The ``inferd`` command: one module per subcommand, dispatched by ``main``."""
