# gpucount.awk -- one training step's kernel launches by configuration, and how
# well each fills an H200 (make gpucount). Reads two of the emulator's count
# files (CUEMU_COUNT: 1 and 2 timed steps after a warm-up); their difference
# is one step. A count file's "config N blocks threads dyn-smem registers
# static-smem blocks-per-SM name..." lines come from cuda_emu.cpp, the
# registers and static shared memory from the nvcc build's ptxas report
# (kernel_resources.txt); -1: unknown. Its "traffic BYTES FLOPS blocks ..."
# lines, with the same configurations, add up what those launches declared
# they move and compute (kernels.cu's Traffic).
#
# A launch of B blocks on S SMs holding b blocks each runs in W = ceil(B / (S·b))
# waves; its wave efficiency is B / (W·S·b), the share of the slots its waves
# hold busy (1: every wave full; a grid of one block: 1/(S·b)).
# Prints, per kernel (largest share of the step's launches first): launches,
# grid sizes, threads, registers, shared bytes, blocks and warps per SM, the
# lowest wave efficiency, its shares of the step's bytes and FLOPs; then the
# summary lines:
#   wave_efficiency_min:            over the launches that carry 95% of the
#                                   step's bytes, and those that carry 95% of its
#                                   FLOPs: the configurations taken by bytes (FLOPs)
#                                   per launch, largest first, until 95% of the
#                                   total, and any others as heavy per launch as the
#                                   last one taken (cuBLAS's GEMMs are not in it:
#                                   their grids are cuBLAS's choice)
#   wave_efficiency_min_full_grids: over the launches of at least one full wave
#   launches_under_one_wave:        launches with fewer blocks than one wave
#   warps_per_sm_min:               the fewest resident warps per SM of any launch
#   warps_per_sm_min_memory_bound:  the same without the implicit-GEMM convs
#                                   (conv_fwd/dgrad/wgrad_kernel: tensor cores, compute-bound)
# and the step's least time on an H200 (BANDWIDTH, PEAK_FLOPS), each launch and
# each cuBLAS GEMM ("gemm" lines: the bytes it must move, 2·m·n·k) taking
# max(bytes / bandwidth, FLOPs / peak):
#   step_ms_roofline:               every launch at the full bandwidth
#   step_ms_at_fill:                each kernel's launches at fill × the bandwidth,
#                                   fill = min(1, KB in flight per SM / 32) from the
#                                   SASS (an optional third file: make inflight's
#                                   kernel_inflight.txt through c++filt; a kernel
#                                   missing there counts fill 1, its bytes said)
#   fill_loss_ms:                   the kernels that lose the most time to their fill
# cuBLAS's GEMMs count at the roofline in both (their kernels are cuBLAS's); the
# bandwidth-bound estimate ignores launch gaps, L2 reuse and tails.

