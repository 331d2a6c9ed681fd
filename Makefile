# segnet -- build, test, train.
#
#   make            build ./segnet and ./test_segnet (CPU backend, always)
#   make test       build and run the test suite but its slow tests (and, where the
#                   compiler has the sanitizers, make fuzz for FUZZ_TEST_SECONDS per
#                   target); the last line is "N passed, M failed, K skipped"
#   make check      make test with the slow tests too (what .ci/run runs)
#   make test-heavy the checks that take minutes (16-bit training vs fp32; Keras and timm
#                   weights against their frameworks, installed from PyPI into venvs)
#   make fuzz       fuzz the file readers under ASan and UBSan: FUZZ_SECONDS per
#                   target (default 60), findings with reproducers in fuzz-out/
#   make train      build and run the main job on the bundled data
#   make install    copy ./segnet to $(DESTDIR)$(PREFIX)/bin (PREFIX=/usr/local)
#   make bench      segnet bench against PyTorch (ref/bench_torch.py), same run
#   make gpucheck   on a machine with a GPU: the cuda_ tests on the device, and
#                   segnet against PyTorch on it, within GPU_SECONDS; gpucheck.txt
#   make gpubuild   build everything gpucheck runs, into gpucheck-bin/ (here:
#                   the GPU machine then only runs it)
#   make gpucount   what one training step asks of a GPU (kernel launches,
#                   cuBLAS calls, host waits, copies), counted on the emulator
#   make gpu-deps   download the build's Debian packages into .deps/ (for a
#                   machine with no network: make deps-unpack there, then
#                   DEPS_ROOT=$PWD/.deps/root on every make command)
#
# Switches: NO_OMP=1 (no OpenMP), NO_NATIVE=1 (no -march=native), NO_CUDA=1, NO_NCCL=1, NO_MPI=1 (skip the
# detection of each: segnet is then built without that part).
#
# Build dependencies come from Debian packages, never from copies in this repo:
# OpenBLAS (libopenblas-openmp-dev) and stb_image (libstb-dev). When one is
# missing, `make` installs it with apt-get if run as root, else stops with the
# command to run. With DEPS_ROOT=DIR (the packages unpacked there with
# dpkg -x) headers and libraries come from DIR and apt-get is never called.
#
# OpenBLAS is its OpenMP build, pinned with an rpath: GEMMs then run in the
# same thread pool as segnet's own loops. With the pthread build the two pools
# spin against each other (a 0.03 s test took 74 s on 2 busy cores).

CC      ?= gcc
CFLAGS  ?= -O2 -g
# -fno-math-errno: sqrtf and the other libm calls need not set errno (segnet
# never reads it), so the loops that call them vectorise (Adam's update);
# the results are the same bits, IEEE sqrt being correctly rounded either way.
# -fno-trapping-math: no code reads the floating-point exception flags, so a
# loop with a float comparison in it (ReLU's gradient, x > 0 ? dy : 0) may
# compute both sides and select, and vectorises (gcc 12 keeps it scalar
# otherwise: batch norm's backward sums ran at a tenth of their speed); the
# selected values are the same bits.
CFLAGS  += -std=gnu11 -Wall -Wextra -Wno-unknown-pragmas -pthread -fno-math-errno \
           -fno-trapping-math
LDLIBS  += -lm

