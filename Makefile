# inferd: `make run` serves the bundled demo model, `make test` runs every check.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Extras installed into .venv. CI adds "systemd" (systemd-python, built against
# libsystemd-dev): `make test EXTRAS=test,systemd`; without it the daemon and the
# tests use the built-in sd_notify/journald senders.
EXTRAS ?= test
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: run demo test lint unit bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[$(EXTRAS)]'
	touch $(STAMP)

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

bench: $(STAMP)
	$(BIN)/python bench/rtt.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
