# inferd: `make run` serves the bundled demo model, `make test` runs every check.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --quiet --disable-pip-version-check --no-input
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
# .ci/run runs all three.
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
SYSTEMD_STAMP := $(VENV)/.installed-test-systemd
PACKAGING := pyproject.toml clients/pyproject.toml

.PHONY: run demo test test-systemd test-py310 lint bench clean

$(BIN)/python:
	@$(PYTHON) -m venv $(VENV)
	@$(PIP) install --upgrade pip $(LOGGED)

$(RUN_STAMP): $(PACKAGING) | $(BIN)/python
	@echo "installing inferd into $(VENV) (log: $(VENV)/install.log)"
	@$(PIP) install -e ./clients -e '.[cpu]' $(LOGGED)
	@touch $@

$(TEST_STAMP): $(PACKAGING) | $(BIN)/python
	@echo "installing inferd and its test tools into $(VENV) (log: $(VENV)/install.log)"
	@$(PIP) install -e ./clients -e '.[cpu,test]' $(LOGGED)
	@touch $@ $(RUN_STAMP)

$(SYSTEMD_STAMP): $(TEST_STAMP)
	@echo "installing systemd-python into $(VENV) (log: $(VENV)/install.log)"
	@$(PIP) install -e '.[cpu,test,systemd]' $(LOGGED)
	@touch $@

run: $(RUN_STAMP)
	$(BIN)/inferd run

demo: $(RUN_STAMP)
	bash scripts/demo.sh

lint: $(TEST_STAMP)
	$(BIN)/ruff check daemon clients tests bench
	$(BIN)/ruff format --check daemon clients tests bench
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -q

test-systemd: $(SYSTEMD_STAMP)
	$(BIN)/python -c 'import systemd.daemon, systemd.journal'
	$(BIN)/pytest -q -m systemd

test-py310:
	@test -n "$(PY310)" || { echo "make test-py310: set PY310=/path/to/python3.10" >&2; exit 2; }
	$(MAKE) VENV=.venv310 PYTHON=$(PY310) .venv310/.installed-test
	.venv310/bin/python -c 'import sys; assert sys.version_info[:2] == (3, 10), sys.version'
	.venv310/bin/pytest -q tests/unit tests/integration/test_smoke.py tests/integration/test_cli.py

bench: $(TEST_STAMP)
	$(BIN)/python bench/rtt.py

clean:
	rm -rf .venv .venv310 build *.egg-info clients/*.egg-info clients/build .pytest_cache .mypy_cache .ruff_cache
