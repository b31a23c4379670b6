# inferd: `make run` serves the bundled demo model, `make test` runs every check.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# --no-compile: pip byte-compiles every module it installs (sympy, hypothesis,
# onnx... most of them never imported here): half of a venv's install time (the
# 3.10 venv's took 44 s, 22 s without); Python compiles what is imported, once
# (PYTEST_ENV lets the tests cache it).
PIP_INSTALL := $(BIN)/python -m pip --quiet --disable-pip-version-check --no-input install --no-compile
# pip and setuptools talk even with --quiet: keep their output in a log, shown
# only when an install fails.
LOGGED = > $(VENV)/install.log 2>&1 || { cat $(VENV)/install.log; exit 1; }
# Two distributions from this repository: the client library and inferctl
# (clients/, pyzmq + msgpack + numpy only) and the daemon (., with ONNX Runtime
# chosen by an extra: `cpu` here, `gpu` or NVIDIA's wheel on a vehicle).
# `make run` installs what running needs; `make test` adds the test tools. No
# system package is needed: the daemon and the tests use the built-in
# sd_notify/journald senders. `make test-systemd` adds the "systemd" extra
# (systemd-python, which builds against libsystemd-dev + pkg-config) and reruns
# the tests marked `systemd` with it; `make test-py310 PY310=/path/to/python3.10`
# runs the unit tests and a daemon smoke test on Python 3.10 (JetPack 6's);
# `make test-cpp` builds the C++ client (clients/cpp; Debian's cppzmq-dev,
# libmsgpack-cxx-dev, libzmq3-dev, cmake, g++) once, with -Werror, ASan and
# UBSan, and runs its ctest suite (unit, conformance, integration against a real
# daemon, find_package and add_subdirectory consumers); `make bench-cpp` builds
# it optimised and compares its round trip with the Python client's;
# .ci/run runs all four.
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
SYSTEMD_STAMP := $(VENV)/.installed-test-systemd
PACKAGING := pyproject.toml clients/pyproject.toml

CPP_BUILD := build/cpp
CPP_BENCH_BUILD := build/cpp-release
CMAKE ?= cmake

.PHONY: run demo test test-collect test-systemd test-py310 test-cpp cpp-build lint bench bench-cpp clean

$(BIN)/python:
	@$(PYTHON) -m venv $(VENV)
	@$(PIP_INSTALL) --upgrade pip $(LOGGED)

$(RUN_STAMP): $(PACKAGING) | $(BIN)/python
	@echo "installing inferd into $(VENV) (log: $(VENV)/install.log)"
	@$(PIP_INSTALL) -e ./clients -e '.[cpu]' $(LOGGED)
	@touch $@

$(TEST_STAMP): $(PACKAGING) | $(BIN)/python
	@echo "installing inferd and its test tools into $(VENV) (log: $(VENV)/install.log)"
	@$(PIP_INSTALL) -e ./clients -e '.[cpu,test]' $(LOGGED)
	@touch $@ $(RUN_STAMP)

$(SYSTEMD_STAMP): $(TEST_STAMP)
	@echo "installing systemd-python into $(VENV) (log: $(VENV)/install.log)"
	@$(PIP_INSTALL) -e '.[cpu,test,systemd]' $(LOGGED)
	@touch $@

run: $(RUN_STAMP)
	$(BIN)/inferd run

demo: $(RUN_STAMP)
	bash scripts/demo.sh

lint: $(TEST_STAMP)
	$(BIN)/ruff check daemon clients tests bench
	$(BIN)/ruff format --check daemon clients tests bench
	$(BIN)/mypy

