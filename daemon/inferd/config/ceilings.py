"""The largest value each bounded config key may take, and why.

Every number that reaches a C type or a wait, and every bound on what the daemon
can be made to hold (requests, frames, bytes, records), has a ceiling far above
any deployment's need: a value past it is one the daemon could not use, or a
bound that bounds nothing, and is refused at load naming the key and its range.
The memory figures were measured on CPython 3.11 with tracemalloc.
"""

from __future__ import annotations

# ``bus.max_header_bytes``' ceiling, shared with the clients, which refuse a longer
# request header before sending it (the daemon would answer it ``id: null``).
from inferd_wire.protocol import MAX_HEADER_FRAME_BYTES as MAX_HEADER_FRAME_BYTES

#: ``[[models]] max_load_s``: a day.
MAX_LOAD_S = 86_400.0
#: ZeroMQ stores heartbeat times as int milliseconds; an hour is plenty.
MAX_HEARTBEAT_MS = 3_600_000
#: A longer busy poll is a core spent waiting, not a shorter wake-up.
MAX_BUSY_POLL_US = 1000
#: ``bus.max_connections``'s ceiling: each connection holds a descriptor.
MAX_CONNECTIONS_PER_SOCKET = 16384
#: ``shm.max_regions_per_connection``'s ceiling (a request names at most 64): each
#: region holds a descriptor and a mapping (``vm.max_map_count``: 65530).
MAX_REGIONS_PER_CONNECTION = 1024

#: ``daemon.health_interval_s`` (1 s by default): the ``health`` event's period.  At
#: 1e-9 the publisher sent ~74,000 a second to every subscriber, a whole core; at
#: 0.01 (100 a second) it takes 3% of one.  An hour is the longest period that is
#: still a sign of life.
MIN_HEALTH_INTERVAL_S = 0.01
MAX_HEALTH_INTERVAL_S = 3600.0
#: Sensors change over seconds; faster polling only burns a core, and a reading
#: older than 20 s cannot decide a throttle (nor be waited for: a wait overflows).
MAX_THERMAL_POLL_HZ = 100.0
MIN_THERMAL_POLL_HZ = 0.05
#: Caps within the C types values reach (int64, C int, threading.TIMEOUT_MAX), far
#: above any deployment's needs.  A bus message over 4 GiB belongs in shared memory.
MAX_MESSAGE_BYTES = 4 * 1024**3
#: An hour: longer than any TimeoutStopSec=, and than any request's deadline_ms.
MAX_SHUTDOWN_MS = MAX_DEADLINE_MS = 3_600_000
#: More ORT threads than an onboard CPU has cores only contend.
MAX_THREADS = 1024
#: No board has more GPUs, or a GPU more than a TiB of memory (``runtime.
#: gpu_memory_budget_bytes`` and ``ort_gpu_mem_limit_bytes``, the CUDA EP's arena cap).
MAX_DEVICE_INDEX = 255
MAX_GPU_BUDGET_BYTES = 1024**4
#: A recorder synced less than once a minute is not crash-safe.
MAX_FSYNC_INTERVAL_MS = 60_000
#: The backoff doubles per failed build: beyond ten it outgrows any wait.
MAX_REBUILD_ATTEMPTS = 10
#: The per-peer rate of an operator op (``builds.start_burst``/``start_refill_s``,
#: ``runtime.switch_burst``/``switch_refill_s``; ``inferd.peer_rate_limit``): each
#: request let through costs a build or a runtime's preparation, so a burst past a
#: thousand bounds nothing, and a refill slower than a day is the op switched off.
MAX_OP_BURST = 1000
MAX_OP_REFILL_S = 86_400.0
#: ... and a refill under 0.1 s (10 ops a second, each peer) bounds nothing either:
#: a switch loads and warms an engine (hundreds of ms to seconds on a Jetson) and a
#: build runs minutes, so at 1e-9 s only the burst was left as a bound.
MIN_OP_REFILL_S = 0.1
#: ``builds.max_duration_s`` (4 h by default) and ``build.start``'s ``timeout_s``:
#: a day, as ``models.max_load_s``; ``inferd build --timeout`` and ``--stall-after``
#: are bounded by it too.  The slowest
#: TensorRT builds on a Jetson (large models at optimization level 5, a cold timing
#: cache) take hours; a build still running after a day is hung, and a longer
#: bound would hold its child, its model's one build and its GPU memory about as
#: long as none.
MAX_BUILD_DURATION_S = 86_400.0

