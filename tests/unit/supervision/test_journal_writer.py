"""``inferd.supervision.journal_writer``: a thread that logs never waits for
journald.  Entries go out in order from the writer's thread; an entry that finds
the queue full is dropped and counted, and one ``journal_entries_dropped`` entry
says how many once the writer has caught up (DESIGN.md entry 141)."""

from __future__ import annotations

import contextlib
import io
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import structlog

from inferd.supervision.journal_sender import NativeJournalSender
from inferd.supervision.logging import LOGGED_AT_FIELD, JournaldRenderer
from tests.conftest import wait_until
from tests.unit.supervision.conftest import as_dict

HANG_S = 5.0


class StuckJournal:
    """A sender that blocks until released, as a send to a journald that stopped
    reading does; records what it was given."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.sent: list[dict[str, list[str]]] = []

    def __call__(self, fields: Sequence[tuple[str, bytes]]) -> None:
        self.entered.set()
        assert self.release.wait(HANG_S)
        self.sent.append(as_dict(list(fields)))


def log(renderer: JournaldRenderer, index: int) -> None:
    with contextlib.suppress(structlog.DropEvent):  # the renderer always drops the event
        renderer(None, "warning", {"event": "request_refused", "level": "warning", "i": index})


def test_a_stuck_journal_blocks_no_logging_thread_and_drops_are_reported() -> None:
    journal = StuckJournal()
    renderer = JournaldRenderer(journal, fallback=io.StringIO(), capacity=4)
    log(renderer, 0)
    assert journal.entered.wait(HANG_S)  # the writer holds entry 0 in a blocked send
    finished = threading.Event()

    def log_many() -> None:
        for index in range(1, 11):
            log(renderer, index)
        finished.set()

    threading.Thread(target=log_many, daemon=True).start()
    assert finished.wait(HANG_S), "a thread that logs waited for the journal"
    assert renderer.writer.dropped == 6  # 1..4 queued, 5..10 dropped
    journal.release.set()
    assert renderer.writer.flush(HANG_S)
    events = [entry["INFERD_EVENT"][0] for entry in journal.sent]
    assert events == ["request_refused"] * 5 + ["journal_entries_dropped"]
    assert [entry["INFERD_I"][0] for entry in journal.sent[:5]] == ["0", "1", "2", "3", "4"]
    assert journal.sent[5]["INFERD_COUNT"] == ["6"] and journal.sent[5]["PRIORITY"] == ["4"]


def test_a_journald_that_does_not_read_blocks_no_logging_thread() -> None:
    """The built-in sender against a bound socket nobody reads: its queue fills after
    ``net.unix.max_dgram_qlen`` datagrams and then every send blocks."""
    directory = Path(tempfile.mkdtemp(prefix="ifdj-", dir="/tmp"))
    path = str(directory / "journal.sock")
    journal = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    journal.bind(path)
    qlen = int(Path("/proc/sys/net/unix/max_dgram_qlen").read_text())
    sender = NativeJournalSender(path)
    renderer = JournaldRenderer(sender, fallback=io.StringIO(), capacity=16)
    finished = threading.Event()

    def log_many() -> None:
        for index in range(qlen + 64):
            log(renderer, index)
        finished.set()

    threading.Thread(target=log_many, daemon=True).start()
    try:
        assert finished.wait(HANG_S), "a thread that logs waited for the journal"
        assert renderer.writer.dropped > 0
    finally:
        journal.close()  # the blocked send fails: the rest go to the stderr fallback
        assert renderer.writer.flush(HANG_S)
        sender.close()
        shutil.rmtree(directory, ignore_errors=True)


class GatedJournal:
    """A sender that blocks on the entries it is told to (by their ``i`` field)."""

    def __init__(self, *gated: int) -> None:
        self.gates = {index: threading.Event() for index in gated}
        self.entered = {index: threading.Event() for index in gated}
        self.sent: list[dict[str, list[str]]] = []

    def __call__(self, fields: Sequence[tuple[str, bytes]]) -> None:
        entry = as_dict(list(fields))
        index = int(entry.get("INFERD_I", ["-1"])[0])
        if index in self.gates:
            self.entered[index].set()
            assert self.gates[index].wait(HANG_S)
        self.sent.append(entry)


def test_a_flush_queued_behind_the_last_entry_returns_after_the_drops_were_told() -> None:
    """The report of drops went out only when the queue was empty after an entry, so a
    flush (the one at exit) queued behind the last entry returned without it."""
    journal = GatedJournal(0, 4)
    renderer = JournaldRenderer(journal, fallback=io.StringIO(), capacity=4)
    log(renderer, 0)
    assert journal.entered[0].wait(HANG_S)
    for index in range(1, 11):
        log(renderer, index)  # 1..4 queued, 5..10 dropped
    journal.gates[0].set()
    assert journal.entered[4].wait(HANG_S)  # the writer is in entry 4's send, queue empty
    flushed: list[bool] = []
    flusher = threading.Thread(target=lambda: flushed.append(renderer.writer.flush(HANG_S)))
    flusher.start()
    wait_until(lambda: renderer.writer._queue.qsize() == 1, HANG_S, message="flush queued")
    journal.gates[4].set()
    flusher.join(HANG_S)
    assert flushed == [True]
    assert journal.sent[-1]["INFERD_EVENT"] == ["journal_entries_dropped"]
    assert journal.sent[-1]["INFERD_COUNT"] == ["6"]


def test_each_entry_says_when_it_was_logged_not_only_when_journald_got_it() -> None:
    """The writer may send an entry long after it was logged (a journald that reads
    slowly): ``INFERD_LOGGED_AT_USEC`` keeps the logging time, in journald's units."""
    journal = StuckJournal()
    renderer = JournaldRenderer(journal, fallback=io.StringIO(), capacity=4)
    before_us = time.time_ns() // 1000
    log(renderer, 0)
    after_us = time.time_ns() // 1000
    journal.release.set()
    wait_until(lambda: len(journal.sent) == 1, HANG_S, message="the entry is sent")
    (logged_at,) = journal.sent[0][LOGGED_AT_FIELD]
    assert before_us <= int(logged_at) <= after_us
