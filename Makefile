# mhc-lab: one entry point for set-up, the course, the tests and the benchmarks.
#   make course   install, then execute every lab's solution headless (papermill, small mode, default device)
#   make test     install, then run the whole test suite
#   make lab      install, then open JupyterLab on labs/
#   make labs     regenerate labs/ from solutions/
#   make bench    GPU benchmarks, recorded as JSON in mhc_lab/recorded/ (needs a CUDA GPU)

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
SIZE   ?= small
DEVICE ?= auto
PY      = $(VENV)/bin/python

.PHONY: install course test lab labs solutions bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

course: install
	$(PY) -m mhc_lab.course.cli run --size $(SIZE) --device $(DEVICE) --out build/course

test: install
	$(PY) -m pytest

lab: install
	$(VENV)/bin/jupyter lab labs/

labs: install
	$(PY) -m mhc_lab.course.cli build

solutions: install
	$(PY) -m mhc_lab.course.cli refresh-solutions

bench: install
	$(PY) -m mhc_lab.bench all

clean:
	rm -rf build .pytest_cache
