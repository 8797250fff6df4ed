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

# Two workers (pytest-xdist), one test file each at a time: a file's gloo pool and its cases stay
# in one worker (11 min on 2 cores, against 16 min in one process).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests

clean:
	rm -rf $(VENV) build *.egg-info

.PHONY: venv demo test clean
