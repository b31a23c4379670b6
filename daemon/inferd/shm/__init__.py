"""Shared-memory tensor regions: sealed memfds clients register over a local Unix
socket (``server``), mapped, bounded and reference-counted (``regions``, ``memfd``)."""
