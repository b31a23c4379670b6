"""Shim: only reached if ``pycuda.driver`` was not installed by the package shim."""

from tests.fakes import gpu_site

gpu_site.install_into_sys_modules()
