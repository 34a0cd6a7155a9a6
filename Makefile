# Sparta's two commands: `make demo` and `make test`. Each sets up what it needs on a fresh
# machine with only Python: the demo a venv with torch (it runs under torchrun on the torch
# engine), the tests also Open MPI, mpi4py and a Horovod built for this torch. Stamps make a
# second run go straight to work.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
TORCH  := torch==2.13.0
export OMP_NUM_THREADS ?= 1

.PHONY: setup test demo lint bench clean mpi horovod

# --- set-up, in dependency order; stamps make a second run cheap -------------------------
# Open MPI (the mpi engine, Horovod's MPI mode) and iproute2 (ip, tc: the emulated cluster of
# benchmarks/cluster.py and its smoke test), from Debian when missing.
mpi:
	@pkgs=""; \
	command -v mpirun >/dev/null && [ -e /usr/include/x86_64-linux-gnu/mpi/mpi.h -o -n "$$(command -v mpicc)" ] \
	  || pkgs="openmpi-bin libopenmpi-dev"; \
	command -v tc >/dev/null && command -v ip >/dev/null || pkgs="$$pkgs iproute2"; \
	[ -z "$$pkgs" ] || { \
	  echo "[setup] installing $$pkgs from Debian"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$pkgs >/dev/null; }

# The demo's needs: torch, numpy, tokenizers, tqdm (setup.py's `demo` extra).
$(VENV)/.stamp-demo: setup.py Makefile
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	@echo "[setup] installing torch (CPU wheel), numpy, tokenizers, tqdm into $(VENV)"
	@# torch first and pinned, so nothing after it can pull another (CUDA) build
	$(PIP) install $(TORCH)
	$(PIP) install -e '.[demo]'
	@touch $@

# The tests' needs on top: mpi4py and the test tools (setup.py's `test` and `mpi` extras).
$(VENV)/.stamp-deps: $(VENV)/.stamp-demo | mpi
	@echo "[setup] installing mpi4py, pytest, ruff, transformers, matplotlib into $(VENV)"
	$(PIP) install -e '.[test,mpi]'
	@touch $@

# Only horovodrun launches need it (make test); it builds with every core (see the script).
$(VENV)/.stamp-horovod: $(VENV)/.stamp-deps scripts/install_horovod.sh
	@bash scripts/install_horovod.sh $(VENV)
	@touch $@

horovod: $(VENV)/.stamp-horovod

setup: horovod

# --- the two commands ----------------------------------------------------------------------
test: setup
	$(PY) -m ruff check sparta sparta_tools tests benchmarks examples
	$(PY) -m pytest -q --durations=15 tests

# `sparta train` on examples/moe_gpt.toml: a GPT-style MoE LM trained on Python's standard
# library with pipeline x data x tensor parallelism and experts split over the data ranks
# (pp2 x dp2 x tp2, ep2: 8 CPU ranks). It needs neither MPI nor Horovod, so it does not wait for them.
demo: $(VENV)/.stamp-demo
	$(PY) -m torch.distributed.run --nproc-per-node=8 --master-addr=127.0.0.1 --master-port=$$(( 20000 + $$$$ % 20000 )) \
	  --no-python $(VENV)/bin/sparta train --config examples/moe_gpt.toml

# --- extras ----------------------------------------------------------------------------------
lint: $(VENV)/.stamp-deps
	$(PY) -m ruff check sparta sparta_tools tests benchmarks examples

bench: setup
	$(PY) benchmarks/collectives.py
	$(PY) benchmarks/moe_layer.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
