# inflight.awk -- bytes of global loads each kernel keeps in flight per SM, read
# from the nvcc build's SASS (make inflight):
#
#   awk -f cuda/inflight.awk kernel_resources.txt SASS   (SASS: cuobjdump -sass kernels_gpu.o)
#
# A GPU issues a warp's instructions in order: an instruction that reads or
# writes a register a global load (LDG) has not yet filled waits for it, and
# every later instruction waits behind it. So the loads a thread has in flight
# at once are those issued between two such waits. For each kernel:
#   window   its first loop (a backward BRA) that holds a global load, or the
#            whole kernel when no loop does (a thread an element)
#   B/th     the bytes of the LDGs issued in the window before the first
#            instruction that touches a register one of them loads (an LDG's
#            destination: 1 register, 2 for .64, 4 for .128; an operand Rn of a
#            64-bit instruction (D*, .64) is Rn and Rn+1)
#   thr/SM   threads resident on an SM, blocks of BLOCK_THREADS:
#            min(32 blocks, 2048 threads, 65536 registers / (threads ·
#            registers rounded up to 8), 228 KiB / (static shared + 1 KiB))
#   KB/SM    B/th × thr/SM
# Little's law: an SM streams (bytes in flight) / (load latency). An H200's
# 4.8 TB/s over 132 SMs at ~1 µs of latency wants >= 32 KB in flight per SM
# (INFLIGHT_TARGET_KB); fill = min(1, KB/SM / 32) is the share of the bandwidth
# the kernel can draw by this estimate. Kernels without global loads are left out.
# kernel_resources.txt: "name arch registers static-shared spill stack" lines
# (-1: unknown); a kernel missing there counts 64 registers and no shared memory.
# Prints "name window B/th regs thr/SM KB/SM fill" (name: the mangled name).

BEGIN { BLOCK_THREADS = 256; INFLIGHT_TARGET_KB = 32 }
FNR == NR { regs[$1] = $3; smem[$1] = $4; next }
/Function : / { finish(); name = $3; n = 0; next }
/^ +\/\*[0-9a-f]+\*\/ / {
    a = $1; gsub(/[\/*]/, "", a)
    line = $0; sub(/^ +\/\*[0-9a-f]+\*\/ +/, "", line); sub(/ *;.*/, "", line)
    n++; addr[n] = hex(a); ins[n] = line
}
END { finish() }

function hex(s,    i, v) {  # a hexadecimal address (no strtonum in every awk)
    v = 0
    for (i = 1; i <= length(s); i++) v = v * 16 + index("0123456789abcdef", substr(s, i, 1)) - 1
    return v
}
function opcode(s) { sub(/^@!?U?P[0-9T] +/, "", s); sub(/ .*/, "", s); return s }
function is_load(s) { return opcode(s) ~ /^LDG/ }
# an LDG's width, from its opcode (an operand's .64 is a 64-bit address)
function load_regs(s) { s = opcode(s); return s ~ /\.128/ ? 4 : s ~ /\.64/ ? 2 : 1 }
function load_bytes(s) {
    s = opcode(s)
    if (s ~ /\.128/) return 16
    if (s ~ /\.64/) return 8
    if (s ~ /\.(U16|S16)/) return 2
    if (s ~ /\.(U8|S8)/) return 1
    return 4
}
# marks the registers the LDG s fills in pending[]
function mark(s,    op, r, k) {
    op = s; sub(/^@!?U?P[0-9T] +/, "", op); sub(/^[^ ]+ +/, "", op)
    if (!match(op, /^R[0-9]+/)) return
    r = substr(op, 2, RLENGTH - 1) + 0
    for (k = 0; k < load_regs(s); k++) pending[r + k] = 1
}
# whether s names a register in pending[]: an operand Rn, or Rn and Rn+1 when
# it is 64-bit (Rn.64, or every operand of a 64-bit instruction: D*, *.64)
function touches(s,    wide, t, r, w) {
    wide = opcode(s) ~ /^D|\.64/
    t = s; sub(/^@!?U?P[0-9T] +/, "", t); sub(/^[^ ]+/, "", t)
    while (match(t, /[^A-Z0-9_.]R[0-9]+(\.64)?/)) {  # Rn, not URn (uniform) nor RZ
        w = substr(t, RSTART + 1, RLENGTH - 1)
        r = w; sub(/\..*/, "", r); r = substr(r, 2) + 0
        if ((r in pending) || ((wide || w ~ /\.64$/) && ((r + 1) in pending))) return 1
        t = substr(t, RSTART + RLENGTH)
    }
    return 0
}
function finish(    i, j, t, lo, hi, window, bytes, blocks, b2, threads, kb, fill, r) {
    if (name == "") return
    lo = 1; hi = n; window = "kernel"
    for (i = 1; i <= n; i++) {  # the first loop holding a load
        if (ins[i] !~ /BRA [^x]*0x/) continue
        t = ins[i]; sub(/.*BRA [^x]*0x/, "", t); t = hex(t)
        if (t >= addr[i]) continue
        for (j = 1; j < i; j++) if (addr[j] >= t && is_load(ins[j])) break
        if (j < i) { for (lo = 1; addr[lo] < t; lo++); hi = i; window = "loop"; break }
    }
    bytes = 0; split("", pending)
    for (j = lo; j <= hi; j++) {
        if (touches(ins[j])) break
        if (is_load(ins[j])) { bytes += load_bytes(ins[j]); mark(ins[j]) }
    }
    if (bytes > 0) {
        r = (name in regs) && regs[name] > 0 ? regs[name] : 64
        blocks = int(2048 / BLOCK_THREADS); if (blocks > 32) blocks = 32
        b2 = int(65536 / (BLOCK_THREADS * (int((r + 7) / 8) * 8))); if (b2 < blocks) blocks = b2
        b2 = int(228 * 1024 / (((name in smem) && smem[name] > 0 ? smem[name] : 0) + 1024))
        if (b2 < blocks) blocks = b2
        threads = BLOCK_THREADS * blocks
        kb = bytes * threads / 1024.0
        fill = kb / INFLIGHT_TARGET_KB; if (fill > 1) fill = 1
        printf "%s %s %d %d %d %.1f %.2f\n", name, window, bytes, r, threads, kb, fill
    }
    name = ""; n = 0
}
