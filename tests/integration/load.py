"""Continuous client load for tests that change the daemon under traffic."""

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


@dataclass
class Load:
    served: Counter[str] = field(default_factory=Counter)  # by the runtime that answered
    failures: list[str] = field(default_factory=list)


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
        with InferenceClient(endpoint, timeout=30) as client:
            while not stop.is_set():
                inputs = make_inputs(rng)
                try:
                    outputs = client.infer(model, inputs)
                except (RemoteError, ClientError) as exc:
                    load.failures.append(repr(exc))
                    continue
                if not check(inputs, outputs):
                    load.failures.append("wrong output")
                load.served[client.last_reply["runtime"]] += 1

    threads = [threading.Thread(target=loop, args=(seed,)) for seed in range(clients)]
    for thread in threads:
        thread.start()
    try:
        yield load
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
