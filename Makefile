# segnet -- build, test, train.
#
#   make            build ./segnet and ./test_segnet (CPU backend, always)
#   make test       build and run the test suite
#   make test-heavy the checks that take minutes (16-bit training vs fp32)
#   make train      build and run the main job on the bundled data
#   make bench      segnet bench against PyTorch (ref/bench_torch.py), same run
#   make gpucheck   on a machine with a GPU: the cuda_ tests on the device, and
#                   segnet against PyTorch on it; table in gpucheck.txt
#
# Switches: NO_OMP=1 (no OpenMP), NO_NATIVE=1 (no -march=native), NO_CUDA=1, NO_NCCL=1, NO_MPI=1 (skip the
# detection of each: segnet is then built without that part).
#
# Build dependencies come from Debian packages, never from copies in this repo:
# OpenBLAS (libopenblas-openmp-dev) and stb_image (libstb-dev). When one is
# missing, `make` installs it with apt-get if run as root, else stops with the
# command to run.
#
# OpenBLAS is its OpenMP build, pinned with an rpath: GEMMs then run in the
# same thread pool as segnet's own loops. With the pthread build the two pools
# spin against each other (a 0.03 s test took 74 s on 2 busy cores).

CC      ?= gcc
CFLAGS  ?= -O2 -g
CFLAGS  += -std=gnu11 -Wall -Wextra -Wno-unknown-pragmas -pthread
LDLIBS  += -lm