#: ``[[models]] queue_capacity`` (64 by default).  One engine worker runs a model's
#: queue in order, so its last request waits capacity x the inference time: 4,096
#: is seconds even for a 1 ms model, past any onboard deadline.  What one queued
#: request holds besides its tensor bytes (``queue_max_bytes``): about 2 KB for a
#: one-input request (its inputs as parsed, never its decoded header, which a
#: client may pad to ~72x its bytes: DESIGN.md 180); while its model loads, a
#: ``zmq.Frame`` and views per tensor frame (~790 B each, up to
#: ``bus.max_frames``).  At this ceiling and the defaults: about 8 MiB.
MAX_QUEUE_CAPACITY = 4096
#: ``bus.max_frames`` (64 by default): tensor frames of one request, each held as
#: a ``zmq.Frame`` and a ``memoryview`` (~570 B) while the bus reads the message,
#: and by a request queued for a loading model.  The largest ONNX decoders with KV
#: caches have a few hundred inputs (two per layer: 80 layers, 163).  Up to
#: ~0.6 MiB per message being read.
MAX_FRAMES = 1024
# ``bus.max_header_bytes`` (64 KiB, the wire's default): ``MAX_HEADER_FRAME_BYTES``,
# 256 KiB, imported above from ``inferd_wire.protocol``.  A header describes tensors
# (~100 bytes each: ``MAX_FRAMES`` of them fit in 100 KiB) and never holds them.
# Decoded, a header can hold ~72x its bytes (18 MiB at this ceiling).
#: ``shm.max_requests_per_connection`` (64 by default): a connection's requests in
#: flight are queued or running (one past a full queue is answered at once), so
#: the models' queues, not this, bound what they hold; sixteen models' queues at
#: ``MAX_QUEUE_CAPACITY``.
MAX_REQUESTS_IN_FLIGHT = 16 * MAX_QUEUE_CAPACITY
#: Byte caps on the daemon's memory: ``[[models]] queue_max_bytes``,
#: ``bus.max_reply_bytes_total`` (and so ``_per_peer``), ``shm.max_bytes_total``
#: (and so ``_per_uid``).  No host inferd runs on has a TiB of memory: a cap past
#: it bounds nothing.
MAX_MEMORY_BYTES = 1024**4
#: ``fdr.queue_capacity`` (4,096 by default): records queued for the writer while
#: it writes or syncs; a full queue drops and counts.  The daemon's records are
#: 280-350 bytes each in the queue (65,536: ~22 MiB; a record is at most 1 MiB,
#: ``MAX_BODY_BYTES``, so 64 GiB but for ``fdr.queue_max_bytes``, below), and the
#: daemon makes a few a second (a deadline-miss summary per model per 10 s; alerts
#: are rate-limited): minutes of a disk that stopped.
MAX_FDR_QUEUE_RECORDS = 65536
#: ``fdr.queue_max_bytes`` (16 MiB by default): the frames of the records queued
#: for the writer or in its batch.  A refused ``runtime.switch`` is ~700 bytes in
#: the queue, but a record the recorder takes may be 1 MiB (``MAX_BODY_BYTES``):
#: without a byte bound a full queue held 4 GiB at the default capacity and 64 GiB
#: at its ceiling.  The ceiling is that 64 GiB, past which the byte bound bounds
#: nothing; the least holds the largest frame (1 MiB and its 12-byte header).
MAX_FDR_QUEUE_BYTES = MAX_FDR_QUEUE_RECORDS * 1024**2
FDR_QUEUE_MIN_BYTES = 2 * 1024**2
#: ``fdr.segment_max_bytes`` (8 MiB by default): the recorder's start reads its
#: newest segment whole to resume the seq (1.2x its size in memory, ~47 ms per MiB
#: on a loaded 2-core VM: 310 MiB and ~12 s at this ceiling), as ``inferd fdr``
#: reads each.  The smallest holds the writer's own records (an ``fdr_dropped`` is
#: at most 459 bytes, a one-name ``fdr_retention`` 263).
MAX_FDR_SEGMENT_BYTES = 256 * 1024**2
FDR_SEGMENT_MIN_BYTES = 1024

#: ``fdr.max_total_bytes`` (256 MiB by default) and ``builds.max_bytes`` (2 GiB): what
#: the recorder and the builds keep on disk.  The daemon records a few ~300-byte
#: records a second (~100 MB a day at most: a TiB is decades), and builds keep
#: ``builds.max_count`` sets of one engine each (hundreds of MB to a few GB).  A cap
#: past a TiB is past any Jetson's storage for them (eMMC 16-64 GB, an NVMe a few
#: TB shared with everything else): the disk would fill first, the recorder then
#: dropping its records and a build failing on ENOSPC.  What a large recorder costs
#: goes by its number of segments: ``MAX_FDR_SEGMENTS``.
MAX_DISK_BYTES = 1024**4
#: ``fdr.max_total_bytes / fdr.segment_max_bytes`` (32 by default): the segments the
#: size cap keeps.  A rotation no longer depends on it (the writer's inventory:
#: ~0.8 ms with 1,024 or 32,768 kept, where listing them took 16 and 544 ms), but
#: the recorder's start still lists and ``lstat``s each once (0.25 s for 32,768 and
#: 0.93 s for 131,072 on a warm 2-core VM; more from a cold eMMC), the inventory
#: holds 16 bytes each, and ``inferd fdr dump``/``verify``/``export`` open each.
#: The ceiling is ``MAX_DISK_BYTES`` at the default 8 MiB segment, so every disk
#: bound loads at the default size; 1 KiB segments under the default 256 MiB
#: (262,144) do not: a larger total needs larger segments.
MAX_FDR_SEGMENTS = 131_072

#: ``alerts.rate_limit_s`` (10 s by default): the window per (code, model).  At 0
#: every repeat went out: to the pub topic, as an FDR record, a journal line and a
#: MAVLink STATUSTEXT on a telemetry radio the autopilot shares (a SiK radio's
#: 57,600 baud carry ~5 KB/s in all).  Repeats inside the window are counted, not
#: lost: a second's window still reports a fault within one and holds each key to
#: one message a second; an hour is the longest wait for a persisting fault's next
#: report (as ``daemon.health_interval_s``'s).
MIN_ALERT_RATE_LIMIT_S = 1.0
MAX_ALERT_RATE_LIMIT_S = 3600.0

#: ``thermal.throttle_enter_c``: a temperature a Jetson's sensors can report while it
#: runs.  Industrial modules run from -40 C; Orin's and Xavier's junctions are
#: specified to about 105 C, where their shutdown trip points lie, and no GPU runs
#: at 150 C: a threshold outside the range throttles always or never.
MIN_THROTTLE_ENTER_C = -40.0
MAX_THROTTLE_ENTER_C = 150.0
#: ``thermal.hysteresis_c`` (5 C by default): 50 C under a ~100 C trip point is an
#: idle board's temperature (35-50 C in a room), so a wider band in effect never
#: leaves throttling (at 1e308 it never did).
MAX_HYSTERESIS_C = 50.0