# The suite starts a few hundred Python processes (daemons, CLIs, build children)
# that import this checkout: byte-compiled once here, since an editable install
# gets no bytecode from pip and PYTHONDONTWRITEBYTECODE (set on CI machines) keeps
# Python from caching it (~0.2 s less per daemon start).
# Most tests wait on a daemon subprocess, so pytest workers (pytest-xdist) overlap
# them: on two cores, three workers took 334 s where two took 396 s (they left the
# cores a third idle), and with 3,900 tests four took 303 s where three took 317 s
# (the cores idle 8 s against 33 s); PYTEST_WORKERS=0 runs it in one process. Work stealing, not
# xdist's default `load`: that hands each worker a quarter of the suite's first
# tests up front, so two workers ran the integration tests (daemon starts) while
# the third ran every unit test and sat idle for the last 170 s: 355 s against
# 256 s (four workers: 256 s too).
# pytest rewrites the asserts of every test module it collects (10 s a process
# here) and caches the result as bytecode only where writing it is allowed: it
# is, for pytest alone, so that the systemd rerun (and any rerun) reads it.
PYTEST_WORKERS ?= 4
PYTEST_ENV := PYTHONDONTWRITEBYTECODE=
PYTEST := pytest -q -n $(PYTEST_WORKERS) --dist worksteal
# test-collect, beside the lint (one core each): on a fresh clone each pytest-xdist
# worker rewrote the asserts of every test module it imported, three times the
# same 11 s of CPU; one process collecting first leaves them cached.
test: $(TEST_STAMP)
	@$(MAKE) --no-print-directory -j2 lint test-collect
	$(PYTEST_ENV) $(BIN)/$(PYTEST)

test-collect: $(TEST_STAMP)
	@$(BIN)/python -m compileall -q daemon clients tests
	@$(PYTEST_ENV) $(BIN)/pytest -q --collect-only -p no:cacheprovider > $(VENV)/collect.log 2>&1 \
		|| { cat $(VENV)/collect.log; exit 1; }

test-systemd: $(SYSTEMD_STAMP)
	$(BIN)/python -c 'import systemd.daemon, systemd.journal'
	$(PYTEST_ENV) $(BIN)/pytest -q -m systemd

# The same tests ran under 3.11 with pytest's assert rewriting, which here costs
# 14 s of the 3.10 run: plain asserts there (a failure says only where it failed;
# PY310_ASSERT= brings the detail back).
# Its property tests draw a fifth of their examples (tests/conftest.py `examples`).
# The command-line tests run in process there (tests/unit/cli, tests/unit/client);
# tests/integration/test_cli.py, the same commands as 52 processes (13 s of the
# 3.10 run), runs under 3.11 only, for CI's ten minutes. Bytecode is compiled
# once first: the four workers and the daemons they start each compiled it.
PY310_ASSERT ?= --assert=plain
test-py310:
	@test -n "$(PY310)" || { echo "make test-py310: set PY310=/path/to/python3.10" >&2; exit 2; }
	$(MAKE) VENV=.venv310 PYTHON=$(PY310) .venv310/.installed-test
	.venv310/bin/python -c 'import sys; assert sys.version_info[:2] == (3, 10), sys.version'
	@.venv310/bin/python -m compileall -q daemon clients tests
	$(PYTEST_ENV) HYPOTHESIS_EXAMPLES_SCALE=0.2 .venv310/bin/$(PYTEST) $(PY310_ASSERT) tests/unit tests/integration/test_smoke.py

# cpp-build needs no virtual environment (ctest's integration tests do): .ci/run
# compiles while `make test` installs and lints.
cpp-build:
	$(CMAKE) -S clients/cpp -B $(CPP_BUILD) -DCMAKE_BUILD_TYPE=Debug -DINFERD_CLIENT_WERROR=ON \
		-DINFERD_CLIENT_SANITIZE=ON -DINFERD_CLIENT_BENCH=OFF -DINFERD_PYTHON=$(abspath $(BIN)/python)
	$(CMAKE) --build $(CPP_BUILD) -j2

test-cpp: $(TEST_STAMP) cpp-build
	cd $(CPP_BUILD) && ctest --output-on-failure -j2

bench: $(TEST_STAMP)
	$(BIN)/python bench/rtt.py

bench-cpp: $(TEST_STAMP)
	$(CMAKE) -S clients/cpp -B $(CPP_BENCH_BUILD) -DCMAKE_BUILD_TYPE=Release \
		-DINFERD_CLIENT_TESTS=OFF -DINFERD_CLIENT_EXAMPLES=OFF
	$(CMAKE) --build $(CPP_BENCH_BUILD) -j2 --target inferd_rtt_bench
	$(BIN)/python bench/rtt_cpp.py --program $(CPP_BENCH_BUILD)/inferd_rtt_bench

clean:
	rm -rf .venv .venv310 build *.egg-info clients/*.egg-info clients/build .pytest_cache .mypy_cache .ruff_cache
