"""One thread refused as at the process's thread limit: ``Thread.start`` raises
``RuntimeError("can't start new thread")`` for it, as CPython's does when
``pthread_create`` fails (DESIGN.md 166), and leaves it as such a start does:
never started (``ident`` None, ``is_alive()`` False, ``join`` raises)."""

from __future__ import annotations

import threading

import pytest

#: CPython's message (``_thread.start_new_thread``).
REFUSAL = "can't start new thread"


def refuse_start(monkeypatch: pytest.MonkeyPatch, name: str) -> list[threading.Thread]:
    """Refuse every start of a thread named ``name`` (a ``Timer`` included); the
    refused threads are appended to the list returned.  Others start as usual."""
    real_start = threading.Thread.start
    refused: list[threading.Thread] = []

    def start(thread: threading.Thread) -> None:
        if thread.name != name:
            real_start(thread)
            return
        refused.append(thread)
        raise RuntimeError(REFUSAL)

    monkeypatch.setattr(threading.Thread, "start", start)
    return refused


def alive_named(name: str) -> list[threading.Thread]:
    """The threads named ``name`` that run now."""
    return [thread for thread in threading.enumerate() if thread.name == name]
