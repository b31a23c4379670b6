"""Continuous client load for tests that change the daemon under traffic: the one
load generator, ``inferd.selftest.load`` (the self-test drives its daemon checks
with it too)."""

from inferd.selftest.load import CheckOutputs, Load, MakeInputs, client_load

__all__ = ["CheckOutputs", "Load", "MakeInputs", "client_load"]
