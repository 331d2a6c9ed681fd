// tests/sources.c -- the sources themselves: line lengths, rules for the CUDA kernels'
// code (reads past L1, shared memory through macros), make gpucheck's script.
// Part of test_segnet.c, which includes it: one program, its tests run in the order
// they are written (test_segnet.c, then tests/harness.c, step.c, backends.c,
// application.c, sources.c).

// ----------------------------------------------------------------------------
// the sources' layout: at most SOURCE_LINE_MAX characters (UTF-8 code points) per line

#define SOURCE_LINE_MAX 100
static const char *const SOURCE_FILES[] = {
        "segnet.c",           "kernels_cpu.c",          "segnet.h",
        "cuda/cuda_emu.h",    "cuda/cuda_emu.cpp",
        "plumbing/backends.c", "plumbing/safetensors.c", "plumbing/weights.c",
        "plumbing/images.c",  "plumbing/datasets.c",    "plumbing/curves.c",
        "plumbing/replicas.c", "plumbing/run.c",        "plumbing/bench.c",
        "plumbing/cli.c",     "plumbing/safetensors.h", "plumbing/images.h",
        "plumbing/datasets.h", "plumbing/curves.h",     "plumbing/run.h",
        "test_segnet.c",      "tests/fuzz.c",
        "tests/harness.c",    "tests/step.c",           "tests/backends.c",
        "tests/application.c", "tests/sources.c"};

// the lines of text longer than max characters: the first one's number in *first, and its
// length in *chars (both 0 when there is none); returns how many
static int long_lines(const char *text, size_t n, int max, int *first, int *chars) {
    int count = 0, line = 1, len = 0;
    *first = *chars = 0;
    for (size_t i = 0; i <= n; i++) {
        if (i == n || text[i] == '\n') {
            if (len > max && !count++) { *first = line; *chars = len; }
            line++; len = 0;
        } else if (((unsigned char)text[i] & 0xC0) != 0x80) {
            len++;  // a code point starts here (not a continuation byte)
        }
    }
    return count;
}

TEST(source_lines_short) {
    int first, chars;
    // 100 characters of which one (γ) takes two bytes: not long; 101 ASCII characters: long
    char text[256] = "a\n";
    memset(text + 2, 'x', 98); memcpy(text + 100, "γ\n", 3);
    memset(text + 103, 'y', 101); text[204] = 0;
    CHECK(long_lines(text, strlen(text), SOURCE_LINE_MAX, &first, &chars) == 1 && first == 3 &&
          chars == 101, "long_lines on a planted text: line %d, %d characters", first, chars);
    const int n_files = (int)(sizeof SOURCE_FILES / sizeof *SOURCE_FILES);
    for (int f = 0; f < n_files + KERNELS_SOURCES_N; f++) {
        const char *path = f < n_files ? SOURCE_FILES[f] : KERNELS_SOURCES[f - n_files];
        size_t n = 0;
        char *src = read_file(path, &n);
        CHECK(src != NULL, "%s: cannot read it (the tests run in the repository)", path);
        if (!src) continue;
        int k = long_lines(src, n, SOURCE_LINE_MAX, &first, &chars);
        CHECK(k == 0, "%s:%d: %d characters, over %d (and %d more such lines; .clang-format "
              "wraps code)", path, first, chars, SOURCE_LINE_MAX, k - 1);
        free(src);
    }
    // every chapter in cuda/ is in KERNELS_SOURCES, and kernels.cu includes each
    size_t n = 0;
    char *root = read_file("kernels.cu", &n);
    DIR *d = opendir("cuda");
    struct dirent *e;
    int chapters = 0;
    while (d && (e = readdir(d))) {
        const size_t len = strlen(e->d_name);
        if (len < 5 || strcmp(e->d_name + len - 4, ".cuh")) continue;
        char path[300], include[320];
        snprintf(path, sizeof path, "cuda/%s", e->d_name);
        snprintf(include, sizeof include, "#include \"%s\"", path);
        int listed = 0;
        for (int f = 1; f < KERNELS_SOURCES_N; f++) listed |= !strcmp(KERNELS_SOURCES[f], path);
        CHECK(listed, "%s is not in test_segnet.c's KERNELS_SOURCES (the source checks skip it)",
              path);
        CHECK(root && contains(root, include), "kernels.cu does not include %s", path);
        chapters++;
    }
    if (d) closedir(d);
    CHECK(chapters == KERNELS_SOURCES_N - 1, "cuda/ holds %d chapters, KERNELS_SOURCES %d",
          chapters, KERNELS_SOURCES_N - 1);
    free(root);
}

