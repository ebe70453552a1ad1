# Two set-up commands: `make serve` and `make test`. Each builds what it needs from scratch.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv model test test-slow serve clean

$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -r requirements-nodeps.txt
	# the stub's interpreter runs isolated (PYTHONPATH is ignored): make backend/ importable from the venv
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $@

venv: $(STAMP)

model: venv
	$(BIN)/python -m build_engine.prepare_model

test: model
	$(BIN)/python -m pytest -q

test-slow: model
	$(BIN)/python -m pytest -q -m slow

# A real tritonserver (from the nvidia-pytriton wheel here; the image's own in Docker) on model_repository/.
serve: model
	$(BIN)/python -m backend.launcher --model-repository model_repository

clean:
	rm -rf $(VENV) .cache