MULTIARCH := $(shell $(CC) -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
# the packages of the build and of its libraries' own dependencies (libopenblas
# needs libgfortran, which needs libquadmath; libgomp comes with the compiler)
DEB_PACKAGES := libopenblas-openmp-dev libopenblas0-openmp libgfortran5 libquadmath0 libstb-dev libstb0
DEPS_DIR     := .deps
ifeq ($(DEPS_ROOT),)
  DEP_PREFIX :=
  # the system's libopenblas is pinned with an rpath (see above)
  DEP_RPATH  := -Wl,-rpath,/usr/lib/$(MULTIARCH)/openblas-openmp
else
  override DEPS_ROOT := $(abspath $(DEPS_ROOT))
  DEP_PREFIX := $(DEPS_ROOT)
  # DT_RPATH (not RUNPATH) so that libopenblas finds libgfortran there too:
  # RUNPATH would apply to ./segnet's own libraries only
  DEP_RPATH  := -Wl,--disable-new-dtags \
                -Wl,-rpath,$(DEPS_ROOT)/usr/lib/$(MULTIARCH)/openblas-openmp:$(DEPS_ROOT)/usr/lib/$(MULTIARCH)
endif
OPENBLAS_DIR := $(DEP_PREFIX)/usr/lib/$(MULTIARCH)/openblas-openmp
OPENBLAS_INC := $(DEP_PREFIX)/usr/include/$(MULTIARCH)/openblas-openmp
STB_INC      := $(DEP_PREFIX)/usr/include/stb
STB_LIBDIR   := $(DEP_PREFIX)/usr/lib/$(MULTIARCH)
DEP_CFLAGS   := -I$(OPENBLAS_INC) -I$(STB_INC)
DEP_LIBS     := -L$(OPENBLAS_DIR) -lopenblas -L$(STB_LIBDIR) -lstb $(DEP_RPATH)

# The CPU ops' inner loops are written for the compiler to vectorise: build for
# this machine's vector units (AVX2/AVX-512) when the compiler accepts
# -march=native; NO_NATIVE=1 (or a compiler without it) gives a portable build.
ifneq ($(NO_NATIVE),1)
  ARCH_FLAGS := $(shell echo 'int main(void){return 0;}' | $(CC) -march=native -x c - -o /dev/null 2>/dev/null && echo -march=native)
endif
CFLAGS += $(ARCH_FLAGS)

# CUDA: kernels.cu, with the chapters it includes (cuda/*.cuh; all of them: KERNELS_CU), is
# built twice. nvcc builds it for GPUs and ./segnet links
# it with cudart, cuBLAS and NCCL (`--device auto` falls back to the CPU when
# the machine has no GPU). g++ builds it against the emulator (cuda/cuda_emu.h,
# cuda/cuda_emu.cpp) and ./test_segnet links that, so the cuda_ tests run every
# kernel on the CPU. Without nvcc (or with NO_CUDA=1) both programs are CPU-only.
KERNELS_CU := kernels.cu $(wildcard cuda/*.cuh)
CUDA_HOME  ?= /usr/local/cuda
# GPU_ARCH: the GPU code's target, `native` (the GPU of this machine) when one
# is visible at build time, else sm_90 (H100/H200; sm_80 for an A100)
GPU_ARCH   ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo native || echo sm_90)
CUDA_ARCHS ?= -arch=$(GPU_ARCH)
ifneq ($(NO_CUDA),1)
  NVCC := $(shell command -v nvcc 2>/dev/null || { [ -x $(CUDA_HOME)/bin/nvcc ] && echo $(CUDA_HOME)/bin/nvcc; })
endif
# NCCL (the replicas' all-reduce on GPUs, kernels.cu) is in the CUDA build
# unless NO_NCCL=1: the GPU build links -lnccl, the emulated one the emulator's
# NCCL (cuda/cuda_emu.cpp). Without it, replicas on GPUs are refused with a message.
# NCCL_HOME=DIR takes DIR/include/nccl.h and DIR/lib/libnccl.so* (e.g. the one
# inside PyTorch's packages, site-packages/nvidia/nccl); else the toolkit's or
# the system's. None found: built without it, said by `make`.
ifneq ($(NVCC),)
  ifneq ($(NCCL_HOME),)
    NCCL_H   := $(wildcard $(NCCL_HOME)/include/nccl.h)
    NCCL_LIB := $(firstword $(wildcard $(NCCL_HOME)/lib/libnccl.so $(NCCL_HOME)/lib/libnccl.so.[0-9]))
    ifeq ($(NCCL_LIB),)
      NCCL_H :=
    endif
    NCCL_INC  := -I$(NCCL_HOME)/include
    NCCL_LINK := -L$(NCCL_HOME)/lib -Wl,-rpath,$(NCCL_HOME)/lib -l:$(notdir $(NCCL_LIB))
  else
    NCCL_H    := $(firstword $(wildcard $(CUDA_HOME)/include/nccl.h /usr/include/nccl.h))
    NCCL_LINK := -lnccl
  endif
  ifeq ($(NO_NCCL),1)
    NCCL_H :=
  endif
  ifneq ($(NCCL_H),)
    NCCL_CFLAGS := -DSEGNET_NCCL $(NCCL_INC)
    NCCL_LIBS   := $(NCCL_LINK)
  endif
  CUDA_CFLAGS  := -DSEGNET_CUDA $(NCCL_CFLAGS) -I$(CUDA_HOME)/include
  CUDA_LIBS    := $(NCCL_LIBS) -L$(CUDA_HOME)/lib64 -L$(CUDA_HOME)/lib -Wl,-rpath,$(CUDA_HOME)/lib64 \
                  -Wl,-rpath,$(CUDA_HOME)/lib -lcudart -lcublas -lstdc++
  GPU_OBJS     := kernels_gpu.o
  EMU_OBJS     := kernels_emu.o cuda_emu.o cuda_emu_probes.o
  # -rdynamic: the emulator finds a kernel's mangled name (dladdr), its key in
  # kernel_resources.txt
  EMU_LIBS     := -rdynamic -lstdc++ -ldl
  EMU_RESOURCES := kernel_resources.txt
endif
CXX      ?= g++
EMUFLAGS := -std=c++17 -O2 -g -Wall -Wextra -Wno-unknown-pragmas -Wno-sign-compare -I. -Icuda -I$(CUDA_HOME)/include $(NCCL_CFLAGS)
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

.PHONY: all deps test check test-heavy fuzz train install bench gpucheck gpubuild gpucount inflight gpu-deps deps-unpack clean

all: segnet test_segnet

# ---- dependencies and feature detection -------------------------------------
deps:
ifeq ($(DEPS_ROOT),)
	@missing=""; \
	[ -f $(OPENBLAS_INC)/cblas.h ] || missing="$$missing libopenblas-openmp-dev"; \
	[ -f $(STB_INC)/stb_image.h ] || missing="$$missing libstb-dev"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "segnet: installing missing Debian packages:$$missing"; \
	    log=$$(mktemp); \
	    if apt-get update -qq >$$log 2>&1 && \
	       DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >>$$log 2>&1; then rm -f $$log; \
	    else cat $$log >&2; rm -f $$log; echo "segnet: apt-get install failed; run: apt-get install -y$$missing" >&2; exit 1; fi; \
	  else \
	    echo "segnet: missing build dependencies. Run:" >&2; \
	    echo "  sudo apt-get install -y$$missing" >&2; \
	    exit 1; \
	  fi; \
	fi
else
	@for f in $(OPENBLAS_INC)/cblas.h $(OPENBLAS_DIR)/libopenblas.so $(STB_INC)/stb_image.h $(STB_LIBDIR)/libstb.so; do \
	  [ -e $$f ] || { echo "segnet: DEPS_ROOT=$(DEPS_ROOT) has no $${f#$(DEPS_ROOT)/} (make gpu-deps downloads the packages into $(DEPS_DIR)/, make deps-unpack unpacks them into $(DEPS_DIR)/root)" >&2; exit 1; }; \
	done
endif
	@echo "segnet build:"
	@echo "  ✓ OpenBLAS   $$(sed -n 's/^version=//p' $(OPENBLAS_DIR)/pkgconfig/openblas.pc) (OpenMP build) $(OPENBLAS_DIR)"
	@echo "  ✓ stb_image  $(STB_INC)/stb_image.h"
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
	   echo "  ✓ NCCL       $(NCCL_H), $(NCCL_LIBS): --replicas N / mpirun with --device cuda, one GPU per replica"; \
	 else echo "  ✗ NCCL       no nccl.h: no replicas on GPUs"; fi
	@if /usr/bin/python3 -c 'import torch, torchvision' >/dev/null 2>&1; then \
	   echo "  ✓ PyTorch    (reference: make test runs the live parity checks, make check all of them)"; \
	 else echo "  ✗ PyTorch    live parity checks not run (apt-get install python3-torch python3-torchvision)"; fi
	@if [ "$(NO_MPI)" = 1 ]; then echo "  ✗ MPI        off (NO_MPI=1)"; \
	 elif [ -n "$(MPICC)" ]; then echo "  ✓ MPI        $(MPICC): mpirun -np N ./segnet train runs N replicas"; \
	 else echo "  ✗ MPI        no mpicc (apt-get install openmpi-bin libopenmpi-dev)"; fi

# ---- programs ---------------------------------------------------------------
# segnet.c (the math, the models, the step) includes kernels_cpu.c and plumbing/ at its
# end: one translation unit; the plumbing's headers beside them
PLUMBING     := backends.c safetensors.c weights.c images.c datasets.c curves.c replicas.c run.c bench.c \
                cli.c safetensors.h images.h datasets.h curves.h run.h
PROGRAM_SRCS := segnet.c kernels_cpu.c $(addprefix plumbing/,$(PLUMBING))
# the tests beyond the ops, which test_segnet.c includes
TEST_SRCS := $(addprefix tests/,harness.c step.c backends.c application.c sources.c)

segnet: $(PROGRAM_SRCS) segnet.h $(GPU_OBJS) | deps
	$(CC) $(CFLAGS) $(OMP_FLAGS) $(DEP_CFLAGS) $(CUDA_CFLAGS) $(MPI_CFLAGS) -o $@ segnet.c $(GPU_OBJS) $(DEP_LIBS) $(CUDA_LIBS) $(MPI_LIBS) $(LDLIBS)

test_segnet: test_segnet.c $(TEST_SRCS) $(PROGRAM_SRCS) segnet.h $(EMU_OBJS) $(EMU_RESOURCES) | deps
	$(CC) $(CFLAGS) $(OMP_FLAGS) $(DEP_CFLAGS) $(CUDA_CFLAGS) -o $@ test_segnet.c $(EMU_OBJS) $(DEP_LIBS) $(EMU_LIBS) $(LDLIBS)

# segnet on the emulated GPU: ./segnet's build linked with the emulator
# (kernels_emu.o cuda_emu.o) instead of the nvcc object. With CUEMU_COUNT=FILE
# it counts what a run asks of the GPU without running a kernel (make gpucount).
segnet_emu: $(PROGRAM_SRCS) segnet.h $(EMU_OBJS) $(EMU_RESOURCES) | deps
	@[ -n "$(EMU_OBJS)" ] || { echo "make segnet_emu: needs the CUDA toolkit's nvcc and headers (none found, or NO_CUDA=1)" >&2; exit 1; }
	$(CC) $(CFLAGS) $(OMP_FLAGS) $(DEP_CFLAGS) $(CUDA_CFLAGS) $(MPI_CFLAGS) -o $@ segnet.c $(EMU_OBJS) $(DEP_LIBS) $(EMU_LIBS) $(MPI_LIBS) $(LDLIBS)

# kernels_gpu.o; ptxas's report of each kernel (-Xptxas -v) goes to
# kernels_gpu.ptxas, and from it kernel_resources.txt, a line per kernel:
#   mangled-name sm_XX registers static-shared-bytes spill-store-bytes stack-frame-bytes
# which the emulator reads (CUEMU_RESOURCES): a launch that asks for more
# registers than an SM has fails as on the GPU; make gpucount's occupancy.
kernels_gpu.o: $(KERNELS_CU) segnet.h
	$(NVCC) $(NVCCFLAGS) $(CUDA_ARCHS) -Xptxas -v -c kernels.cu -o $@ 2> kernels_gpu.ptxas \
	  || { cat kernels_gpu.ptxas >&2; rm -f $@; exit 1; }
	@grep -v '^ptxas info\|bytes stack frame\|^$$' kernels_gpu.ptxas >&2 || true

kernel_resources.txt: kernels_gpu.o
	@awk '/Compiling entry function/ { split($$0, q, "\047"); name = q[2]; arch = q[4]; spill = 0; stack = 0 } \
	  name != "" && /bytes spill stores/ { stack = $$1; \
	    for (i = 3; i <= NF; i++) if ($$i == "spill" && $$(i + 1) ~ /^stores/) spill = $$(i - 2) } \
	  name != "" && /Used [0-9]+ registers/ { regs = 0; smem = 0; \
	    for (i = 2; i <= NF; i++) { if ($$i ~ /^registers/) regs = $$(i - 1); if ($$i ~ /^smem/) smem = $$(i - 2) } \
	    print name, arch, regs, smem, spill, stack; name = "" }' kernels_gpu.ptxas > $@.tmp && mv $@.tmp $@

# make inflight: the bytes of global loads each kernel keeps in flight per SM,
# read from kernels_gpu.o's SASS (cuda/inflight.awk says how), a line per kernel in
# kernel_inflight.txt (test inflight_batch_norm_kernels reads it); the table
# from the fewest KB/SM up. Needs the toolkit's cuobjdump (CUOBJDUMP=path).
CUOBJDUMP ?= $(firstword $(shell command -v cuobjdump 2>/dev/null) $(wildcard $(CUDA_HOME)/bin/cuobjdump))
kernel_inflight.txt: kernels_gpu.o kernel_resources.txt cuda/inflight.awk
	@[ -n "$(CUOBJDUMP)" ] || { echo "make inflight: no cuobjdump (not on PATH, nor in CUDA_HOME=$(CUDA_HOME)): CUOBJDUMP=path" >&2; exit 1; }
	$(CUOBJDUMP) -sass kernels_gpu.o | awk -f cuda/inflight.awk kernel_resources.txt - > $@.tmp && mv $@.tmp $@

inflight: kernel_inflight.txt
	@sort -k6,6n -k1,1 kernel_inflight.txt | awk '{ printf "%5.1f %5.2f %5d %4d %6d %-6s %s\n", $$6, $$7, $$3, $$4, $$5, $$2, $$1; \
	  n++; if ($$6 >= 32) ok++ } \
	  BEGIN { printf "%5s %5s %5s %4s %6s %-6s %s\n", "KB/SM", "fill", "B/th", "regs", "thr/SM", "window", "kernel" } \
	  END { printf "%d kernels with global loads, %d keep >= 32 KB in flight per SM\n", n, ok > "/dev/stderr" }' | c++filt

kernels_emu.o: $(KERNELS_CU) segnet.h cuda/cuda_emu.h
	$(CXX) $(EMUFLAGS) -x c++ -c kernels.cu -o $@

cuda_emu.o: cuda/cuda_emu.cpp cuda/cuda_emu.h
	$(CXX) $(EMUFLAGS) -DCUEMU_RESOURCES_FILE='"$(CURDIR)/kernel_resources.txt"' -c cuda/cuda_emu.cpp -o $@

# The race checker's instrumentation: g++'s -fsanitize=thread puts a call
# before every load and store and in place of every atomic, and no
# ThreadSanitizer runtime is linked: cuda/cuda_emu.cpp implements the calls ("the
# race checker"). The emulator's probes (kernels with planted bugs that
# cuda_emu_semantics checks it on) are always built so.
RACEFLAGS := -fsanitize=thread
cuda_emu_probes.o: cuda/cuda_emu_probes.cpp cuda/cuda_emu.h
	$(CXX) $(EMUFLAGS) $(RACEFLAGS) -c cuda/cuda_emu_probes.cpp -o $@

# The strict build: kernels.cu as nvcc compiles it where results depend on it,
# multiply-adds contracted into FMAs (nvcc's default -fmad=true; -mfma), and
# every access race-checked; test_segnet_strict runs the cuda_ tests on it
# with device memory packed as an arena (make test: the strict pass). It runs
# only on a CPU with FMA instructions (x86-64 since 2013).
STRICTFLAGS := $(RACEFLAGS) -ffp-contract=fast -mfma
kernels_strict.o: $(KERNELS_CU) segnet.h cuda/cuda_emu.h
	$(CXX) $(EMUFLAGS) $(STRICTFLAGS) -x c++ -c kernels.cu -o $@

test_segnet_strict: test_segnet.c $(TEST_SRCS) $(PROGRAM_SRCS) segnet.h kernels_strict.o cuda_emu.o cuda_emu_probes.o $(EMU_RESOURCES) | deps
	$(CC) $(CFLAGS) $(OMP_FLAGS) $(DEP_CFLAGS) $(CUDA_CFLAGS) -DSEGNET_TEST_STRICT -o $@ test_segnet.c kernels_strict.o cuda_emu.o cuda_emu_probes.o $(DEP_LIBS) $(EMU_LIBS) $(LDLIBS)

# ---- make test, make check, make test-heavy ---------------------------------
# make test: the programs built in parallel, then every test but the slow ones
# (with the emulated CUDA backend the cuda_ tests again with the threads of each
# block in reverse order, and with the generic kernels, blocks and threads in a
# seeded random order, CUEMU_SEED; then a fourth time on the strict build,
# test_segnet_strict: FMA contraction, races checked, device memory packed as
# an arena), the fuzz harness last:
# its self-test and FUZZ_TEST_SECONDS per target, where FUZZ_CC has the
# sanitizers. The last line counts them all: N passed, M failed, K skipped,
# below the list of what was not run here and why.
# make check: the same with the slow tests too (the live PyTorch parity of the
# large models, the emulated GPU's whole steps): what .ci/run runs.
TEST_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
TEST_PROGRAMS = segnet test_segnet $(if $(EMU_OBJS),segnet_emu test_segnet_strict) $(if $(FUZZ_OK),fuzz_segnet) \
                $(if $(and $(EMU_OBJS),$(CUOBJDUMP)),kernel_inflight.txt)
TEST_ENV = $(if $(FUZZ_OK),SEGNET_FUZZ_BIN=./fuzz_segnet SEGNET_FUZZ_SECONDS=$(FUZZ_TEST_SECONDS) \
             SEGNET_FUZZ_SEED=$(FUZZ_SEED) SEGNET_FUZZ_OUT=$(FUZZ_OUT),\
             SEGNET_FUZZ_NONE="no sanitizers ($(FUZZ_CC) cannot build and run a program with $(FUZZ_SAN))") \
           $(if $(EMU_OBJS),SEGNET_STRICT_BIN=./test_segnet_strict)
test check:
	@$(MAKE) --no-print-directory $(if $(findstring -j,$(MAKEFLAGS)),,-j$(TEST_JOBS)) $(TEST_PROGRAMS)
	$(TEST_ENV) ./test_segnet$(if $(filter check,$@), --all)

# checks that take minutes (fp32/fp16/bf16 quickstart runs against each other;
# Keras' and timm's EfficientNetV2 through ref/export_pretrained.py against
# segnet predict, tensorflow-cpu and timm installed into venvs on first use)
test-heavy: segnet test_segnet
	SEGNET_HEAVY=1 ./test_segnet --filter heavy_

# ==== the tooling: fuzzing, training, benchmarks, GPU counts and checks, packages ====

# ---- make fuzz: the file readers under AddressSanitizer and UBSan -------------
# fuzz_segnet is test_segnet.c built with -DSEGNET_FUZZ (its runner replaced by
# tests/fuzz.c, the harness), CPU only and -O1 (it builds in about a minute): seeded
# mutation fuzzing of the safetensors, image, mask, EXIF orientation, CSV,
# checkpoint and config.txt readers and of whole commands
# (target cli: segnet's own main in a sandbox), FUZZ_SECONDS per target (FUZZ_SEED:
# the same inputs for the same seed). A finding is saved as FUZZ_OUT/TARGET-KIND-K.bin
# (./fuzz_segnet --replay FILE TARGET runs it) with its report beside it; the
# exit status is then 1. stb_image is compiled from the Debian header with ASan
# (fuzz_stb_image.o) so that memory errors inside the decoders are seen;
# libstb.so stays on the link line for stb_image_write.
FUZZ_CC           ?= $(CC)
FUZZ_SECONDS      ?= 60
FUZZ_TEST_SECONDS ?= 3
FUZZ_SEED         ?= 1
FUZZ_OUT          ?= fuzz-out
FUZZ_SAN    := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
# the tests are compiled but not called; -O1's range analysis warns of a
# truncation in segnet.c that -O2's does not
FUZZ_CFLAGS := -std=gnu11 -O1 -g -Wall -Wextra -Wno-unknown-pragmas -Wno-unused-function -Wno-format-truncation -pthread
# make test, check: FUZZ_OK=1 when FUZZ_CC builds and runs a program under the sanitizers
ifneq ($(filter test check,$(MAKECMDGOALS)),)
  FUZZ_OK := $(shell t=$$(mktemp) && echo 'int main(void){return 0;}' | $(FUZZ_CC) $(FUZZ_SAN) -x c - -o $$t >/dev/null 2>&1 \
                && $$t && echo 1; rm -f $$t)
endif

fuzz_stb_image.o: $(wildcard $(STB_INC)/stb_image.h) | deps
	$(FUZZ_CC) -x c -O1 -g -fsanitize=address -fno-omit-frame-pointer -w -DSTB_IMAGE_IMPLEMENTATION -c $(STB_INC)/stb_image.h -o $@

fuzz_segnet: test_segnet.c tests/fuzz.c $(TEST_SRCS) $(PROGRAM_SRCS) segnet.h fuzz_stb_image.o | deps
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(FUZZ_SAN) $(DEP_CFLAGS) -DSEGNET_FUZZ -o $@ test_segnet.c fuzz_stb_image.o $(DEP_LIBS) $(LDLIBS)

fuzz: fuzz_segnet
	./fuzz_segnet --seconds $(FUZZ_SECONDS) --seed $(FUZZ_SEED) --out $(FUZZ_OUT)

train: segnet
	./segnet train

# the program alone: its libraries are the system's (OpenBLAS by its rpath); DESTDIR stages
# a package's tree
PREFIX ?= /usr/local
install: segnet
	install -d $(DESTDIR)$(PREFIX)/bin
	install -m 755 segnet $(DESTDIR)$(PREFIX)/bin/segnet

# segnet bench and ref/bench_torch.py on the same models, batch, threads and
# steps; one row per model with the ratios segnet/PyTorch (step time, peak RSS).
# Then the end-to-end row: `segnet train` of the quickstart's U-Net on data/
# for BENCH_E2E_EPOCHS epochs (validation and a checkpoint each epoch) against
# ref/bench_train_torch.py doing the same as a PyTorch loop (a DataLoader over
# the same PNG folders, same threads), each process timed from start to exit
# (that row in ms). Then the loader row: `segnet bench --loader` against
# ref/bench_loader_torch.py (PyTorch's DataLoader, PIL decode and resize, the
# same augmentation) on one worker each, over the same folder of
# BENCH_LOADER_IMAGES JPEGs of 720x1200 batched at 300x500 (seed 001's size
# and augmentation), in ms per batch of 16. A shared machine has slower
# stretches of many seconds, so segnet and PyTorch run alternately
# BENCH_REPEATS times: the row gives the
# medians, the median of the pairs' ratios and their range.
BENCH_THREADS ?= 2
BENCH_REPEATS ?= 3
BENCH_E2E_EPOCHS ?= 3
BENCH_STEPS   ?= 5
BENCH_WARMUP  ?= 2
BENCH_LOADER_IMAGES ?= 64
BENCH_LOADER  ?= --model effv2-s --classes 2 --size 300x500 --batch 16 --workers 1 --steps 8 --warmup 1 --augment flip,brightness=0.5,contrast=0.5:1.5
# (a row's own options come after the common ones: effv2-l's steps of ~6 s run 2 after 1 warm-up)
BENCH_MODELS  ?= "effv2-s:--model effv2-s --padding symmetric --size 224x224 --batch 4" \
                 "unet:--model unet --depth 4 --width 32 --size 256x256 --batch 4" \
                 "unet-64:--model unet --depth 4 --width 16 --size 64x64 --batch 8" \
                 "effv2-l:--model effv2-l --padding symmetric --size 300x500 --batch 2 --steps 2 --warmup 1"
bench: segnet
	@/usr/bin/python3 -c 'import torch, torchvision' 2>/dev/null || { echo "make bench: /usr/bin/python3 needs torch and torchvision (apt-get install python3-torch python3-torchvision)" >&2; exit 1; }
	@common="--classes 4 --threads $(BENCH_THREADS) --steps $(BENCH_STEPS) --warmup $(BENCH_WARMUP)"; \
	get() { echo "$$1" | sed -n "s/^$$2: //p"; }; \
	rows=""; \
	for m in $(BENCH_MODELS); do \
	  name=$${m%%:*}; args=$${m#*:}; row="$$name"; \
	  for r in $$(seq $(BENCH_REPEATS)); do \
	    echo "== $$name ($$r/$(BENCH_REPEATS)): segnet bench $$common $$args" >&2; \
	    s=$$(./segnet bench $$common $$args) || exit 1; echo "$$s" >&2; \
	    echo "== $$name ($$r/$(BENCH_REPEATS)): ref/bench_torch.py $$common $$args" >&2; \
	    t=$$(/usr/bin/python3 ref/bench_torch.py $$common $$args) || exit 1; echo "$$t" >&2; \
	    row="$$row $$(get "$$s" train_step_ms) $$(get "$$t" train_step_ms) $$(get "$$s" peak_rss_bytes) $$(get "$$t" peak_rss_bytes)"; \
	  done; \
	  rows="$$rows$$row\n"; \
	done; \
	e2e="--model unet --depth 3 --width 16 --size 64x64 --data data/train --val data/val --classes 4 --class-weights 0,1,1,1 --batch 8 --epochs $(BENCH_E2E_EPOCHS) --schedule cosine --augment flip --threads $(BENCH_THREADS)"; \
	dir=$$(mktemp -d) || exit 1; hog=""; trap 'rm -rf "$$dir"; [ -z "$$hog" ] || kill $$hog' EXIT; \
	for row in e2e e2e-load; do \
	  if [ $$row = e2e-load ]; then sh -c 'while :; do :; done' & hog=$$!; fi; \
	  rows="$$rows$$row"; \
	  for r in $$(seq $(BENCH_REPEATS)); do \
	    echo "== $$row ($$r/$(BENCH_REPEATS)): segnet train $$e2e" >&2; \
	    t0=$$(date +%s.%N); ./segnet train $$e2e --out $$dir/segnet$$row$$r >$$dir/segnet.log 2>&1 || { cat $$dir/segnet.log >&2; exit 1; }; t1=$$(date +%s.%N); \
	    echo "== $$row ($$r/$(BENCH_REPEATS)): ref/bench_train_torch.py $$e2e" >&2; \
	    /usr/bin/python3 ref/bench_train_torch.py $$e2e --out $$dir/torch$$row$$r >$$dir/torch.log 2>&1 || { cat $$dir/torch.log >&2; exit 1; }; t2=$$(date +%s.%N); \
	    rows="$$rows $$(echo "$$t0 $$t1 $$t2" | awk '{ printf "%.3f %.3f 0 0", 1000 * ($$2 - $$1), 1000 * ($$3 - $$2) }')"; \
	    for side in segnet torch; do echo "$$row $$side $$(sed -n 's/^seconds: //p' $$dir/$$side.log)" >>$$dir/parts.txt; done; \
	  done; \
	  rows="$$rows\n"; \
	  if [ -n "$$hog" ]; then kill $$hog; hog=""; fi; \
	done; \
	row="loader"; \
	/usr/bin/python3 ref/bench_loader_torch.py --make-data $$dir/jpegs --images $(BENCH_LOADER_IMAGES) --size 720x1200 || exit 1; \
	for r in $$(seq $(BENCH_REPEATS)); do \
	  echo "== loader ($$r/$(BENCH_REPEATS)): segnet bench --loader $$dir/jpegs $(BENCH_LOADER)" >&2; \
	  s=$$(./segnet bench --loader $$dir/jpegs $(BENCH_LOADER)) || exit 1; echo "$$s" >&2; \
	  echo "== loader ($$r/$(BENCH_REPEATS)): ref/bench_loader_torch.py --loader $$dir/jpegs $(BENCH_LOADER)" >&2; \
	  t=$$(/usr/bin/python3 ref/bench_loader_torch.py --loader $$dir/jpegs $(BENCH_LOADER)) || exit 1; echo "$$t" >&2; \
	  row="$$row $$(get "$$s" loader_ms_per_batch) $$(get "$$t" loader_ms_per_batch) 0 0"; \
	done; \
	printf "$$rows$$row\n" | awk ' \
	  function median(a, n,   i, j, x) { for (i = 2; i <= n; i++) { x = a[i]; for (j = i - 1; j >= 1 && a[j] > x; j--) a[j + 1] = a[j]; a[j + 1] = x } \
	    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2 } \
	  BEGIN { printf "%-9s %12s %12s %7s %13s %13s %13s %7s\n", "model", "segnet ms", "pytorch ms", "ratio", "ratio range", "segnet MiB", "pytorch MiB", "ratio" } \
	  { n = (NF - 1) / 4; ms = mt = 0; \
	    for (i = 1; i <= n; i++) { s[i] = $$(4 * i - 2); t[i] = $$(4 * i - 1); q[i] = s[i] / t[i]; \
	      if ($$(4 * i) > ms) ms = $$(4 * i); if ($$(4 * i + 1) > mt) mt = $$(4 * i + 1) } \
	    lo = hi = q[1]; for (i = 2; i <= n; i++) { if (q[i] < lo) lo = q[i]; if (q[i] > hi) hi = q[i] } \
	    range = sprintf("%.2f-%.2f", lo, hi); \
	    if ($$1 == "e2e") printf "%-9s %12.0f %12.0f %7.2f %13s   (whole runs: unet on data/, $(BENCH_E2E_EPOCHS) epochs)\n", $$1, median(s, n), median(t, n), median(q, n), range; \
	    else if ($$1 == "e2e-load") printf "%-9s %12.0f %12.0f %7.2f %13s   (the same, a third process busy on one core)\n", $$1, median(s, n), median(t, n), median(q, n), range; \
	    else if ($$1 == "loader") printf "%-9s %12.1f %12.1f %7.2f %13s   (ms per batch of 16 JPEGs to 300x500, augmented, 1 worker)\n", $$1, median(s, n), median(t, n), median(q, n), range; \
	    else printf "%-9s %12.1f %12.1f %7.2f %13s %13.1f %13.1f %7.2f\n", $$1, median(s, n), median(t, n), median(q, n), range, \
	      ms / 1048576, mt / 1048576, ms / mt }'; \
	awk ' \
	  function median(a, n,   i, j, x) { for (i = 2; i <= n; i++) { x = a[i]; for (j = i - 1; j >= 1 && a[j] > x; j--) a[j + 1] = a[j]; a[j + 1] = x } \
	    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2 } \
	  { k = $$1 " " ($$2 == "torch" ? "pytorch" : $$2); if (!(k in runs)) order[++nk] = k; r = ++runs[k]; \
	    for (i = 3; i < NF; i += 2) { if (nk == 1 && r == 1) name[++nf] = $$i; v[k, $$i, r] = $$(i + 1) } } \
	  END { printf "\nwhere the whole runs'"'"' time goes (seconds, medians of $(BENCH_REPEATS); segnet train'"'"'s seconds: line)\n%-9s %-8s", "row", "side"; \
	    for (f = 1; f <= nf; f++) printf " %11s", name[f]; printf "\n"; \
	    for (i = 1; i <= nk; i++) { split(order[i], w, " "); printf "%-9s %-8s", w[1], w[2]; \
	      for (f = 1; f <= nf; f++) { for (r = 1; r <= runs[order[i]]; r++) a[r] = v[order[i], name[f], r]; printf " %11.2f", median(a, runs[order[i]]) } \
	      printf "\n" } }' $$dir/parts.txt

# ---- make gpucount: a training step's GPU work, counted without a GPU ---------
# For each GPUCOUNT_MODELS entry ("title:bench options"), segnet_emu runs
# `bench --device cuda` in the emulator's counting mode (CUEMU_COUNT: kernels,
# GEMMs and collectives counted, not run; device memory reserved, not
# committed) with 1 warm-up and 1 timed step, then with 2 timed steps; the
# difference of the counters is one step's. The last two lines of a block are
# the two runs' wall time and their larger peak host RSS. Between them, the
# step's launches by kernel and how well they fill an H200 (cuda/gpucount.awk,
# from the nvcc build's registers and shared memory, kernel_resources.txt), and
# the step's least time there: at the roofline, and with each kernel at the
# bandwidth its bytes in flight draw (kernel_inflight.txt, when make inflight
# has made it).
GPUCOUNT_MODELS ?= "effv2-l 384x384 b16 bf16:--model effv2-l --size 384x384 --batch 16 --classes 1000 --precision bf16" \
                   "unet-effv2-l 512x512 b8 bf16:--model unet-effv2-l --size 512x512 --batch 8 --classes 4 --precision bf16"
gpucount: segnet_emu
	@dir=$$(mktemp -d) || exit 1; trap 'rm -rf "$$dir"' EXIT; \
	for m in $(GPUCOUNT_MODELS); do \
	  title=$${m%%:*}; args=$${m#*:}; secs=""; rss=0; \
	  for k in 1 2; do \
	    cmd="./segnet_emu bench --device cuda $$args --warmup 1 --steps $$k"; \
	    t0=$$(date +%s.%N); \
	    CUEMU_COUNT=$$dir/count$$k.txt $$cmd > $$dir/run$$k.log 2>&1 \
	      || { echo "make gpucount: CUEMU_COUNT=FILE $$cmd failed:" >&2; cat $$dir/run$$k.log >&2; exit 1; }; \
	    secs="$$secs$${secs:+, }$$(echo "$$t0 $$(date +%s.%N)" | awk '{ printf "%.1f s", $$2 - $$1 }')"; \
	    r=$$(sed -n 's/^peak_rss_bytes: //p' $$dir/run$$k.log); [ "$${r:-0}" -gt "$$rss" ] && rss=$$r; \
	  done; \
	  echo "$$title:"; \
	  awk 'NR == FNR { one[$$1] = $$2; next } { two[$$1] = $$2 } \
	    END { n = split("launches:launches api_launches:api_launches graph_launches:graph_launches " \
	                    "blas_calls:cublas_calls nccl_calls:nccl_calls syncs:host_syncs h2d_bytes:h2d_bytes " \
	                    "d2h_bytes:d2h_bytes d2d_bytes:d2d_bytes", kv, " "); \
	          for (i = 1; i <= n; i++) { split(kv[i], p, ":"); \
	            if (!(p[1] in two) || !(p[1] in one)) { print "make gpucount: no counter " p[1] > "/dev/stderr"; exit 1 } \
	            printf "  %s_per_step: %d\n", p[2], two[p[1]] - one[p[1]] } }' $$dir/count1.txt $$dir/count2.txt || exit 1; \
	  if [ -f kernel_inflight.txt ]; then c++filt < kernel_inflight.txt > $$dir/inflight.txt; fi; \
	  awk -f cuda/gpucount.awk $$dir/count1.txt $$dir/count2.txt $$(ls $$dir/inflight.txt 2>/dev/null) \
	    || exit 1; \
	  echo "  count_runs: $$secs"; \
	  echo "  peak_host_rss_mib: $$((rss / 1048576))"; \
	  echo "  host_ms_per_step: $$(sed -n 's/^host_ms_per_step: //p' $$dir/run2.log)" \
	    "(this machine: the step's host work outside its device work, segnet bench)"; \
	done

# ---- make gpucheck: on a machine with an NVIDIA GPU (none on our CI) ----------
# Built here, run there. make gpubuild (any machine with nvcc, this one
# included) puts in GPUCHECK_DIR what the GPU machine runs: ./segnet and
# test_segnet_gpu built by nvcc for GPU_ARCH (sm_90: H100, H200) against the
# CUDA toolkit's cudart and cuBLAS, portable (no -march=native: the GPU
# machine's CPU may be another), stripped, without NCCL (one GPU), with the
# Debian libraries they load (OpenBLAS, libgfortran, libquadmath, stb, libgomp)
# in GPUCHECK_DIR/lib, found through an $$ORIGIN rpath; about 60 MiB, and a
# hash of the sources it was built from. On the GPU machine (no network, no
# apt, the same CUDA toolkit), the device tool runs
#     make gpucheck GPUCHECK_OUT=$$OUT        with carry ["gpucheck-bin"]
# which only runs (cuda/gpucheck.sh, whose header lists the stages): no build there,
# every stage time-boxed inside GPU_SECONDS (330 s), each result written to
# $$OUT/gpucheck.txt as soon as it is known.
GPUCHECK_DIR    ?= gpucheck-bin
GPUCHECK_OUT    ?= .
GPU_SECONDS     ?= 330
GPU_STEPS       ?= 20
GPU_KERNEL_ROWS ?= 25
GPU_PYTHON      ?=
GPUCHECK_SOURCES := $(PROGRAM_SRCS) segnet.h $(KERNELS_CU) test_segnet.c $(TEST_SRCS)
GPUCHECK_CFLAGS := -O2 -std=gnu11 -Wall -Wextra -Wno-unknown-pragmas -pthread -fno-math-errno -fno-trapping-math -s \
                   $(OMP_FLAGS) $(DEP_CFLAGS) -DSEGNET_CUDA -I$(CUDA_HOME)/include
GPUCHECK_LIBS   := -L$(OPENBLAS_DIR) -lopenblas -L$(STB_LIBDIR) -lstb -Wl,--disable-new-dtags \
                   -Wl,-rpath,'$$ORIGIN/lib' -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 \
                   -lcudart -lcublas -lstdc++ -lm

# test_segnet on a GPU with this machine's build (the cuda_ tests against the device)
test_segnet_gpu: test_segnet.c $(TEST_SRCS) $(PROGRAM_SRCS) segnet.h kernels_gpu.o kernel_resources.txt | deps
	$(CC) $(CFLAGS) $(OMP_FLAGS) $(DEP_CFLAGS) $(CUDA_CFLAGS) -DSEGNET_TEST_GPU -o $@ test_segnet.c kernels_gpu.o $(DEP_LIBS) $(CUDA_LIBS) $(LDLIBS)

gpubuild: | deps
	@[ -n "$(NVCC)" ] || { echo "make gpubuild: no nvcc (not on PATH, nor in CUDA_HOME=$(CUDA_HOME))" >&2; exit 1; }
	@rm -rf $(GPUCHECK_DIR) && mkdir -p $(GPUCHECK_DIR)/lib
	$(NVCC) -O3 -std=c++17 -Xcompiler -Wall,-Wextra -Werror all-warnings -I. -arch=$(GPU_ARCH) -c kernels.cu -o $(GPUCHECK_DIR)/kernels_gpu.o
	$(CC) $(GPUCHECK_CFLAGS) -o $(GPUCHECK_DIR)/segnet segnet.c $(GPUCHECK_DIR)/kernels_gpu.o $(GPUCHECK_LIBS)
	$(CC) $(GPUCHECK_CFLAGS) -DSEGNET_TEST_GPU -o $(GPUCHECK_DIR)/test_segnet_gpu test_segnet.c $(GPUCHECK_DIR)/kernels_gpu.o $(GPUCHECK_LIBS)
	@rm -f $(GPUCHECK_DIR)/kernels_gpu.o
	@for l in $$(ldd $(GPUCHECK_DIR)/segnet | awk '$$2 == "=>" && $$3 ~ /^\// { print $$3 }'); do \
	  case $${l##*/} in libopenblas*|libgfortran*|libquadmath*|libstb*|libgomp*) cp -L $$l $(GPUCHECK_DIR)/lib/;; esac; \
	done
	@echo "$(GPUCHECK_SOURCES)" > $(GPUCHECK_DIR)/SOURCE_FILES
	@cat $(GPUCHECK_SOURCES) | sha256sum | cut -c1-16 > $(GPUCHECK_DIR)/SOURCES
	@echo "make gpubuild: $(GPUCHECK_DIR)/ ($$(du -sm $(GPUCHECK_DIR) | cut -f1) MiB, for $(GPU_ARCH)); on the GPU machine: make gpucheck GPUCHECK_OUT=\$$OUT, carrying $(GPUCHECK_DIR)"

