"""Journal entries sent from a thread of their own, so that no thread that logs
waits for journald.

Both senders (``journal_sender``: libsystemd's ``sd_journal_sendv`` and the
built-in one) write to a blocking datagram socket, as libsystemd does: when
journald stops reading (stopped, or flushing to a slow disk), its queue fills
after ``net.unix.max_dgram_qlen`` entries and every later send blocks, so the
engine worker, the bus or the main loop (which sends ``WATCHDOG=1``) would stall
on a log line.  Entries are queued instead (``capacity`` of them at most) and
sent in order by the ``inferd-journal`` thread; an entry that finds the queue
full is dropped and counted, and once the thread catches up it sends one
``journal_entries_dropped`` entry saying how many (DESIGN.md entry 141).
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from inferd.supervision.journal_fields import journal_fields
from inferd.supervision.journal_sender import JournalSender

THREAD_NAME = "inferd-journal"
#: Entries waiting at most (a few MB with tracebacks): minutes of a busy log.
DEFAULT_CAPACITY = 4096
#: How long the process waits at exit for the entries still queued.
EXIT_FLUSH_S = 2.0
DROPPED_EVENT = "journal_entries_dropped"


@dataclass
class Entry:
    fields: Sequence[tuple[str, bytes]]
    #: What the stderr fallback renders when the journal cannot be reached.
    method_name: str
    event_dict: MutableMapping[str, Any]


#: Called on the writer's thread with an entry the sender refused (``OSError``).
Fallback = Callable[[Entry, OSError], None]


class JournalWriter:
    def __init__(
        self, sender: JournalSender, fallback: Fallback, capacity: int = DEFAULT_CAPACITY
    ) -> None:
        self._sender = sender
        self._fallback = fallback
        self._queue: queue.Queue[Entry | threading.Event] = queue.Queue(maxsize=capacity)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        #: Dropped since the last report, and in all.
        self._unreported = 0
        self.dropped = 0

    def submit(self, entry: Entry) -> None:
        """Queue ``entry`` for the journal; never blocks (a full queue drops it)."""
        self._start()
        try:
            self._queue.put_nowait(entry)
        except queue.Full:
            with self._lock:
                self._unreported += 1
                self.dropped += 1

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued before this call was handed to journald."""
        if self._thread is None:
            return True
        give_up_at = time.monotonic() + timeout
        marker = threading.Event()
        try:
            self._queue.put(marker, timeout=timeout)
        except queue.Full:
            return False
        return marker.wait(max(0.0, give_up_at - time.monotonic()))

    def _start(self) -> None:
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is None:
                thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
                thread.start()
                self._thread = thread
                atexit.register(self.flush, EXIT_FLUSH_S)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if not isinstance(item, threading.Event):
                self._send(item)
            # Caught up (or asked to flush): the drops are told before the flush returns.
            if self._unreported and (self._queue.empty() or isinstance(item, threading.Event)):
                self._send(self._dropped_report())
            if isinstance(item, threading.Event):
                item.set()

    def _send(self, entry: Entry) -> None:
        try:
            self._sender(entry.fields)
        except OSError as exc:
            self._fallback(entry, exc)

    def _dropped_report(self) -> Entry:
        with self._lock:
            count, self._unreported = self._unreported, 0
            total = self.dropped
        event = {
            "event": DROPPED_EVENT,
            "level": "warning",
            "count": count,
            "dropped_total": total,
            "reason": "the journal did not take entries as fast as they were logged",
        }
        return Entry(journal_fields(event, "warning"), "warning", event)