MULTIARCH    := $(shell $(CC) -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
OPENBLAS_DIR := /usr/lib/$(MULTIARCH)/openblas-openmp
OPENBLAS_PC  := PKG_CONFIG_PATH=$(OPENBLAS_DIR)/pkgconfig pkg-config

# The CPU ops' inner loops are written for the compiler to vectorise: build for
# this machine's vector units (AVX2/AVX-512) when the compiler accepts
# -march=native; NO_NATIVE=1 (or a compiler without it) gives a portable build.
ifneq ($(NO_NATIVE),1)
  ARCH_FLAGS := $(shell echo 'int main(void){return 0;}' | $(CC) -march=native -x c - -o /dev/null 2>/dev/null && echo -march=native)
endif
CFLAGS += $(ARCH_FLAGS)

# CUDA: kernels.cu is built twice. nvcc builds it for GPUs and ./segnet links
# it with cudart, cuBLAS and NCCL (`--device auto` falls back to the CPU when
# the machine has no GPU). g++ builds it against the emulator (cuda_emu.h,
# cuda_emu.cpp) and ./test_segnet links that, so the cuda_ tests run every
# kernel on the CPU. Without nvcc (or with NO_CUDA=1) both programs are CPU-only.
CUDA_HOME  ?= /usr/local/cuda
CUDA_ARCHS ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
ifneq ($(NO_CUDA),1)
  NVCC := $(shell command -v nvcc 2>/dev/null || { [ -x $(CUDA_HOME)/bin/nvcc ] && echo $(CUDA_HOME)/bin/nvcc; })
endif
# NCCL (the replicas' all-reduce on GPUs, kernels.cu) is in the CUDA build
# unless NO_NCCL=1: the GPU build links -lnccl, the emulated one the emulator's
# NCCL (cuda_emu.cpp). Without it, replicas on GPUs are refused with a message.
ifneq ($(NVCC),)
  NCCL_H := $(firstword $(wildcard $(CUDA_HOME)/include/nccl.h /usr/include/nccl.h))
  ifeq ($(NO_NCCL),1)
    NCCL_H :=
  endif
  ifneq ($(NCCL_H),)
    NCCL_CFLAGS := -DSEGNET_NCCL
    NCCL_LIBS   := -lnccl
  endif
  CUDA_CFLAGS  := -DSEGNET_CUDA $(NCCL_CFLAGS) -I$(CUDA_HOME)/include
  CUDA_LIBS    := -L$(CUDA_HOME)/lib64 -L$(CUDA_HOME)/lib -Wl,-rpath,$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib \
                  -lcudart -lcublas $(NCCL_LIBS) -lstdc++
  GPU_OBJS     := kernels_gpu.o
  EMU_OBJS     := kernels_emu.o cuda_emu.o
  EMU_LIBS     := -lstdc++
endif
CXX      ?= g++
EMUFLAGS := -std=c++17 -O2 -g -Wall -Wextra -Wno-unknown-pragmas -Wno-sign-compare -I. -I$(CUDA_HOME)/include $(NCCL_CFLAGS)
NVCCFLAGS ?= -O3 -std=c++17 -Xcompiler -Wall,-Wextra -Werror all-warnings -I.
NVCCFLAGS += $(NCCL_CFLAGS)

# MPI: ./segnet is built with it when mpicc is found (OpenMPI, Debian's
# openmpi-bin and libopenmpi-dev), so that `mpirun -np N ./segnet train ...`
# runs one replica per process; without it ./segnet refuses to run under a
# launcher with several processes. ./test_segnet runs the MPI tests through
# ./segnet and mpirun.
ifneq ($(NO_MPI),1)
  MPICC := $(shell command -v mpicc 2>/dev/null)
endif
ifneq ($(MPICC),)
  MPI_CFLAGS := -DSEGNET_MPI $(shell $(MPICC) --showme:compile 2>/dev/null)
  MPI_LIBS   := $(shell $(MPICC) --showme:link 2>/dev/null)
endif

ifeq ($(NO_OMP),1)
  OMP_FLAGS :=
else
  OMP_FLAGS := -fopenmp
endif

# Evaluated when a recipe runs, i.e. after `deps` has installed what was missing.
DEP_CFLAGS = $(shell $(OPENBLAS_PC) --cflags openblas 2>/dev/null) -I/usr/include/stb
DEP_LIBS   = $(shell $(OPENBLAS_PC) --libs openblas 2>/dev/null) -Wl,-rpath,$(OPENBLAS_DIR) -lstb

.PHONY: all deps test test-heavy train bench gpucheck clean

all: segnet test_segnet

# ---- dependencies and feature detection -------------------------------------
deps:
	@missing=""; \
	command -v pkg-config >/dev/null 2>&1 || missing="$$missing pkg-config"; \
	[ -f $(OPENBLAS_DIR)/pkgconfig/openblas.pc ] || missing="$$missing libopenblas-openmp-dev"; \
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
	@echo "  ✓ OpenBLAS   $$($(OPENBLAS_PC) --modversion openblas) (OpenMP build)"
	@echo "  ✓ stb_image  /usr/include/stb/stb_image.h"
	@if [ -n "$(ARCH_FLAGS)" ]; then echo "  ✓ vectorised -march=native"; \
	 else echo "  ✗ vectorised portable build (NO_NATIVE=1, or $(CC) refuses -march=native)"; fi
	@if [ "$(NO_OMP)" = 1 ]; then echo "  ✗ OpenMP     off (NO_OMP=1)"; \
	 elif echo 'int main(void){return 0;}' | $(CC) -fopenmp -x c - -o /dev/null 2>/dev/null; then echo "  ✓ OpenMP"; \
	 else echo "  ✗ OpenMP     $(CC) -fopenmp fails" >&2; exit 1; fi
	@if [ "$(NO_CUDA)" = 1 ]; then echo "  ✗ CUDA       off (NO_CUDA=1)"; \
	 elif [ -n "$(NVCC)" ]; then \
	   echo "  ✓ CUDA       $(NVCC): ./segnet --device cuda, ./test_segnet runs the kernels emulated"; \
	 else echo "  ✗ CUDA       no nvcc: CPU backend only"; fi
	@if [ "$(NO_NCCL)" = 1 ]; then echo "  ✗ NCCL       off (NO_NCCL=1): no replicas on GPUs"; \
	 elif [ -z "$(NVCC)" ]; then echo "  ✗ NCCL       no CUDA build"; \
	 elif [ -n "$(NCCL_H)" ]; then \
	   echo "  ✓ NCCL       $(NCCL_H), -lnccl: --replicas N / mpirun with --device cuda, one GPU per replica"; \
	 else echo "  ✗ NCCL       no nccl.h: no replicas on GPUs"; fi
	@if /usr/bin/python3 -c 'import torch, torchvision' >/dev/null 2>&1; then \
	   echo "  ✓ PyTorch    (reference: make test runs the live parity checks)"; \
	 else echo "  ✗ PyTorch    live parity checks not run (apt-get install python3-torch python3-torchvision)"; fi
	@if [ "$(NO_MPI)" = 1 ]; then echo "  ✗ MPI        off (NO_MPI=1)"; \
	 elif [ -n "$(MPICC)" ]; then echo "  ✓ MPI        $(MPICC): mpirun -np N ./segnet train runs N replicas"; \
	 else echo "  ✗ MPI        no mpicc (apt-get install openmpi-bin libopenmpi-dev)"; fi

# ---- programs ---------------------------------------------------------------
segnet: segnet.c segnet.h $(GPU_OBJS) | deps
	$(CC) $(CFLAGS) $(OMP_FLAGS) $(DEP_CFLAGS) $(CUDA_CFLAGS) $(MPI_CFLAGS) -o $@ segnet.c $(GPU_OBJS) $(DEP_LIBS) $(CUDA_LIBS) $(MPI_LIBS) $(LDLIBS)

test_segnet: test_segnet.c segnet.c segnet.h $(EMU_OBJS) | deps
	$(CC) $(CFLAGS) $(OMP_FLAGS) $(DEP_CFLAGS) $(CUDA_CFLAGS) -o $@ test_segnet.c $(EMU_OBJS) $(DEP_LIBS) $(EMU_LIBS) $(LDLIBS)

kernels_gpu.o: kernels.cu segnet.h
	$(NVCC) $(NVCCFLAGS) $(CUDA_ARCHS) -c kernels.cu -o $@

kernels_emu.o: kernels.cu segnet.h cuda_emu.h
	$(CXX) $(EMUFLAGS) -x c++ -c kernels.cu -o $@

cuda_emu.o: cuda_emu.cpp cuda_emu.h
	$(CXX) $(EMUFLAGS) -c cuda_emu.cpp -o $@

test: segnet test_segnet
	./test_segnet
	@if [ -n "$(NVCC)" ]; then echo "== the emulated CUDA tests again, threads in reverse order"; \
	  CUEMU_ORDER=reverse ./test_segnet --filter cuda_; fi

# checks that take minutes (fp32/fp16/bf16 quickstart runs against each other)
test-heavy: segnet test_segnet
	SEGNET_HEAVY=1 ./test_segnet --filter heavy_

train: segnet
	./segnet train

# segnet bench and ref/bench_torch.py on the same models, batch, threads and
# steps; one row per model with the ratios segnet/PyTorch (step time, peak RSS).
BENCH_THREADS ?= 2
BENCH_STEPS   ?= 5
BENCH_WARMUP  ?= 2
BENCH_MODELS  ?= "effv2-s:--model effv2-s --padding symmetric --size 224x224 --batch 4" \
                 "unet:--model unet --depth 4 --width 32 --size 256x256 --batch 4"
bench: segnet
	@/usr/bin/python3 -c 'import torch, torchvision' 2>/dev/null || { echo "make bench: /usr/bin/python3 needs torch and torchvision (apt-get install python3-torch python3-torchvision)" >&2; exit 1; }
	@common="--classes 4 --threads $(BENCH_THREADS) --steps $(BENCH_STEPS) --warmup $(BENCH_WARMUP)"; \
	rows=""; \
	for m in $(BENCH_MODELS); do \
	  name=$${m%%:*}; args=$${m#*:}; \
	  echo "== $$name: segnet bench $$args $$common" >&2; \
	  s=$$(./segnet bench $$args $$common) || exit 1; echo "$$s" >&2; \
	  echo "== $$name: ref/bench_torch.py $$args $$common" >&2; \
	  t=$$(/usr/bin/python3 ref/bench_torch.py $$args $$common) || exit 1; echo "$$t" >&2; \
	  get() { echo "$$1" | sed -n "s/^$$2: //p"; }; \
	  rows="$$rows$$name $$(get "$$s" train_step_ms) $$(get "$$t" train_step_ms) $$(get "$$s" peak_rss_bytes) $$(get "$$t" peak_rss_bytes)\n"; \
	done; \
	printf "$$rows" | awk 'BEGIN { printf "%-9s %12s %12s %7s %13s %13s %7s\n", "model", "segnet ms", "pytorch ms", "ratio", "segnet MiB", "pytorch MiB", "ratio" } \
	  { printf "%-9s %12.1f %12.1f %7.2f %13.1f %13.1f %7.2f\n", $$1, $$2, $$3, $$2 / $$3, $$4 / 1048576, $$5 / 1048576, $$4 / $$5 }'

# ---- make gpucheck: on a machine with an NVIDIA GPU (none on our CI) ----------
# 1. the cuda_ tests on the device: test_segnet linked with the nvcc-built
#    kernels for this GPU instead of the emulator;
# 2. GPU_STEPS training steps of each GPU_MODELS entry in bf16 and fp16, with
#    and without --checkpoint blocks, then the same model, size and batch in
#    PyTorch (its GPU library kernels, autocast, channels_last) when torch sees the GPU;
# 3. one table (images/s, peak device memory, segnet/PyTorch ratios), also
#    written to gpucheck.txt.
# The whole target is sized to finish within 8 minutes on an H200.
GPU_STEPS  ?= 20
GPU_SECONDS ?= 360   # the benchmarks' whole budget (builds and the cuda_ tests come first): a run past it is cut short (its row shows nan)
GPU_MODELS ?= "unet-effv2-l:--model unet-effv2-l --size 512x512 --batch 8 --classes 4" \
              "effv2-l:--model effv2-l --size 384x384 --batch 16 --classes 1000"
test_segnet_gpu: test_segnet.c segnet.c segnet.h kernels.cu | deps
	$(NVCC) $(NVCCFLAGS) -arch=native -c kernels.cu -o kernels_native.o
	$(CC) $(CFLAGS) $(OMP_FLAGS) $(DEP_CFLAGS) $(CUDA_CFLAGS) -DSEGNET_TEST_GPU -o $@ test_segnet.c kernels_native.o $(DEP_LIBS) $(CUDA_LIBS) $(LDLIBS)

gpucheck: test_segnet_gpu segnet
	@nvidia-smi -L 2>/dev/null || { echo "make gpucheck: no GPU here (nvidia-smi -L failed)" >&2; exit 1; }
	./test_segnet_gpu --filter cuda_
	@rows=""; end=$$(( $$(date +%s) + $(GPU_SECONDS) )); \
	budget() { l=$$(( end - $$(date +%s) )); [ $$l -gt $$1 ] && l=$$1; [ $$l -lt 1 ] && l=1; echo $$l; }; \
	for m in $(GPU_MODELS); do \
	  name=$${m%%:*}; args=$${m#*:}; \
	  for p in bf16 fp16; do \
	    t=""; \
	    if /usr/bin/python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then \
	      echo "== $$name $$p: ref/bench_torch.py --device cuda $$args" >&2; \
	      t=$$(timeout $$(budget 90) /usr/bin/python3 ref/bench_torch.py --device cuda --precision $$p $$args --steps $(GPU_STEPS) --warmup 3) || t=""; \
	      echo "$$t" >&2; \
	    fi; \
	    for c in none blocks; do \
	      echo "== $$name $$p --checkpoint $$c: segnet bench --device cuda $$args" >&2; \
	      s=$$(timeout $$(budget 120) ./segnet bench --device cuda --precision $$p --checkpoint $$c $$args --steps $(GPU_STEPS) --warmup 3) || s=""; \
	      echo "$$s" >&2; \
	      get() { v=$$(echo "$$1" | sed -n "s/^$$2: //p"); echo $${v:-nan}; }; \
	      rows="$$rows$$name $$p $$c $$(get "$$s" images_per_s) $$(get "$$t" images_per_s) $$(get "$$s" peak_device_bytes) $$(get "$$t" peak_device_bytes)\n"; \
	    done; \
	  done; \
	done; \
	printf "$$rows" | awk 'BEGIN { printf "%-13s %-5s %-6s %10s %10s %7s %11s %11s %7s\n", "model", "prec", "ckpt", "segnet i/s", "torch i/s", "ratio", "segnet GiB", "torch GiB", "ratio" } \
	  { printf "%-13s %-5s %-6s %10.2f %10.2f %7.2f %11.2f %11.2f %7.2f\n", $$1, $$2, $$3, $$4, $$5, $$4 / $$5, $$6 / 1073741824, $$7 / 1073741824, $$6 / $$7 }' | tee gpucheck.txt

clean:
	rm -f segnet test_segnet test_segnet_gpu gpucheck.txt *.o
