# mhc-lab: one entry point for set-up, the course, the tests and the benchmarks.
#   make lab      install, then open JupyterLab on labs/00_setup.ipynb (a learner's start)
#   make test     install, then run the whole test suite (what .ci/run runs)
#   make course   install, then execute every lab's *solution* headless (papermill, small mode, default device):
#                 what CI and instructors run, every exercise answered
#   make labs     regenerate labs/ from solutions/
#   make bench    GPU benchmarks, recorded as JSON in mhc_lab/recorded/ (needs a CUDA GPU)
#   make wheel    the package alone (mhc_lab: no solutions, no tests, no hidden checks) as a wheel to hand
#                 out with the notebooks (build/dist/): students run `pip install mhc_lab-*.whl`
#   make browser  what the browser test needs: Debian's Chromium where apt-get runs without a password (else
#                 the test is skipped, unless BROWSER=required); playwright drives it (it downloads no browser)

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= $(shell grep -m1 '^torch==' constraints.txt)
SIZE   ?= small
DEVICE ?= auto
PY      = $(VENV)/bin/python
CHROMIUM ?= /usr/bin/chromium
BROWSER ?= optional
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install course test lab labs solutions bench browser wheel clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,transformers]"
	touch $@

course: install
	$(PY) -m mhc_lab.classroom.cli run --size $(SIZE) --device $(DEVICE) --out build/course

test: install browser
	MHC_LAB_BROWSER_TEST=$(BROWSER) MHC_LAB_CHROMIUM=$(CHROMIUM) $(PY) -m pytest

# The browser test drives JupyterLab in Debian's Chromium. Installed here where apt-get can run without a
# password (as root, or with passwordless sudo); elsewhere the test is skipped with a line saying how to enable
# it. BROWSER=required (what .ci/run sets) makes a missing browser an error instead.
browser: install
	@if [ -x "$(CHROMIUM)" ]; then echo "browser test: $$($(CHROMIUM) --version 2>/dev/null)"; \
	elif command -v apt-get >/dev/null && { [ "$$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }; then \
	  echo "browser test: installing Debian's chromium and chromium-driver"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium chromium-driver; \
	else echo "browser test: no Chromium at $(CHROMIUM) and none installable without a password; it will be skipped" \
	  "(install chromium, or run make test CHROMIUM=/path/to/chromium)"; fi
	@$(PY) -c "import playwright.sync_api" || $(PY) -m pip install -q playwright

lab: install
	$(VENV)/bin/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) labs/00_setup.ipynb

labs: install
	$(PY) -m mhc_lab.classroom.cli build

solutions: install
	$(PY) -m mhc_lab.classroom.cli refresh-solutions

bench: install
	$(PY) -m mhc_lab.bench all

# Built from a copy of mhc_lab/ and the project files only, so nothing else of the repository (and no stale
# build folder) can end up in the wheel.
wheel: install
	rm -rf build/wheel-src && mkdir -p build/wheel-src build/dist
	cp -R pyproject.toml README.md LICENSE mhc_lab build/wheel-src/
	find build/wheel-src -name __pycache__ -prune -exec rm -rf {} +
	$(PY) -m pip wheel --no-deps --no-build-isolation -q -w build/dist build/wheel-src
	rm -rf build/wheel-src
	@ls build/dist/*.whl

clean:
	rm -rf build .pytest_cache