// The last block of a group adds the partial sums that other blocks wrote, on other SMs: it
// must read them past its own L1 (from_other_blocks, __ldcg), which the emulator's coherent
// memory cannot show. Returns the line of the first last_block( call whose function does not
// read through from_other_blocks after it, else 0.
static int last_block_without_l1_bypass(const char *src) {
    for (const char *p = strstr(src, "last_block("); p; p = strstr(p + 1, "last_block(")) {
        if (p > src && (isalnum((unsigned char)p[-1]) || p[-1] == '_')) continue;
        const char *line_start = p;
        while (line_start > src && line_start[-1] != '\n') line_start--;
        if (strstr(line_start, "static __device__ bool last_block(") == line_start) continue;
        const char *end = strstr(p, "\n}\n");
        size_t n = end ? (size_t)(end - p) : strlen(p);
        int ok = 0;
        for (const char *q = p; q < p + n && !ok; q++) ok = !strncmp(q, "from_other_blocks(", 18);
        if (!ok) {
            int line = 1;
            for (const char *q = src; q < p; q++) line += *q == '\n';
            return line;
        }
    }
    return 0;
}

// make gpucheck's script (gpucheck.sh) on stand-ins for the GPU programs and
// PyTorch (shell scripts that print what the real ones print, with a value
// missing): every stage's line lands in gpucheck.txt; a ratio is taken of
// numbers only ("-" for the rest, whatever awk the machine has); a stage that
// overruns the budget is cut short and the ones after it still report.
static void gpucheck_fake(const char *dir, const char *name, const char *body) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    char text[2048];
    snprintf(text, sizeof text, "#!/bin/sh\n%s", body);
    CHECK(write_file_bytes(path, text, strlen(text)) == 0 && chmod(path, 0755) == 0,
          "cannot write %s", path);
}
TEST(gpucheck_script) {
    const char *dir = "/tmp/segnet_test_gpucheck";
    char cmd[2048], msg[4096];
    snprintf(cmd, sizeof cmd, "rm -rf %s && mkdir -p %s/out", dir, dir);
    CHECK(run_shell(cmd, msg, sizeof msg) == 0, "%s: %s", cmd, msg);
    // the tests sleep for $SLOW_TESTS seconds first; segnet bench: a value missing under
    // SEGNET_CONV=gemm, a kernel table for --kernels; python3: torch sees the GPU
    gpucheck_fake(dir, "test_segnet_gpu",
                  "sleep ${SLOW_TESTS:-0}; echo 'ok   cuda_x (0.1s)'; "
                  "echo '1 passed, 0 failed, 0 skipped'\n");
    gpucheck_fake(dir, "segnet",
                  "case \"$*\" in *--kernels*)\n"
                  "  printf 'kernel ms\\nk 1.0\\nsum 1.0\\n'; exit 0;; esac\n"
                  "[ \"$SEGNET_CONV\" = gemm ] && { echo 'images_per_s: nan'; exit 0; }\n"
                  "echo 'images_per_s: 10.0'; echo 'peak_device_bytes: 2147483648'\n");
    gpucheck_fake(dir, "python3",
                  "[ \"$1\" = -c ] && exit 0\n"
                  "echo 'images_per_s: 5.0'; echo 'peak_device_bytes: 1073741824'\n");
    for (int slow = 0; slow < 2; slow++) {
        snprintf(cmd, sizeof cmd,
                 "SLOW_TESTS=%d GPUCHECK_DIR=%s GPUCHECK_OUT=%s/out GPU_SECONDS=%d "
                 "GPU_TEST_SECONDS=%d GPU_PYTHON=%s/python3 CUDA_HOME=/nonexistent "
                 "GPU_MODELS='m:--model unet' PATH=/usr/bin:/bin cuda/gpucheck.sh",
                 slow ? 30 : 0, dir, dir, slow ? 6 : 60, slow ? 2 : 60, dir);
        const double t0 = now_s();
        const int rc = run_shell(cmd, msg, sizeof msg);
        const double took = now_s() - t0;
        char path[512];
        snprintf(path, sizeof path, "%s/out/gpucheck.txt", dir);
        size_t n;
        char *text = read_file(path, &n);
        CHECK(text != NULL, "gpucheck.sh wrote no %s (exit %d: %s)", path, rc, msg);
        if (!text) return;
        if (!slow) {
            CHECK(rc == 0, "gpucheck.sh exited %d with passing tests: %s", rc, msg);
            const char *want[] = {
                    "cuda_ tests: 1 passed, 0 failed, 0 skipped (exit 0;",
                    "compute-sanitizer: not installed",
                    "m             bf16  graphs      10.00       5.00    2.00        2.00"
                    "        1.00    2.00",
                    "m             fp16  fp16        10.00          -       -        2.00"
                    "           -       -",
                    "m             bf16  gemm            -       5.00       -           -"
                    "        1.00       -",
                    "k 1.0"};
            for (size_t k = 0; k < sizeof want / sizeof want[0]; k++)
                CHECK(strstr(text, want[k]) != NULL, "gpucheck.txt lacks \"%s\":\n%s", want[k],
                      text);
        } else {
            CHECK(strstr(text, "cut short after 2 s") && strstr(text, "m             bf16  graphs"),
                  "a stage over the budget: not cut short, or the stages after it missing:\n%s",
                  text);
            CHECK(took < 20, "gpucheck.sh took %.0f s with a 6 s budget", took);
        }
        free(text);
    }
}

