# Two commands do all the set-up on a fresh machine with Python 3.11:
#   make demo   plan and train GPT-2 on 4 CPU processes (gloo)
#   make test   the test suite
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
STAMP = $(VENV)/.installed

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	# torch first and pinned exactly, so pip takes the CPU wheel and never a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# torchvision (imported by timm and transformers) needs a fix-up beside the CPU torch before
	# its first import, in every script of the environment: a start-up hook installs it.
	$(BIN)/python -m autopar.envsetup
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/torchrun --nproc-per-node 4 examples/train_gpt2.py

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info

.PHONY: venv demo test clean
