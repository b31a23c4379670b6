"""The supervisor: composes runtimes, bus, queues and lifecycle (the composition root)."""
