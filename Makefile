# Sparta's two commands: `make demo` and `make test`. Each sets up everything it needs on a
# fresh machine with only Python (venv, Open MPI, mpi4py, a Horovod built for this torch);
# a second run finds it all in place and goes straight to work.

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

$(VENV)/.stamp-deps: setup.py Makefile | mpi
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	@echo "[setup] installing torch (CPU wheel), numpy, mpi4py, test tools into $(VENV)"
	@# torch first and pinned, so nothing after it can pull another (CUDA) build
	$(PIP) install $(TORCH)
	$(PIP) install numpy mpi4py pytest pytest-timeout ruff tqdm tokenizers transformers matplotlib
	$(PIP) install --no-deps -e .
	@touch $@

horovod: $(VENV)/.stamp-deps
	@bash scripts/install_horovod.sh $(VENV)

setup: $(VENV)/.stamp-deps horovod

# --- the two commands ----------------------------------------------------------------------
test: setup
	$(PY) -m ruff check sparta tests benchmarks examples
	$(PY) -m pytest -q tests

# A GPT-style MoE LM trained on Python's standard library, experts sharded over 4 CPU ranks.
demo: setup
	$(PY) -m torch.distributed.run --nproc-per-node=4 --master-addr=127.0.0.1 --master-port=$$(( 20000 + $$$$ % 20000 )) \
	  examples/train_moe_lm.py

# --- extras ----------------------------------------------------------------------------------
lint: $(VENV)/.stamp-deps
	$(PY) -m ruff check sparta tests benchmarks examples

bench: setup
	$(PY) benchmarks/collectives.py --table
	$(PY) benchmarks/moe_layer.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