BEGIN { SMS = 132; BANDWIDTH = 4.8e12; PEAK_FLOPS = 790e12 }
FNR == 1 { file++ }
file == 1 && $1 == "config" { one[key(3)] = $2; next }
file == 1 && $1 == "traffic" { bytes1[key(4)] = $2; flops1[key(4)] = $3; next }
file == 1 && $1 == "gemm" { gemm1[key(5)] = $2; gbytes1[key(5)] = $3; gflops1[key(5)] = $4; next }
file == 1 { next }
file == 2 && $1 == "config" { two[key(3)] = $2 }
file == 2 && $1 == "traffic" { bytes2[key(4)] = $2; flops2[key(4)] = $3 }
file == 2 && $1 == "gemm" { gemm2[key(5)] = $2; gbytes2[key(5)] = $3; gflops2[key(5)] = $4 }
# kernel_inflight.txt demangled: "void NAME<...>(PARAMS) window B/th regs thr/SM KB/SM fill"
file == 3 && NF >= 7 { fill_of[inflight_name()] = $NF; n_fills++ }
function inflight_name(   s, i, c, depth) {
    s = $0; sub(/ +[^ ]+ +[^ ]+ +[^ ]+ +[^ ]+ +[^ ]+ +[^ ]+ *$/, "", s); sub(/^void /, "", s)
    depth = 0
    for (i = 1; i <= length(s); i++) {  # the parameters: from the first "(" outside <>
        c = substr(s, i, 1)
        if (c == "<") depth++
        else if (c == ">") depth--
        else if (c == "(" && depth == 0) return substr(s, 1, i - 1)
    }
    return s
}
function at_least(t, u) { return t > u ? t : u }
function key(first,   k, i) { k = $first; for (i = first + 1; i <= NF; i++) k = k " " $i; return k }
# the lowest wave efficiency over the configurations that carry `share` of the
# total of w[] (weights per configuration), taken by weight per launch, largest
# first; sets picked[k] for them
function min_over_share(w, share,   k, m, i, j, t, order, per, total, sum, lo) {
    m = 0; total = 0
    for (k in w) if (w[k] > 0) { order[++m] = k; per[k] = w[k] / count[k]; total += w[k] }
    for (i = 2; i <= m; i++)  # insertion sort: most per launch first, then by name
        for (j = i; j > 1 && (per[order[j]] > per[order[j - 1]] ||
                             (per[order[j]] == per[order[j - 1]] && order[j] < order[j - 1])); j--) {
            t = order[j]; order[j] = order[j - 1]; order[j - 1] = t
        }
    # the weight per launch at which the share is reached; every configuration
    # of at least that weight is in (ties at the boundary: all of them)
    sum = 0; cut = 0
    for (i = 1; i <= m && sum < share * total; i++) { sum += w[order[i]]; cut = per[order[i]] }
    lo = 2
    for (i = 1; i <= m && per[order[i]] >= cut; i++) {
        k = order[i]; picked[k] = 1
        if (effk[k] < lo || (effk[k] == lo && namek[k] < lo_name)) { lo = effk[k]; lo_name = namek[k] }
    }
    return lo
}
END {
    full_min = 2; under = 0; total = 0; wmin = mmin = 1e9
    for (k in two) {
        n = two[k] - (k in one ? one[k] : 0)
        if (n <= 0) continue
        split(k, f, " ")
        blocks = f[1]; threads = f[2]; dyn = f[3]; regs = f[4]; smem = f[5]; bps = f[6]
        name = k; for (i = 1; i <= 6; i++) sub(/^[^ ]+ /, "", name)
        if (bps <= 0) { unknown += n; continue }
        slots = SMS * bps
        waves = int((blocks + slots - 1) / slots)
        eff = blocks / (waves * slots)
        warps = bps * int((threads + 31) / 32)
        total += n
        count[k] = n; effk[k] = eff; namek[k] = name
        kbytes[k] = bytes2[k] - bytes1[k]; kflops[k] = flops2[k] - flops1[k]
        step_bytes += kbytes[k]; step_flops += kflops[k]
        nbytes[name] += kbytes[k]; nflops[name] += kflops[k]
        # ties: the first name in sort order (awk's "for (k in two)" has no order)
        if (blocks >= slots) {
            if (eff < full_min || (eff == full_min && name < full_worst)) {
                full_min = eff; full_worst = name
            }
        }
        else under += n
        if (warps < wmin || (warps == wmin && name < wworst)) { wmin = warps; wworst = name }
        if (name !~ /^conv_(fwd|dgrad|wgrad)_kernel/ &&
            (warps < mmin || (warps == mmin && name < mworst))) { mmin = warps; mworst = name }
        if (!(name in launches)) {
            gmin[name] = gmax[name] = blocks; emin[name] = eff; bmin[name] = bps
            wsm[name] = warps; thr[name] = threads; reg[name] = regs; sh[name] = smem + dyn
        }
        launches[name] += n
        if (blocks < gmin[name]) gmin[name] = blocks
        if (blocks > gmax[name]) gmax[name] = blocks
        if (eff < emin[name]) emin[name] = eff
        if (bps < bmin[name]) { bmin[name] = bps; wsm[name] = warps }
        if (smem + dyn > sh[name]) sh[name] = smem + dyn
    }
    printf "  %-64s %8s %15s %7s %4s %7s %6s %6s %7s %6s %6s\n", "kernel", "launches", "blocks",
           "threads", "regs", "shared", "blk/SM", "wrp/SM", "eff_min", "bytes%", "flops%"
    rows = "sort -t '\t' -k1,1nr -k2 | cut -f2-"
    for (name in launches)
        printf "%d\t  %-64s %8d %15s %7d %4d %7d %6d %6d %7.2f %6.1f %6.1f\n", launches[name],
               substr(name, 1, 64), launches[name],
               (gmin[name] == gmax[name] ? gmin[name] : gmin[name] "-" gmax[name]), thr[name],
               reg[name], sh[name], bmin[name], wsm[name], emin[name],
               (step_bytes > 0 ? 100 * nbytes[name] / step_bytes : 0),
               (step_flops > 0 ? 100 * nflops[name] / step_flops : 0) | rows
    close(rows)
    lo_name = ""; by_bytes = min_over_share(kbytes, 0.95); bytes_name = lo_name
    lo_name = ""; by_flops = min_over_share(kflops, 0.95); flops_name = lo_name
    for (k in picked) carrying += count[k]
    if (by_bytes <= 1 || by_flops <= 1)
        printf "  wave_efficiency_min: %.2f (%s; %d of %d launches carry 95%% of the bytes and of " \
               "the FLOPs)\n", (by_bytes < by_flops ? by_bytes : by_flops),
               (by_bytes < by_flops ? bytes_name : flops_name), carrying, total
    else
        printf "  wave_efficiency_min: no launch declares bytes or FLOPs\n"
    printf "  wave_efficiency_min_bytes: %.2f (%s)\n", (by_bytes > 1 ? 0 : by_bytes), bytes_name
    printf "  wave_efficiency_min_flops: %.2f (%s)\n", (by_flops > 1 ? 0 : by_flops), flops_name
    printf "  step_gbytes: %.3f\n  step_tflops: %.4f\n", step_bytes / 1e9, step_flops / 1e12
    printf "  wave_efficiency_min_full_grids: %.2f (%s)\n", (full_min > 1 ? 1 : full_min), \
           full_worst
    printf "  launches_under_one_wave: %d of %d\n", under, total
    printf "  warps_per_sm_min: %d (%s)\n", wmin, wworst
    printf "  warps_per_sm_min_memory_bound: %d (%s)\n", mmin, mworst
    if (unknown) printf "  launches_of_unknown_resources: %d\n", unknown
    # the least time: kernels (by configuration), then cuBLAS's GEMMs (by shape)
    for (k in count) {
        name = namek[k]
        roof = at_least(kbytes[k] / BANDWIDTH, kflops[k] / PEAK_FLOPS)
        if (name in fill_of && fill_of[name] > 0) fill = fill_of[name]
        else { fill = 1; unfilled += kbytes[k] }
        filled = at_least(kbytes[k] / (BANDWIDTH * fill), kflops[k] / PEAK_FLOPS)
        t_kernels += roof; t_filled += filled; lost[name] += filled - roof
    }
    for (k in gemm2) {
        calls = gemm2[k] - (k in gemm1 ? gemm1[k] : 0)
        if (calls <= 0) continue
        gb = gbytes2[k] - gbytes1[k]; gf = gflops2[k] - gflops1[k]
        gemm_calls += calls; gemm_bytes += gb; gemm_flops += gf
        t_gemm += at_least(gb / BANDWIDTH, gf / PEAK_FLOPS)
    }
    printf "  gemm_gbytes: %.3f  gemm_tflops: %.4f  (%d cuBLAS calls)\n", gemm_bytes / 1e9,
           gemm_flops / 1e12, gemm_calls
    printf "  step_ms_roofline: %.2f (kernels %.2f, cuBLAS %.2f; H200 %.1f TB/s, %d TFLOP/s)\n",
           1e3 * (t_kernels + t_gemm), 1e3 * t_kernels, 1e3 * t_gemm, BANDWIDTH / 1e12,
           PEAK_FLOPS / 1e12
    if (!n_fills) {
        printf "  step_ms_at_fill: no fills (make inflight CUOBJDUMP=path, then make gpucount)\n"
        exit
    }
    printf "  step_ms_at_fill: %.2f (kernels %.2f at their fill, cuBLAS %.2f; %.1f%% of the " \
           "kernels' bytes without a fill, counted at 1)\n", 1e3 * (t_filled + t_gemm),
           1e3 * t_filled, 1e3 * t_gemm, (step_bytes > 0 ? 100 * unfilled / step_bytes : 0)
    rows = "sort -t '\t' -k1,1gr -k2 | head -5 | cut -f2-"
    for (name in lost)
        if (lost[name] > 0)
            printf "%.9f\t  fill_loss_ms: %6.3f  fill %.2f  %s\n", lost[name], 1e3 * lost[name],
                   fill_of[name], substr(name, 1, 90) | rows
    close(rows)
}
