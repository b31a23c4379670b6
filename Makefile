# inferd: `make run` serves the bundled demo model, `make test` runs every check.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Extras installed into .venv. `make test` is what a newcomer runs: no system
# packages needed, the daemon and the tests use the built-in sd_notify/journald
# senders. `make test-systemd` adds the "systemd" extra (systemd-python, which
# builds against libsystemd-dev + pkg-config) and reruns the tests marked
# `systemd` with it; .ci/run runs both.
EXTRAS ?= test
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))
SYSTEMD_STAMP := $(VENV)/.installed-test-systemd

.PHONY: run demo test test-systemd lint unit bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[$(EXTRAS)]'
	touch $(STAMP)

$(SYSTEMD_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[test,systemd]'
	touch $(SYSTEMD_STAMP)

run: $(STAMP)
	$(BIN)/inferd run

demo: $(STAMP)
	bash scripts/demo.sh

lint: $(STAMP)
	$(BIN)/ruff check daemon clients tests bench
	$(BIN)/ruff format --check daemon clients tests bench
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -q

test-systemd: $(SYSTEMD_STAMP)
	$(BIN)/python -c 'import systemd.daemon, systemd.journal'
	$(BIN)/pytest -q -m systemd

bench: $(STAMP)
	$(BIN)/python bench/rtt.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
