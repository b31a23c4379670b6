"""Supervision: sd_notify, the watchdog and structured logging to journald."""
