PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test bench clean

# The stamp records that the venv holds this pyproject's dependencies; editing pyproject reinstalls.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/ood-jax demo

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q tests

bench: $(VENV)/.installed
	$(BIN)/python bench/coco_eval.py

clean:
	rm -rf $(VENV) build *.egg-info
