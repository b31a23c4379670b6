"""Stand-ins for hardware libraries that cannot exist on a CPU-only machine."""
