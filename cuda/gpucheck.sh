#!/bin/bash
# gpucheck.sh -- make gpucheck: what a machine with an NVIDIA GPU says of segnet,
# from programs built beforehand by make gpubuild (in $GPUCHECK_DIR), within a
# stated time budget. The stages, each time-boxed inside the whole budget
# (GPU_SECONDS), most telling first:
#   1. the cuda_ tests on the device (test_segnet_gpu: the kernels built by nvcc);
#   2. compute-sanitizer's memcheck and racecheck over them, where the tool can
#      attach to the device (a sandboxed machine may refuse it: one line says so);
#   3. GPU_STEPS training steps of each GPU_MODELS entry: segnet in bf16 (CUDA
#      graphs), the same model, size and batch in PyTorch (autocast,
#      channels_last) when a python3 on PATH has a torch that sees the GPU,
#      then segnet's variants: fp16; bf16 op by op (SEGNET_CUDA_GRAPHS=0,
#      "eager"); bf16 with --checkpoint blocks; bf16 k×k convs by im2col and
#      cuBLAS (SEGNET_CONV=gemm, "gemm");
#   4. each model's GPU_KERNEL_ROWS kernels and cuBLAS GEMMs with the most
#      device time per step (bf16), with the GB/s and TFLOP/s they declare.
# Every stage's result is written to gpucheck.txt (in GPUCHECK_OUT, default
# here) and printed the moment it is known, so a run stopped by a time limit
# still leaves what finished. A value not measured is "-" (no ratio is taken
# of it). The exit status is the cuda_ tests'.
set -u
dir=${GPUCHECK_DIR:-gpucheck-bin}
out_dir=${GPUCHECK_OUT:-.}
seconds=${GPU_SECONDS:-330}
steps=${GPU_STEPS:-20}
rows=${GPU_KERNEL_ROWS:-25}
models=${GPU_MODELS:-"unet-effv2-l:--model unet-effv2-l --size 512x512 --batch 8 --classes 4
effv2-l:--model effv2-l --size 384x384 --batch 16 --classes 1000"}
start=$(date +%s)
end=$((start + seconds))
mkdir -p "$out_dir"
out=$out_dir/gpucheck.txt
: >"$out"

# seconds left for a step that wants at most $1 (at least 1)
budget() {
  local left=$((end - $(date +%s)))
  [ "$left" -gt "$1" ] && left=$1
  [ "$left" -lt 1 ] && left=1
  echo "$left"
}
# a line of the result, now
say() { echo "$*" | tee -a "$out"; }
# value of "key: value" in text $1, or "-"
get() {
  local v
  v=$(printf '%s\n' "$1" | sed -n "s/^$2: //p" | head -n 1)
  echo "${v:--}"
}
elapsed() { echo "$(($(date +%s) - start)) s"; }

for f in "$dir/segnet" "$dir/test_segnet_gpu"; do
  [ -x "$f" ] || { echo "gpucheck: no $f (make gpubuild builds the programs; carry $dir to the GPU machine)" >&2; exit 2; }
done
gpu=$(nvidia-smi -L 2>/dev/null | head -n 1)
say "gpu: ${gpu:-none visible (nvidia-smi -L failed): the stages below fail}"
say "budget: $seconds s for everything below (GPU_SECONDS)"
built=$(cat "$dir/SOURCES" 2>/dev/null || echo unknown)
now=$(cat $(cat "$dir/SOURCE_FILES" 2>/dev/null || echo /dev/null) 2>/dev/null | sha256sum | cut -c1-16)
if [ "$built" = "$now" ]; then say "programs: $dir, built from these sources ($built)"
else say "programs: $dir, built from other sources ($built; these: $now): make gpubuild again"; fi

# ---- 1. the cuda_ tests on the device
t_budget=$(budget "${GPU_TEST_SECONDS:-100}")
echo "== 1. the cuda_ tests on the device (at most $t_budget s)" >&2
timeout "$t_budget" "$dir/test_segnet_gpu" --filter cuda_ >"$out_dir/gpucheck-tests.log" 2>&1
trc=$?
grep -E '^(FAIL|    FAIL)' "$out_dir/gpucheck-tests.log" >&2
count=$(grep -E '^[0-9]+ passed, [0-9]+ failed, [0-9]+ skipped$' "$out_dir/gpucheck-tests.log" || echo "no count line")
cut=""; [ $trc = 124 ] && cut=", cut short after $t_budget s"
say "cuda_ tests: $count (exit $trc$cut; gpucheck-tests.log) [$(elapsed)]"

# ---- 2. compute-sanitizer, where it can attach
san=$(command -v compute-sanitizer || { [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" ] && echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer"; })
if [ -z "$san" ]; then
  say "compute-sanitizer: not installed"
else
  # one small test first: a tool that cannot attach ("Device not supported",
  # no permission) reports that, which is not a finding about segnet's kernels
  probe=$(timeout "$(budget 40)" "$san" --tool memcheck "$dir/test_segnet_gpu" --filter cuda_fill_copy 2>&1)
  if ! printf '%s\n' "$probe" | grep -q '^========= ERROR SUMMARY'; then
    say "compute-sanitizer: unavailable here ($(printf '%s\n' "$probe" | grep -m1 -E 'Error|error|not supported|denied' | cut -c1-120))"
  else
    for tool in memcheck racecheck; do
      s_budget=$(budget "${GPU_SANITIZER_SECONDS:-45}")
      echo "== 2. the cuda_ tests under compute-sanitizer $tool (at most $s_budget s)" >&2
      log=$out_dir/gpucheck-$tool.log
      timeout "$s_budget" "$san" --tool "$tool" --error-exitcode 3 "$dir/test_segnet_gpu" --filter cuda_ >"$log" 2>&1
      src=$?
      n=$(grep -cE '^(ok|FAIL) ' "$log")
      errs=$(sed -n 's/^========= ERROR SUMMARY: \([0-9]*\) error.*/\1/p' "$log" | tail -n 1)
      if [ $src = 124 ]; then
        v="cut short after $s_budget s: $n tests run, $(grep -cE '^========= (Invalid|Program hit|Race|Error)' "$log") errors so far"
      else
        v="${errs:-no} errors reported in $n tests (exit $src$([ $src = 3 ] && echo ": errors found, see ${log##*/}"))"
      fi
      say "compute-sanitizer $tool: $v [$(elapsed)]"
    done
  fi
fi

# ---- 3. training steps: segnet against PyTorch
py="${GPU_PYTHON:-}"
if [ -z "$py" ]; then
  for d in $(echo "$PATH" | tr : ' ') /usr/bin; do
    [ -x "$d/python3" ] && "$d/python3" -c 'import torch' >/dev/null 2>&1 && { py="$d/python3"; break; }
  done
fi
torch_gpu=0
[ -n "$py" ] && "$py" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null && torch_gpu=1
if [ $torch_gpu = 1 ]; then say "pytorch: $py, sees the GPU"
else say "pytorch: not run (${py:-no python3 on PATH imports torch}${py:+: its torch sees no GPU})"; fi
# a row: model precision variant segnet-i/s torch-i/s segnet-bytes torch-bytes,
# ratios only of numbers
row() {
  echo "$@" | awk 'function num(x) { return x ~ /^[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?$/ }
    function f(x, d, s) { return num(x) ? sprintf("%" d ".2f", x / s) : sprintf("%" d "s", "-") }
    function r(a, b) { return num(a) && num(b) && b > 0 ? sprintf("%7.2f", a / b) : sprintf("%7s", "-") }
    { printf "%-13s %-5s %-6s %s %s %s %s %s %s\n", $1, $2, $3, f($4, 10, 1), f($5, 10, 1), r($4, $5),
        f($6, 11, 1073741824), f($7, 11, 1073741824), r($6, $7) }'
}
say "$(printf '%-13s %-5s %-6s %10s %10s %7s %11s %11s %7s' model prec run 'segnet i/s' 'torch i/s' ratio 'segnet GiB' 'torch GiB' ratio)"
echo "$models" | while IFS= read -r m; do
  [ -n "$m" ] || continue
  name=${m%%:*}; args=${m#*:}
  t=""
  if [ $torch_gpu = 1 ]; then
    echo "== 3. $name bf16: ref/bench_torch.py --device cuda $args" >&2
    t=$(timeout "$(budget 90)" "$py" ref/bench_torch.py --device cuda --precision bf16 $args --steps "$steps" --warmup 3) || t=""
  fi
  for v in graphs fp16 eager blocks gemm; do
    p=bf16; ckpt=none; graphs=1; conv=implicit
    case $v in
      fp16) p=fp16 ;; eager) graphs=0 ;; blocks) ckpt=blocks ;; gemm) conv=gemm ;;
    esac
    echo "== 3. $name $v: segnet bench --device cuda --precision $p --checkpoint $ckpt $args (SEGNET_CUDA_GRAPHS=$graphs SEGNET_CONV=$conv)" >&2
    s=$(SEGNET_CUDA_GRAPHS=$graphs SEGNET_CONV=$conv timeout "$(budget 60)" "$dir/segnet" bench --device cuda --precision $p --checkpoint $ckpt $args --steps "$steps" --warmup 3) || s=""
    # PyTorch's numbers beside segnet's bf16 rows (it runs bf16 only)
    tt=$t; [ $p = bf16 ] || tt=""
    say "$(row "$name" $p $v "$(get "$s" images_per_s)" "$(get "$tt" images_per_s)" "$(get "$s" peak_device_bytes)" "$(get "$tt" peak_device_bytes)")"
  done
done
say "[$(elapsed)]"

# ---- 4. device time per kernel
echo "$models" | while IFS= read -r m; do
  [ -n "$m" ] || continue
  name=${m%%:*}; args=${m#*:}
  echo "== 4. $name bf16: device time per kernel, segnet bench --kernels $rows" >&2
  k=$(timeout "$(budget 60)" "$dir/segnet" bench --device cuda --precision bf16 $args --steps 2 --warmup 1 --kernels "$rows") || k=""
  say "$name bf16, the $rows kernels and cuBLAS GEMMs with the most device time per step:"
  table=$(printf '%s\n' "$k" | sed -n '/^kernel /,/^sum /p' | grep .)
  say "${table:-  (not run: no output)}"
done
say "total: $(elapsed) of the $seconds s budget"
exit $trc