gpucheck:
	@[ -x $(GPUCHECK_DIR)/segnet ] || $(MAKE) --no-print-directory gpubuild
	@GPUCHECK_DIR=$(GPUCHECK_DIR) GPUCHECK_OUT=$(GPUCHECK_OUT) GPU_SECONDS=$(GPU_SECONDS) \
	  GPU_STEPS=$(GPU_STEPS) GPU_KERNEL_ROWS=$(GPU_KERNEL_ROWS) GPU_PYTHON=$(GPU_PYTHON) \
	  CUDA_HOME=$(CUDA_HOME) cuda/gpucheck.sh

# ---- builds without apt: the Debian packages as files -------------------------
# make gpu-deps (here, with apt) -> .deps/*.deb; carry .deps to the machine with
# no network; there: make deps-unpack, then make ... DEPS_ROOT=$PWD/.deps/root.
gpu-deps:
	@mkdir -p $(DEPS_DIR) && rm -f $(DEPS_DIR)/*.deb
	@cd $(DEPS_DIR) && { apt-get download $(DEB_PACKAGES) >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get download $(DEB_PACKAGES) >/dev/null 2>&1; }; } || \
	  { echo "make gpu-deps: apt-get download $(DEB_PACKAGES) failed (run apt-get update as root first)" >&2; exit 1; }
	@ls $(DEPS_DIR)/*.deb; echo "make gpu-deps: $$(ls $(DEPS_DIR)/*.deb | wc -l) packages, $$(du -sh $(DEPS_DIR) | cut -f1) in $(DEPS_DIR)/"

# dpkg-deb where there is one, else the .deb's data member by ar and tar
deps-unpack:
	@ls $(DEPS_DIR)/*.deb >/dev/null 2>&1 || { echo "make deps-unpack: no .deb files in $(DEPS_DIR)/ (make gpu-deps downloads them)" >&2; exit 1; }
	@rm -rf $(DEPS_DIR)/root $(DEPS_DIR)/ar && mkdir -p $(DEPS_DIR)/root
	@for f in $(DEPS_DIR)/*.deb; do \
	  if command -v dpkg-deb >/dev/null 2>&1; then dpkg-deb -x $$f $(DEPS_DIR)/root; \
	  else mkdir -p $(DEPS_DIR)/ar && (cd $(DEPS_DIR)/ar && ar x ../$${f##*/}) && tar -xf $(DEPS_DIR)/ar/data.tar.* -C $(DEPS_DIR)/root \
	    && rm -rf $(DEPS_DIR)/ar; fi \
	  || { echo "make deps-unpack: cannot unpack $$f" >&2; exit 1; }; \
	done
	@echo "make deps-unpack: $$(ls $(DEPS_DIR)/*.deb | wc -l) packages in $(DEPS_DIR)/root; build with DEPS_ROOT=$$PWD/$(DEPS_DIR)/root"

clean:
	rm -f segnet segnet_emu test_segnet test_segnet_strict test_segnet_gpu fuzz_segnet gpucheck.txt gpucheck-*.log *.o \
	  kernels_gpu.ptxas kernel_resources.txt kernel_inflight.txt
	rm -rf $(DEPS_DIR)/root $(GPUCHECK_DIR)
