"""Continuous client load on a running daemon (the real ``inferd_client``), for
checks and tests that change the daemon under traffic."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from inferd_client import ClientError, InferenceClient, RemoteError

#: Builds a request's inputs from a generator; checks the outputs (True = correct).
MakeInputs = Callable[[np.random.Generator], dict[str, np.ndarray]]
CheckOutputs = Callable[[dict[str, np.ndarray], dict[str, np.ndarray]], bool]
#: Bounds one request of the load (an engine load on a Jetson takes seconds).
REQUEST_TIMEOUT_S = 30.0
#: Failure messages kept (the first ones); every failure is counted in ``failed``.
#: A model that refuses every request at once fails thousands a second per client.
FAILURES_KEPT = 100


@dataclass
class Load:
    served: Counter[str] = field(default_factory=Counter)  # by the runtime that answered
    #: The first ``FAILURES_KEPT`` failures' messages.
    failures: list[str] = field(default_factory=list)
    #: Every failure (a refused request, a wrong output).
    failed: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def answered(self) -> int:
        with self._lock:
            return sum(self.served.values())

    def _served(self, runtime: str) -> None:
        with self._lock:
            self.served[runtime] += 1

    def _failed(self, what: str) -> None:
        with self._lock:
            self.failed += 1
            if len(self.failures) < FAILURES_KEPT:
                self.failures.append(what)


@contextmanager
def client_load(
    endpoint: str,
    model: str,
    make_inputs: MakeInputs,
    check: CheckOutputs,
    *,
    clients: int = 4,
) -> Iterator[Load]:
    """``clients`` threads, each with its own client, send until the block ends."""
    load = Load()
    stop = threading.Event()

    def loop(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with InferenceClient(endpoint, timeout=REQUEST_TIMEOUT_S) as client:
            while not stop.is_set():
                inputs = make_inputs(rng)
                try:
                    outputs = client.infer(model, inputs)
                except (RemoteError, ClientError) as exc:
                    load._failed(f"{model}: {exc!r}")
                    continue
                if not check(inputs, outputs):
                    load._failed(f"{model}: wrong output from {client.last_reply['runtime']}")
                load._served(str(client.last_reply["runtime"]))

    threads = [
        threading.Thread(target=loop, args=(seed,), name=f"inferd-load-{model}-{seed}")
        for seed in range(clients)
    ]
    try:
        for thread in threads:  # one that cannot start (the thread limit) ends those before
            thread.start()
        yield load
    finally:
        stop.set()
        for thread in threads:
            if thread.ident is not None:  # never started: nothing to join
                thread.join(REQUEST_TIMEOUT_S)
