# `make serve` and `make test` create the virtual environment on first use, then run.
PYTHON ?= python3
VENV ?= .venv
# MLX needs exactly one backend on Linux: cpu unless told otherwise (make BACKEND=cuda13 ...).
UNAME := $(shell uname -s)
ifeq ($(UNAME),Darwin)
BACKEND ?=
else
BACKEND ?= cpu
endif
comma := ,
EXTRAS := $(if $(BACKEND),$(BACKEND)$(comma)test,test)
ARGS ?=

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e ".[$(EXTRAS)]"
	$(VENV)/bin/python -m mlx_serve check-backend
	touch $@

.PHONY: venv serve test lint
venv: $(VENV)/.installed

serve: venv
	$(VENV)/bin/python -m mlx_serve serve $(ARGS)

test: venv
	$(VENV)/bin/python -m ruff check .
	$(VENV)/bin/python -m pytest -q -n auto --maxprocesses=4 $(ARGS)

lint: venv
	$(VENV)/bin/python -m ruff check .
