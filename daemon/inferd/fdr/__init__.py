"""Flight data recorder: crash-safe, append-only records of safety-relevant events.

``kinds`` registers what may be recorded, ``framing`` is the on-disk format,
``writer.FlightRecorder`` appends with group commit on its own thread and
``reader`` reads back, stopping at torn tails and resynchronising past
corruption.  No ZeroMQ here: the service passes ``FlightRecorder.record`` to
components as their ``RecordSink``.
"""
