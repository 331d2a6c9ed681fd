# segnet -- build, test, train.
#
#   make            build ./segnet and ./test_segnet (CPU backend, always)
#   make test       build and run the test suite
#   make train      build and run the main job on the bundled data
#
# Switches: NO_OMP=1 (no OpenMP), NO_CUDA=1, NO_NCCL=1, NO_MPI=1 (skip the
# detection of each; later parts of segnet use them when present).
#
# Build dependencies come from Debian packages, never from copies in this repo:
# OpenBLAS (libopenblas-dev) and stb_image (libstb-dev). When one is missing,
# `make` installs it with apt-get if run as root, else stops with the command.

CC      ?= gcc
CFLAGS  ?= -O2 -g
CFLAGS  += -std=gnu11 -Wall -Wextra -Wno-unknown-pragmas
LDLIBS  += -lm

DEB_PACKAGES := libopenblas-dev libstb-dev pkg-config

ifeq ($(NO_OMP),1)
  OMP_FLAGS :=
else
  OMP_FLAGS := -fopenmp
endif

# Evaluated when a recipe runs, i.e. after `deps` has installed what was missing.
DEP_CFLAGS = $(shell pkg-config --cflags openblas stb 2>/dev/null)
DEP_LIBS   = $(shell pkg-config --libs openblas 2>/dev/null)

.PHONY: all deps test train clean

all: segnet test_segnet

# ---- dependencies and feature detection -------------------------------------
deps:
	@missing=""; \
	command -v pkg-config >/dev/null 2>&1 || missing="$$missing pkg-config"; \
	{ command -v pkg-config >/dev/null 2>&1 && pkg-config --exists openblas; } || missing="$$missing libopenblas-dev"; \
	[ -f /usr/include/stb/stb_image.h ] || missing="$$missing libstb-dev"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "segnet: installing missing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null \
	      || { echo "segnet: apt-get install failed; run: apt-get install -y$$missing" >&2; exit 1; }; \
	  else \
	    echo "segnet: missing build dependencies. Run:" >&2; \
	    echo "  sudo apt-get install -y$$missing" >&2; \
	    exit 1; \
	  fi; \
	fi
	@echo "segnet build:"
	@echo "  ✓ OpenBLAS   $$(pkg-config --modversion openblas)"
	@echo "  ✓ stb_image  /usr/include/stb/stb_image.h"
	@if [ "$(NO_OMP)" = 1 ]; then echo "  ✗ OpenMP     off (NO_OMP=1)"; \
	 elif echo 'int main(void){return 0;}' | $(CC) -fopenmp -x c - -o /dev/null 2>/dev/null; then echo "  ✓ OpenMP"; \
	 else echo "  ✗ OpenMP     $(CC) -fopenmp fails" >&2; exit 1; fi
	@if [ "$(NO_CUDA)" = 1 ]; then echo "  ✗ CUDA       off (NO_CUDA=1)"; \
	 elif command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then \
	   echo "  ✓ CUDA       nvcc found (the CUDA backend is not part of this build yet)"; \
	 else echo "  ✗ CUDA       no nvcc"; fi
	@if [ "$(NO_NCCL)" = 1 ]; then echo "  ✗ NCCL       off (NO_NCCL=1)"; \
	 elif [ -f /usr/include/nccl.h ] || [ -f /usr/local/cuda/include/nccl.h ]; then \
	   echo "  ✓ NCCL       nccl.h found (used by the replica layer, not built yet)"; \
	 else echo "  ✗ NCCL       no nccl.h"; fi
	@if [ "$(NO_MPI)" = 1 ]; then echo "  ✗ MPI        off (NO_MPI=1)"; \
	 elif command -v mpicc >/dev/null 2>&1; then echo "  ✓ MPI        mpicc found (used by the replica layer, not built yet)"; \
	 else echo "  ✗ MPI        no mpicc (apt-get install openmpi-bin libopenmpi-dev)"; fi

# ---- programs ---------------------------------------------------------------
segnet: segnet.c segnet.h | deps
	$(CC) $(CFLAGS) $(OMP_FLAGS) $(DEP_CFLAGS) -o $@ segnet.c $(DEP_LIBS) $(LDLIBS)

test_segnet: test_segnet.c segnet.c segnet.h | deps
	$(CC) $(CFLAGS) $(OMP_FLAGS) $(DEP_CFLAGS) -o $@ test_segnet.c $(DEP_LIBS) $(LDLIBS)

test: test_segnet
	./test_segnet

train: segnet
	./segnet train

clean:
	rm -f segnet test_segnet
