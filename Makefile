# mhc-lab: one entry point for set-up, the course, the tests and the benchmarks.
#   make course   install, then execute every lab's solution headless (papermill, small mode, default device)
#   make test     install, then run the whole test suite
#   make lab      install, then open JupyterLab on labs/
#   make labs     regenerate labs/ from solutions/
#   make bench    GPU benchmarks, recorded as JSON in mhc_lab/recorded/ (needs a CUDA GPU)
#   make browser  what the browser test needs: Debian's Chromium (apt-get, as root or with sudo); playwright
#                 comes with the test dependencies and drives that Chromium (it downloads no browser)

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
SIZE   ?= small
DEVICE ?= auto
PY      = $(VENV)/bin/python
CHROMIUM ?= /usr/bin/chromium
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install course test lab labs solutions bench browser clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

course: install
	$(PY) -m mhc_lab.classroom.cli run --size $(SIZE) --device $(DEVICE) --out build/course

test: install browser
	MHC_LAB_BROWSER_TEST=required MHC_LAB_CHROMIUM=$(CHROMIUM) $(PY) -m pytest

browser: install
	@if [ -x "$(CHROMIUM)" ]; then echo "browser test: $$($(CHROMIUM) --version 2>/dev/null)"; else \
	  echo "browser test: installing Debian's chromium and chromium-driver"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium chromium-driver; fi
	@$(PY) -c "import playwright.sync_api" || $(PY) -m pip install -q playwright

lab: install
	$(VENV)/bin/jupyter lab labs/

labs: install
	$(PY) -m mhc_lab.classroom.cli build

solutions: install
	$(PY) -m mhc_lab.classroom.cli refresh-solutions

bench: install
	$(PY) -m mhc_lab.bench all

clean:
	rm -rf build .pytest_cache
