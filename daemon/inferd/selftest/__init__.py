"""``inferd selftest``: the checks that fakes cannot make, run on the machine itself.

Each check (``check.Check``) is a small function that records criteria (each
pass/fail with its detail) and evidence; the runner (``runner.run_selftest``)
turns it into one ``CheckResult``: ``pass``, ``fail`` or ``skipped`` with the
precise reason its prerequisite is missing (no TensorRT, no CUDA device, no
NVML).  A skipped check never passes.  The report (``report.py``, schema
``schemas/selftest/report.json``) carries the host tuple and the versions of
everything involved, so a run on a vehicle can be attached to a bug.

CPU checks (ONNX Runtime, the engine gate, the platform release, a real daemon
on ONNX Runtime) run everywhere; the GPU checks (TensorRT import, host tuple,
build, timing cache, cancellation, ``inferd verify``, a daemon switching
TensorRT and ONNX Runtime models under load, NVML thermal) run where their
prerequisites exist.  Everything is written under one work directory.
"""
