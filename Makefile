PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-fast bench docs clean

# Stamps record what the venv holds for this pyproject; editing pyproject reinstalls. The demo
# needs the package alone; tests add the parity references (torch, timm, pycocotools, ...).
# Packages go in with uv (itself from PyPI, into the venv), from wherever pip is configured to
# install from (tools/uv_install.py): it downloads and unpacks in parallel, and it put the test
# extra's 8 GB (torch with its CUDA libraries, TensorFlow, ...) into a fresh clone's venv in
# 39 s, where pip took 3 min 12 s (back to back, empty caches, 2 idle cores).
INSTALL = $(BIN)/python tools/uv_install.py

$(VENV)/.runtime: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q uv==0.13.9
	$(INSTALL) -e .
	touch $@

# The last three go in without their declared dependencies: pyproject's `sources`,
# `corruptions` and `onnx` extras say why.
$(VENV)/.installed: $(VENV)/.runtime
	$(INSTALL) -e '.[test]'
	$(INSTALL) --no-deps nuscenes-devkit==1.2.0 imagecorruptions==1.1.2 jax2onnx==0.17.1
	touch $@

demo: $(VENV)/.runtime
	$(BIN)/ood-jax demo

# Two workers, each taking whole modules (module fixtures are shared by a module's tests), the
# modules with the most tests first (xdist's order: measured 34 min against 37 min for the
# multi-process modules first, which then run side by side).
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadfile

test: $(VENV)/.installed
	$(PYTEST) --durations=25 tests

# The edit loop: everything but the tests marked slow (training, several processes, servers).
test-fast: $(VENV)/.installed
	$(PYTEST) -m "not slow" tests

bench: $(VENV)/.installed
	$(BIN)/python bench/coco_eval.py

# The documentation site (mkdocs.yml, docs/) into site/; --strict turns every warning (a broken
# link or anchor, a docstring the API reference cannot render) into an error.
docs: $(VENV)/.installed
	$(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) build *.egg-info