// each of the CUDA backend's files (KERNELS_SOURCES) passes the checker: line_of gives 0, or
// the line of the first offence, which fails as "file:line: problem"
static void kernels_sources_hold(int (*line_of)(const char *src), const char *problem) {
    for (int f = 0; f < KERNELS_SOURCES_N; f++) {
        size_t n = 0;
        char *src = read_file(KERNELS_SOURCES[f], &n);
        CHECK(src != NULL, "%s: cannot read it (the tests run in the repository)",
              KERNELS_SOURCES[f]);
        if (!src) continue;
        const int line = line_of(src);
        CHECK(line == 0, "%s:%d: %s", KERNELS_SOURCES[f], line, problem);
        free(src);
    }
}

TEST(last_block_reads_past_l1) {
    const char *good = "void f() {\n    if (!last_block(c, n)) return;\n"
                       "    sum += from_other_blocks(&partial[q]);\n}\n";
    const char *bad = "void f() {\n    if (!last_block(c, n)) return;\n"
                      "    sum += partial[q];\n}\n";
    CHECK(last_block_without_l1_bypass(good) == 0 && last_block_without_l1_bypass(bad) == 2,
          "the checker on planted code: %d, %d", last_block_without_l1_bypass(good),
          last_block_without_l1_bypass(bad));
    kernels_sources_hold(last_block_without_l1_bypass,
                         "the last block reads the other blocks' partials through L1 (read "
                         "them through from_other_blocks)");
}

// kernels.cu and its chapters declare shared memory only through CU_SHARED and
// CU_DYN_SHARED, which the emulator poisons at each block's start and checks: the first line
// with a bare __shared__ declaration outside a comment and those macros'
// definitions, or 0
static int bare_shared_line(const char *src) {
    int line = 1;
    for (const char *p = src; *p; line++) {
        const char *end = strchr(p, '\n');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        const char *comment = NULL, *shared = NULL;
        for (const char *q = p; q + 1 < p + n && !comment; q++)
            if (q[0] == '/' && q[1] == '/') comment = q;
        for (const char *q = p; q + 10 <= p + n && !shared; q++)
            if (!strncmp(q, "__shared__", 10)) shared = q;
        const char *ext = strstr(p, "extern __shared__");  // CU_DYN_SHARED's continued line
        const int in_macro = !strncmp(p, "#define CU_SHARED", 17) ||
                             (ext && ext < p + n && n > 0 && p[n - 1] == '\\');
        if (shared && (!comment || shared < comment) && !in_macro) return line;
        p = end ? end + 1 : p + n;
    }
    return 0;
}
TEST(shared_memory_through_macros) {
    const char *good = "#define CU_SHARED(T, name, dims) __shared__ T name dims\n"
                       "    extern __shared__ unsigned char raw[]; \\\n"
                       "    CU_SHARED(double, sh, [256]);  // not a bare __shared__\n";
    const char *bad = "__global__ void k() {\n    __shared__ float sh[32];\n}\n";
    CHECK(bare_shared_line(good) == 0 && bare_shared_line(bad) == 2,
          "the checker on planted code: %d, %d", bare_shared_line(good), bare_shared_line(bad));
    kernels_sources_hold(bare_shared_line,
                         "a bare __shared__ declaration (use CU_SHARED, which the emulator "
                         "poisons and checks)");
}
