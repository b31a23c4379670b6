"""Serving: admission, queues, the engine worker, model slots and runtime switching."""
