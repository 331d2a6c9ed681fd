// tests/application.c -- the program as a user runs it: data sets, training runs,
// diagnostics, resume, predict, export, the README against the code, outputs that never
// replace the user's, safetensors.
// Part of test_segnet.c, which includes it: one program, its tests run in the order
// they are written (test_segnet.c, then tests/harness.c, step.c, backends.c,
// application.c, sources.c).

// ----------------------------------------------------------------------------
// data sets: exact pixels through listing, caching and batching; resizing by
// hand; augmentation against the tf.image formulas; the loader bit for bit
// whatever its workers; every bad input refused naming the file; atomic PNGs

static void ds_png(const char *dir, const char *name, int w, int h, int comp, const uint8_t *px) {
    char path[600], err[SN_ERR_MAX];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    CHECK(png_write_atomic(path, w, h, comp, px, err) == 0, "%s", err);
}
static void ds_text(const char *dir, const char *name, const char *text) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    CHECK(f != NULL, "creating %s", path);
    if (f) { fputs(text, f); fclose(f); }
}
static uint8_t *ds_random(Rng *r, size_t n, int below) {
    uint8_t *p = malloc(n);
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(rng_next(r) % (uint64_t)below);
    return p;
}
static const char *const SEG_SUBS[] = {"images", "masks"};

TEST(dataset_seg_round_trip) {
    char dir[300], err[SN_ERR_MAX] = "";
    ds_fixture(dir, sizeof dir, "ds_seg", SEG_SUBS, 2);
    const int W = 5, H = 4, K = 4, P = W * H;
    Rng r; rng_seed(&r, 5);
    uint8_t *img[2] = {ds_random(&r, 3 * P, 256), ds_random(&r, 3 * P, 256)};
    uint8_t *cls[2] = {ds_random(&r, P, K), ds_random(&r, P, K)};
    // b's mask as RGB with R = G = B: grey stored as colour (mask_colour: the rest)
    uint8_t rgb_mask[3 * 20];
    for (int p = 0; p < P; p++)
        rgb_mask[3 * p] = rgb_mask[3 * p + 1] = rgb_mask[3 * p + 2] = cls[1][p];
    ds_png(dir, "images/a.png", W, H, 3, img[0]);
    ds_png(dir, "masks/a.png", W, H, 1, cls[0]);
    ds_png(dir, "images/b.png", W, H, 3, img[1]);
    ds_png(dir, "masks/b.png", W, H, 3, rgb_mask);
    float x[2 * 3 * 20], x2[2 * 3 * 20];
    int32_t y[2 * 20], y2[2 * 20];
    const int idx[2] = {1, 0};
    for (int cached = 1; cached >= 0; cached--) {
        Dataset d;
        int rc = dataset_open(&d, dir, 1, K, H, W, cached ? (size_t)1 << 20 : 0, 2, err);
        CHECK(rc == 0, "%s", err);
        if (rc) break;
        CHECK(d.n == 2 && contains(d.images[0], "images/a.png") &&
                      contains(d.masks[1], "masks/b.png") && !d.labels,
              "listing: %d samples", d.n);
        CHECK((d.image_cache != NULL) == cached && (d.mask_cache != NULL) == cached, "cache %d",
              cached);
        CHECK(dataset_batch(&d, idx, 2, NULL, 0, cached ? x : x2, cached ? y : y2, err) == 0, "%s",
              err);
        dataset_free(&d);
    }
    int bad = 0;
    for (int j = 0; j < 2; j++)
        for (int p = 0; p < P; p++) {
            for (int c = 0; c < 3; c++) bad += x[(j * P + p) * 3 + c] != img[idx[j]][3 * p + c];
            bad += y[j * P + p] != cls[idx[j]][p];
        }
    CHECK(bad == 0, "%d values differ from the files", bad);
    CHECK(!memcmp(x, x2, sizeof x) && !memcmp(y, y2, sizeof y), "decoding again equals the cache");
    for (int j = 0; j < 2; j++) { free(img[j]); free(cls[j]); }
    ds_remove(dir);
}

TEST(dataset_resize) {
    char dir[300], err[SN_ERR_MAX] = "";
    ds_fixture(dir, sizeof dir, "ds_resize", SEG_SUBS, 2);
    uint8_t big[4 * 4 * 3], big_mask[16], small[2 * 2 * 3], small_mask[4] = {0, 1, 2, 3};
    Rng r; rng_seed(&r, 8);
    // 2x2 block means are integers
    for (int i = 0; i < 48; i++) big[i] = (uint8_t)(4 * (rng_next(&r) % 64));
    for (int i = 0; i < 12; i++) small[i] = (uint8_t)(rng_next(&r) % 256);
    for (int i = 0; i < 16; i++) big_mask[i] = (uint8_t)i;                    // class = y·4 + x
    ds_png(dir, "images/big.png", 4, 4, 3, big);
    ds_png(dir, "masks/big.png", 4, 4, 1, big_mask);
    ds_png(dir, "images/small.png", 2, 2, 3, small);
    ds_png(dir, "masks/small.png", 2, 2, 1, small_mask);
    // nearest, src = ⌊(dst + ½)·in/out⌋: 4 -> 2 reads 1, 3; 2 -> 4 reads 0, 0, 1, 1
    const int32_t down[4] = {5, 7, 13, 15};
    const int32_t up[16] = {0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3};
    const int idx[2] = {0, 1};  // big, small
    for (int size = 2; size <= 4; size += 2) {
        Dataset d;
        float x[2 * 16 * 3];
        int32_t y[2 * 16];
        int rc = dataset_open(&d, dir, 1, 16, size, size, 1 << 20, 1, err);
        CHECK(rc == 0, "%s", err);
        if (rc) break;
        CHECK(dataset_batch(&d, idx, 2, NULL, 0, x, y, err) == 0, "%s", err);
        const int P = size * size;
        const int32_t *want_big = size == 2 ? down : NULL, *want_small = size == 2 ? NULL : up;
        for (int p = 0; p < P; p++) {
            int32_t wb = want_big ? want_big[p] : big_mask[p],
                    ws = want_small ? want_small[p] : small_mask[p];
            CHECK(y[p] == wb && y[P + p] == ws, "size %d pixel %d: masks %d %d, expected %d %d",
                  size, p, y[p], y[P + p], wb, ws);
        }
        // images: the model's bilinear resize op, rounded; 4 -> 2 is the mean of each 2x2 block
        const uint8_t *src[2] = {big, small};
        const int src_size[2] = {4, 2};
        for (int j = 0; j < 2; j++) {
            float in[48], out[48];
            for (int i = 0; i < src_size[j] * src_size[j] * 3; i++) in[i] = src[j][i];
            ops_cpu.resize_bilinear_forward(&ops_cpu, tensor_f32(out, shape4(1, size, size, 3)),
                                            tensor_f32(in, shape4(1, src_size[j], src_size[j], 3)));
            int bad = 0;
            for (int i = 0; i < P * 3; i++) bad += x[j * P * 3 + i] != (float)lrintf(out[i]);
            CHECK(bad == 0, "size %d sample %d: %d values differ from resize_bilinear_forward",
                  size, j, bad);
        }
        if (size == 2)
            for (int oy = 0; oy < 2; oy++)
                for (int ox = 0; ox < 2; ox++)
                    for (int c = 0; c < 3; c++) {
                        int s = 0;
                        for (int k = 0; k < 4; k++)
                            s += big[((2 * oy + k / 2) * 4 + 2 * ox + k % 2) * 3 + c];
                        CHECK(x[(oy * 2 + ox) * 3 + c] == s / 4, "block (%d,%d,%d): %g, mean %d",
                              ox, oy, c, x[(oy * 2 + ox) * 3 + c], s / 4);
                    }
        dataset_free(&d);
    }
    ds_remove(dir);
}

// a 1-sample data set of an asymmetric (4,6) image, mask class = x
static int ds_one_sample(Dataset *d, char *dir, size_t cap, const char *tag) {
    char err[SN_ERR_MAX] = "";
    uint8_t px[4 * 6 * 3], m[4 * 6];
    for (int y = 0; y < 4; y++)
        for (int x = 0; x < 6; x++) {
            m[y * 6 + x] = (uint8_t)x;
            for (int c = 0; c < 3; c++)
                px[(y * 6 + x) * 3 + c] = (uint8_t)(40 * x + 20 * c + 3 * y);
        }
    ds_fixture(dir, cap, tag, SEG_SUBS, 2);
    ds_png(dir, "images/s.png", 6, 4, 3, px);
    ds_png(dir, "masks/s.png", 6, 4, 1, m);
    int rc = dataset_open(d, dir, 1, 6, 4, 6, 1 << 20, 1, err);
    CHECK(rc == 0, "%s", err);
    return rc;
}

TEST(dataset_augment_flip) {
    char dir[300], err[SN_ERR_MAX] = "";
    Dataset d;
    if (ds_one_sample(&d, dir, sizeof dir, "ds_flip")) { ds_remove(dir); return; }
    const int W = 6, H = 4, idx = 0;
    float x0[72], x[72];
    int32_t y0[24], y[24];
    Augment aug = {.flip = 1};
    CHECK(dataset_batch(&d, &idx, 1, NULL, 0, x0, y0, err) == 0, "%s", err);
    int flipped = 0, kept = 0;
    for (uint64_t seed = 0; seed < 16; seed++) {
        CHECK(dataset_batch(&d, &idx, 1, &aug, seed, x, y, err) == 0, "%s", err);
        int same = 1, mirror = 1, mask_same = 1, mask_mirror = 1;
        for (int r = 0; r < H; r++)
            for (int c = 0; c < W; c++) {
                mask_same &= y[r * W + c] == y0[r * W + c];
                mask_mirror &= y[r * W + c] == y0[r * W + W - 1 - c];
                for (int k = 0; k < 3; k++) {
                    same &= x[(r * W + c) * 3 + k] == x0[(r * W + c) * 3 + k];
                    mirror &= x[(r * W + c) * 3 + k] == x0[(r * W + W - 1 - c) * 3 + k];
                }
            }
        CHECK((same && mask_same) != (mirror && mask_mirror),
              "seed %d: image and mask are either both flipped or both not", (int)seed);
        flipped += mirror && mask_mirror;
        kept += same && mask_same;
        float x2[72];
        int32_t y2[24];
        dataset_batch(&d, &idx, 1, &aug, seed, x2, y2, err);
        CHECK(!memcmp(x, x2, sizeof x) && !memcmp(y, y2, sizeof y), "seed %d: the same draw twice",
              (int)seed);
    }
    CHECK(flipped > 0 && kept > 0, "16 seeds: %d flipped, %d not", flipped, kept);
    dataset_free(&d);
    ds_remove(dir);
}

// per-channel means over (P,3) values
static void channel_means(const float *x, int P, double m[3]) {
    for (int c = 0; c < 3; c++) {
        m[c] = 0.0;
        for (int p = 0; p < P; p++) m[c] += x[3 * p + c];
        m[c] /= P;
    }
}

TEST(dataset_augment_brightness_contrast) {
    char dir[300], err[SN_ERR_MAX] = "";
    Dataset d;
    if (ds_one_sample(&d, dir, sizeof dir, "ds_color")) { ds_remove(dir); return; }
    const int P = 24, idx = 0;
    float x0[72], x[72];
    int32_t y0[24], y[24];
    double m0[3], m[3];
    CHECK(dataset_batch(&d, &idx, 1, NULL, 0, x0, y0, err) == 0, "%s", err);
    channel_means(x0, P, m0);
    // brightness D = 0.2: every value moves by the same 255·δ, |δ| ≤ D; contrast
    // [0.5, 1.5]: each channel's mean stays, deviations scale by one f in [lo, hi];
    // both: the means move by 255·δ and the deviations scale by f
    const Augment augs[3] = {
            {.flip = 0, .brightness = 0.2f, .contrast_lo = 0.0f, .contrast_hi = 0.0f},
            {.flip = 0, .brightness = 0.0f, .contrast_lo = 0.5f, .contrast_hi = 1.5f},
            {.flip = 0, .brightness = 0.2f, .contrast_lo = 0.5f, .contrast_hi = 1.5f}};
    for (int a = 0; a < 3; a++) {
        double lo_seen = INFINITY, hi_seen = -INFINITY;
        for (uint64_t seed = 0; seed < 8; seed++) {
            CHECK(dataset_batch(&d, &idx, 1, &augs[a], seed, x, y, err) == 0, "%s", err);
            CHECK(!memcmp(y, y0, sizeof y), "the mask is untouched");
            channel_means(x, P, m);
            double shift = m[0] - m0[0], f = (x[0] - m[0]) / (x0[0] - m0[0]);
            int bad = 0;
            for (int p = 0; p < P; p++)
                for (int c = 0; c < 3; c++)
                    bad += fabs((x[3 * p + c] - m[c]) - f * (x0[3 * p + c] - m0[c])) > 2e-3 ||
                           fabs(m[c] - m0[c] - shift) > 2e-3;
            CHECK(bad == 0,
                  "aug %d seed %d: %d values off (x - mean) = f·(x0 - mean0), mean = mean0 + 255·δ",
                  a, (int)seed, bad);
            double delta = shift / 255.0;
            if (augs[a].brightness > 0)
                CHECK(fabs(delta) <= 0.2 + 1e-6, "aug %d: δ = %g", a, delta);
            else CHECK(fabs(delta) < 1e-5, "aug %d: the means stay (δ = %g)", a, delta);
            if (augs[a].contrast_hi > 0)
                CHECK(f >= 0.5 - 1e-5 && f <= 1.5 + 1e-5, "aug %d: f = %g", a, f);
            else CHECK(fabs(f - 1.0) < 1e-5, "aug %d: deviations stay (f = %g)", a, f);
            double v = augs[a].contrast_hi > 0 ? f : delta;
            lo_seen = fmin(lo_seen, v);
            hi_seen = fmax(hi_seen, v);
        }
        CHECK(hi_seen - lo_seen > 0.05, "aug %d: the factor varies with the seed (%g..%g)", a,
              lo_seen, hi_seen);
    }
    dataset_free(&d);
    ds_remove(dir);
}

// a segmentation data set of 5 random 6x4 samples (stems s0..s4)
static int ds_five(Dataset *d, char *dir, size_t cap, const char *tag, size_t cache_bytes) {
    char err[SN_ERR_MAX] = "", name[64];
    ds_fixture(dir, cap, tag, SEG_SUBS, 2);
    Rng r; rng_seed(&r, 77);
    for (int i = 0; i < 5; i++) {
        uint8_t *px = ds_random(&r, 72, 256), *m = ds_random(&r, 24, 3);
        snprintf(name, sizeof name, "images/s%d.png", i); ds_png(dir, name, 6, 4, 3, px);
        snprintf(name, sizeof name, "masks/s%d.png", i); ds_png(dir, name, 6, 4, 1, m);
        free(px); free(m);
    }
    int rc = dataset_open(d, dir, 1, 3, 4, 6, cache_bytes, 2, err);
    CHECK(rc == 0, "%s", err);
    return rc;
}

TEST(loader_determinism) {
    char dir[300], err[SN_ERR_MAX] = "";
    Dataset d;
    if (ds_five(&d, dir, sizeof dir, "ds_loader", 1 << 20)) { ds_remove(dir); return; }
    const int order[10] = {3, 1, 4, 0, 2, 2, 0, 1, 3, 4}, P = 24;
    const Augment aug = {.flip = 1, .brightness = 0.1f, .contrast_lo = 0.8f, .contrast_hi = 1.2f};
    float want_x[10 * 72];
    int32_t want_y[10 * 24];
    CHECK(dataset_batch(&d, order, 10, &aug, 42, want_x, want_y, err) == 0, "%s", err);
    const int setups[4][2] = {{1, 1}, {1, 3}, {3, 2}, {3, 5}};  // workers, depth
    // the batches' label weight sums: class 0 weighs 0, 1 0.1, labels of class 2
    // (K = 2) and ignored ones are left out; without weights, labels 0..2 count 1
    const float weights[2] = {0.0f, 0.1f};
    for (int s = 0; s < 4; s++) {
        const int K = s % 2 ? 3 : 2;
        const float *w = s % 2 ? NULL : weights;
        Loader *l = loader_start(&d, order, 10, 4, &aug, 42, setups[s][0], setups[s][1], K, w,
                                  NULL, DT_F32);
        int b = 0, first = 0;
        for (const LoaderBatch *lb; (lb = loader_next(l)); b++) {
            CHECK(lb->index == b && lb->n == (b < 2 ? 4 : 2),
                  "%d workers: batch %d has index %d, %d images", setups[s][0], b, lb->index,
                  lb->n);
            double sum = 0.0;
            for (int i = first * P; i < (first + lb->n) * P; i++)
                if (want_y[i] >= 0 && want_y[i] < K) sum += w ? (double)w[want_y[i]] : 1.0;
            CHECK(lb->weight_sum == sum, "batch %d: weight sum %.17g, not %.17g", b,
                  lb->weight_sum, sum);
            CHECK(!memcmp(lb->images, want_x + (size_t)first * 3 * P,
                          sizeof(float) * 3 * P * lb->n) &&
                          !memcmp(lb->labels, want_y + (size_t)first * P,
                                  sizeof(int32_t) * P * lb->n),
                  "%d workers, depth %d: batch %d differs from dataset_batch", setups[s][0],
                  setups[s][1], b);
            first += lb->n;
        }
        CHECK(b == 3 && !loader_error(l)[0] && !loader_next(l), "3 batches, no error, then none");
        loader_stop(l);
    }
    // stopping at any time: before the first batch, mid-epoch with workers waiting on a full ring
    loader_stop(loader_start(&d, order, 10, 4, &aug, 1, 3, 2, 0, NULL, NULL, DT_F32));
    Loader *l = loader_start(&d, order, 10, 1, &aug, 1, 2, 2, 0, NULL, NULL, DT_F32);
    CHECK(loader_next(l) != NULL, "a first batch");
    loader_stop(l);
    dataset_free(&d);
    ds_remove(dir);
}

// The loader's wire (MicroBatch.wire): bytes when the augmentation keeps the
// values whole (none, horizontal flips), else the images in the storage type,
// each value rounded as a store of that type rounds it; with fp32 storage the
// images themselves. Compared with dataset_batch's images and labels.
TEST(loader_wire) {
    char dir[300], err[SN_ERR_MAX] = "";
    Dataset d;
    if (ds_five(&d, dir, sizeof dir, "ds_wire", 1 << 20)) { ds_remove(dir); return; }
    const int order[5] = {3, 1, 4, 0, 2}, P = 24;
    const Augment augs[3] = {{0}, {.flip = 1}, {.flip = 1, .brightness = 0.1f, .contrast_lo = 0.8f,
                                                 .contrast_hi = 1.2f}};
    float want_x[5 * 72];
    int32_t want_y[5 * 24];
    for (int a = 0; a < 3; a++) {
        CHECK(dataset_batch(&d, order, 5, &augs[a], 9, want_x, want_y, err) == 0, "%s", err);
        for (int dt = 0; dt < 3; dt++) {
            Loader *l = loader_start(&d, order, 5, 5, &augs[a], 9, 2, 2, 0, NULL, &ops_cpu,
                                     (DType)dt);
            const LoaderBatch *b = loader_next(l);
            CHECK(b && b->n == 5, "a batch of 5");
            if (!b) { loader_stop(l); continue; }
            size_t wrong = 0;
            for (int i = 0; i < 5 * 3 * P; i++) {
                const float v = b->wire_bytes ? (float)((const uint8_t *)b->wire)[i]
                                              : ld(tensor(b->wire, shape4(5 * 3 * P, 1, 1, 1),
                                                          (DType)dt),
                                                   (size_t)i);
                wrong += v != (b->wire_bytes ? want_x[i] : dtype_round((DType)dt, want_x[i]));
            }
            CHECK(b->wire_bytes == (a < 2) && wrong == 0 &&
                          !memcmp(b->labels, want_y, sizeof(int32_t) * 5 * P) &&
                          (dt != DT_F32 || a < 2 || b->wire == b->images),
                  "augmentation %d, storage %s: wire_bytes %d, %zu of %d values differ", a,
                  DT_NAME[dt], b->wire_bytes, wrong, 5 * 3 * P);
            loader_stop(l);
        }
    }
    dataset_free(&d);
    ds_remove(dir);
}

TEST(loader_file_changed) {
    char dir[300], err[SN_ERR_MAX] = "", path[400];
    Dataset d;
    // not cached: batches decode again
    if (ds_five(&d, dir, sizeof dir, "ds_changed", 0)) { ds_remove(dir); return; }
    CHECK(!d.image_cache, "not cached");
    snprintf(path, sizeof path, "%s/images/s3.png", dir);
    FILE *f = fopen(path, "wb");
    if (f) { fputs("\x89PNG\r\n\x1a\nbroken", f); fclose(f); }
    const int order[5] = {0, 1, 2, 3, 4};
    Loader *l = loader_start(&d, order, 5, 1, NULL, 0, 2, 3, 0, NULL, NULL, DT_F32);
    int got = 0;
    while (loader_next(l)) got++;
    CHECK(got == 3 && contains(loader_error(l), "s3.png") &&
                  contains(loader_error(l), "cannot decode"),
          "3 batches, then '%s'", loader_error(l));
    CHECK(!loader_next(l), "nothing after an error");
    loader_stop(l);
    float x[72];
    int32_t y[24];
    CHECK(dataset_batch(&d, order + 3, 1, NULL, 0, x, y, err) == -1 && contains(err, "s3.png"),
          "dataset_batch: '%s'", err);
    dataset_free(&d);
    ds_remove(dir);
}

TEST(dataset_classification) {
    char dir[300], path[400], err[SN_ERR_MAX] = "";
    const char *const subs[] = {"imgs", "cls", "cls/dog", "cls/cat", "cls/emu", "cls/.hidden"};
    ds_fixture(dir, sizeof dir, "ds_cls", subs, 6);
    Rng r; rng_seed(&r, 3);
    uint8_t *px = ds_random(&r, 8 * 6 * 3, 256);
    const char *files[] = {"imgs/x.png",    "imgs/y,z.png",  "cls/dog/1.png",
                           "cls/dog/0.png", "cls/cat/a.png", "cls/emu/b.png"};
    // two sizes: resized
    for (int k = 0; k < 6; k++) ds_png(dir, files[k], k % 2 ? 8 : 6, k % 2 ? 6 : 4, 3, px);
    ds_text(dir, "list.csv", "path,label\nimgs/x.png,2\n\n\"imgs/y,z.png\",0\n");
    Dataset d;
    snprintf(path, sizeof path, "%s/list.csv", dir);
    int rc = dataset_open(&d, path, 0, 3, 4, 6, 1 << 20, 2, err);
    CHECK(rc == 0, "%s", err);
    if (rc) { free(px); ds_remove(dir); return; }
    CHECK(d.n == 2 && d.labels[0] == 2 && d.labels[1] == 0 && !d.masks &&
                  contains(d.images[1], "/imgs/y,z.png"),
          "CSV: %d samples", d.n);
    const int idx[2] = {1, 0};
    float x[2 * 72];
    int32_t y[2];
    CHECK(dataset_batch(&d, idx, 2, NULL, 0, x, y, err) == 0 && y[0] == 0 && y[1] == 2,
          "labels %d %d", y[0], y[1]);
    int bad = 0;
    for (int i = 0; i < 72; i++) bad += x[72 + i] != px[i];
    CHECK(bad == 0, "the 6x4 image is unchanged: %d values differ", bad);
    dataset_free(&d);
    snprintf(path, sizeof path, "%s/cls", dir);
    CHECK(dataset_open(&d, path, 0, 4, 4, 6, 0, 3, err) == 0, "%s", err);
    // classes by sorted folder name: cat 0, dog 1, emu 2; files sorted within
    const char *want[4] = {"cat/a.png", "dog/0.png", "dog/1.png", "emu/b.png"};
    const int want_label[4] = {0, 1, 1, 2};
    CHECK(d.n == 4, "folders: %d samples", d.n);
    for (int i = 0; d.n == 4 && i < 4; i++)
        CHECK(contains(d.images[i], want[i]) && d.labels[i] == want_label[i],
              "sample %d: %s label %d", i, d.images[i], d.labels[i]);
    dataset_free(&d);
    CHECK(dataset_open(&d, path, 0, 2, 4, 6, 0, 1, err) == -1 &&
                  contains(err, "3 class folders, but there are 2 classes"),
          "more folders than classes: '%s'", err);
    free(px);
    ds_remove(dir);
}

TEST(dataset_bad_input) {
    char dir[300], path[400], err[SN_ERR_MAX];
    const char *const subs[] = {"seg",          "seg/images",     "seg/masks", "empty",
                                "empty/images", "empty/masks",    "nomasks",   "nomasks/images",
                                "noimages",     "noimages/masks", "cls",       "cls/a"};
    ds_fixture(dir, sizeof dir, "ds_bad", subs, 12);
    Rng r; rng_seed(&r, 4);
    uint8_t *px = ds_random(&r, 5 * 4 * 3, 256), m[20] = {0}, bad_mask[20] = {0};
    bad_mask[1 * 5 + 2] = 7;  // pixel (x,y) = (2,1)
    ds_png(dir, "nomasks/images/a.png", 5, 4, 3, px);
    ds_png(dir, "cls/a/ok.png", 5, 4, 3, px);
    ds_text(dir, "junk.png", "\x89PNG\r\n\x1a\nnot really a png");
    // a PNG cut in half
    snprintf(path, sizeof path, "%s/cls/a/ok.png", dir);
    size_t len;
    uint8_t *png = read_file_bytes(path, &len);
    snprintf(path, sizeof path, "%s/half.png", dir);
    CHECK(png && write_file_bytes(path, png, len / 2) == 0, "writing %s", path);
    free(png);
    typedef struct { const char *setup, *open, *want1, *want2, *want3; } Case;
    // setup: a CSV's text, or files in seg/ named by a one-letter stem: "i:a" image a (5x4), "m:a"
    // its mask, "j:a" a junk image, "t:a" a truncated one, "s:a" a 5x3 mask, "v:a" a mask with
    // class 7 at (2,1)
    const Case cases[] = {
            {"i:a j:b i:c m:a m:b m:c", "seg", "images/b.png", "cannot decode the image", ""},
            {"i:a t:b m:a m:b", "seg", "images/b.png", "cannot decode the image", ""},
            {"i:a i:b m:a", "seg", "images/b.png", "no mask", "masks/b.png"},
            {"i:a m:a m:c", "seg", "masks/c.png", "no image", "images/c.png"},
            {"i:a s:a", "seg", "masks/a.png", "mask is 5x3 but its image is 5x4", ""},
            {"i:a v:a", "seg", "masks/a.png", "pixel (2,1) has class 7",
             "there are 4 classes (0..3)"},
            {"", "empty", "empty/images", "no images", ""},
            {"", "nomasks", "nomasks/masks", "no such folder", ""},
            {"", "noimages", "noimages/images", "no such folder", ""},
            {"", "missing", "missing", "No such file", ""},
            {"path,label\ncls/a/ok.png,1\nmissing.png,0\n", "list.csv", "row 3", "missing.png",
             "No such file"},
            {"cls/a/ok.png,1\ncls/a/ok.png,cat\n", "list.csv", "row 2",
             "'cat' is a name, but row 1's is an integer",
             "all integers 0..K-1 or all class names"},
            {"path,label\ncls/a/ok.png,4\n", "list.csv", "row 2", "'4'", "out of range"},
            {"path,label\n", "list.csv", "list.csv", "no images", ""},
            {"cls/a/ok.png,1\njunk.png,0\n", "list.csv", "junk.png", "cannot decode the image", ""},
            {"half.png,1\n", "list.csv", "half.png", "cannot decode the image", ""},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const Case *c = &cases[k];
        char cmd[700], kind, stem;
        int used;
        snprintf(cmd, sizeof cmd, "rm -f '%s'/seg/images/* '%s'/seg/masks/*", dir, dir);
        CHECK(system(cmd) == 0, "clearing seg/");
        if (!strcmp(c->open, "list.csv")) ds_text(dir, "list.csv", c->setup);
        else
            for (const char *s = c->setup; sscanf(s, " %c:%c%n", &kind, &stem, &used) == 2;
                 s += used) {
                char name[64];
                snprintf(name, sizeof name, "seg/%s/%c.png",
                         strchr("msv", kind) ? "masks" : "images", stem);
                if (kind == 'i') ds_png(dir, name, 5, 4, 3, px);
                else if (kind == 'm') ds_png(dir, name, 5, 4, 1, m);
                else if (kind == 's') ds_png(dir, name, 5, 3, 1, m);
                else if (kind == 'v') ds_png(dir, name, 5, 4, 1, bad_mask);
                else {  // a copy of junk.png or half.png
                    snprintf(path, sizeof path, "%s/%s", dir,
                             kind == 'j' ? "junk.png" : "half.png");
                    size_t n;
                    uint8_t *b = read_file_bytes(path, &n);
                    snprintf(path, sizeof path, "%s/%s", dir, name);
                    CHECK(b && write_file_bytes(path, b, n) == 0, "writing %s", path);
                    free(b);
                }
            }
        snprintf(path, sizeof path, "%s/%s", dir, c->open);
        for (int threads = 1; threads <= 3; threads += 2) {
            Dataset d;
            memset(err, 0, sizeof err);
            int rc = dataset_open(&d, path, strcmp(c->open, "list.csv") != 0, 4, 4, 5, 1 << 20,
                                  threads, err);
            CHECK(rc == -1 && contains(err, c->want1) && contains(err, c->want2) &&
                          contains(err, c->want3) && !strchr(err, '\n') && d.n == 0 && !d.images,
                  "case %zu (%d threads): rc %d, '%s'", k, threads, rc, err);
        }
    }
    // several bad files: the first in order, whatever the threads and however
    // long each takes to fail (junk.png fails at once, slow.png only at its end)
    uint8_t *big = ds_random(&r, (size_t)3 * 512 * 512, 256);
    ds_png(dir, "slow.png", 512, 512, 3, big);
    snprintf(path, sizeof path, "%s/slow.png", dir);
    png = read_file_bytes(path, &len);
    CHECK(png && write_file_bytes(path, png, len - 100) == 0, "truncating %s", path);
    free(png);
    free(big);
    ds_text(dir, "list.csv", "junk.png,0\nslow.png,1\nslow.png,0\nslow.png,2\n");
    snprintf(path, sizeof path, "%s/list.csv", dir);
    for (int rep = 0; rep < 4; rep++) {
        Dataset d;
        CHECK(dataset_open(&d, path, 0, 4, 4, 5, 0, 3, err) == -1 && contains(err, "junk.png"),
              "first bad: '%s'", err);
    }
    free(px);
    ds_remove(dir);
}

// PNGs that stb_image_write cannot write (1-, 2-, 4-, 16-bit, palette, tRNS),
// by hand: IHDR, an optional PLTE or tRNS, one IDAT of rows with filter byte 0,
// IEND; chunk CRCs as PNG's
// libstb.so
unsigned char *stbi_zlib_compress(unsigned char *data, int data_len, int *out_len, int quality);

static uint32_t png_crc(const uint8_t *p, size_t n, uint32_t c) {
    c = ~c;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    }
    return ~c;
}
static void png_chunk(FILE *f, const char *type, const uint8_t *data, uint32_t n) {
    uint8_t be[4] = {(uint8_t)(n >> 24), (uint8_t)(n >> 16), (uint8_t)(n >> 8), (uint8_t)n};
    fwrite(be, 1, 4, f);
    fwrite(type, 1, 4, f);
    if (n) fwrite(data, 1, n, f);
    uint32_t crc = png_crc(data, n, png_crc((const uint8_t *)type, 4, 0));
    uint8_t cb[4] = {(uint8_t)(crc >> 24), (uint8_t)(crc >> 16), (uint8_t)(crc >> 8), (uint8_t)crc};
    fwrite(cb, 1, 4, f);
}
// One channel (grey, or palette indices with plte of n_plte RGB entries).
// Samples of 1, 2 or 4 bits are packed into bytes from the most significant
// bit, each row padded to a whole byte; 8 bits; or 16 bits big-endian.
// trns_grey >= 0: a tRNS chunk making that grey value transparent, or with a
// palette, giving each of its entries the alpha trns_grey & 255.
static void png_by_hand_trns(const char *path, int w, int h, int depth, const uint16_t *samples,
                             const uint8_t *plte, int n_plte, int trns_grey) {
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL, "creating %s", path);
    if (!f) return;
    const int row = 1 + (w * depth + 7) / 8;
    uint8_t ihdr[13] = {0, 0, 0,          (uint8_t)w,     0,
                        0, 0, (uint8_t)h, (uint8_t)depth, (uint8_t)(plte ? 3 : 0),
                        0, 0, 0};
    uint8_t *raw = calloc((size_t)row * h, 1);
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++) {
            uint16_t v = samples[y * w + x];
            uint8_t *r = raw + (size_t)y * row + 1;
            if (depth == 16) { r[2 * x] = (uint8_t)(v >> 8); r[2 * x + 1] = (uint8_t)v; }
            else if (depth == 8) r[x] = (uint8_t)v;
            else r[x * depth / 8] |= (uint8_t)(v << (8 - depth - x * depth % 8));
        }
    int zn = 0;
    uint8_t *z = stbi_zlib_compress(raw, row * h, &zn, 8);
    fwrite("\x89PNG\r\n\x1a\n", 1, 8, f);
    png_chunk(f, "IHDR", ihdr, 13);
    if (plte) png_chunk(f, "PLTE", plte, (uint32_t)(3 * n_plte));
    uint8_t alpha[256];
    memset(alpha, trns_grey & 255, sizeof alpha);
    if (trns_grey >= 0 && plte)
        png_chunk(f, "tRNS", alpha, (uint32_t)n_plte);
    else if (trns_grey >= 0)
        png_chunk(f, "tRNS", (const uint8_t[]){(uint8_t)(trns_grey >> 8), (uint8_t)trns_grey}, 2);
    png_chunk(f, "IDAT", z, (uint32_t)zn);
    png_chunk(f, "IEND", NULL, 0);
    fclose(f);
    free(z);
    free(raw);
}
static void png_by_hand(const char *path, int w, int h, int depth, const uint16_t *samples,
                        const uint8_t *plte, int n_plte) {
    png_by_hand_trns(path, w, h, depth, samples, plte, n_plte, -1);
}

// mask_load as a data set of K classes under rules r (NULL: none) reads a mask
static uint8_t *mask_load_k(const char *path, int h, int w, int K, const MaskRules *r,
                            char err[SN_ERR_MAX]) {
    Dataset d = {.segmentation = 1, .classes = K};
    uint8_t *m = mask_rules_apply(&d, r, err) == 0 ? mask_load(&d, path, h, w, 1, err) : NULL;
    free(d.value_class);
    free(d.label_map);
    return m;
}

TEST(dataset_mask_formats) {
    char dir[300], path[400], err[SN_ERR_MAX] = "";
    ds_fixture(dir, sizeof dir, "ds_masks", SEG_SUBS, 2);
    uint8_t px[4 * 3 * 3] = {0};
    uint16_t cls[12] = {0, 1, 2, 3, 3, 2, 1, 0, 1, 1, 2, 2};
    const uint8_t plte[12] = {0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255};
    ds_png(dir, "images/a.png", 4, 3, 3, px);
    snprintf(path, sizeof path, "%s/masks/a.png", dir);
    // 16-bit: the values are the classes (not scaled to 8 bits)
    png_by_hand(path, 4, 3, 16, cls, NULL, 0);
    Dataset d;
    float x[36];
    int32_t y[12];
    const int idx = 0;
    int rc = dataset_open(&d, dir, 1, 4, 3, 4, 1 << 20, 1, err);
    CHECK(rc == 0 && dataset_batch(&d, &idx, 1, NULL, 0, x, y, err) == 0, "16-bit mask: %s", err);
    for (int p = 0; rc == 0 && p < 12; p++)
        CHECK(y[p] == cls[p], "pixel %d: class %d, expected %d", p, y[p], cls[p]);
    if (rc == 0) dataset_free(&d);
    cls[6] = 300;
    png_by_hand(path, 4, 3, 16, cls, NULL, 0);
    CHECK(dataset_open(&d, dir, 1, 4, 3, 4, 1 << 20, 1, err) == -1 &&
                  contains(err, "pixel (2,1) has class 300"),
          "16-bit class out of range: '%s'", err);
    cls[6] = 1;
    // palette indices 0..3 that stb_image turns into colours: read as the indices
    png_by_hand(path, 4, 3, 8, cls, plte, 4);
    int w, h, n;
    uint8_t *rgb = stbi_load(path, &w, &h, &n, 0);
    CHECK(rgb && n == 3 && rgb[3] == 255, "the hand-made palette PNG decodes (to colours)");
    stbi_image_free(rgb);
    rc = dataset_open(&d, dir, 1, 4, 3, 4, 1 << 20, 1, err);
    CHECK(rc == 0 && dataset_batch(&d, &idx, 1, NULL, 0, x, y, err) == 0, "palette mask: %s", err);
    for (int p = 0; rc == 0 && p < 12; p++)
        CHECK(y[p] == cls[p], "palette pixel %d: class %d, expected %d", p, y[p], cls[p]);
    if (rc == 0) dataset_free(&d);
    ds_remove(dir);
}

// Palette masks (Pascal VOC's) give their indices: at 1, 2, 4 and 8 bits per
// index (width 5 pads every row), with entries of one colour (stb_image's
// colours could not tell them apart), with a tRNS chunk, and an index ≥ K is
// refused as a class. Index 255 (VOC's void) names --ignore-index.
TEST(mask_palette) {
    char dir[300], path[400], err[SN_ERR_MAX] = "";
    ds_fixture(dir, sizeof dir, "mask_palette", SEG_SUBS, 2);
    snprintf(path, sizeof path, "%s/masks/a.png", dir);
    enum { W = 5, H = 3, P = W * H };
    uint8_t plte[3 * 256] = {0};  // every entry black: only the indices differ
    for (int depth = 1; depth <= 8; depth *= 2) {
        const int levels = 1 << depth;
        uint16_t v[P];
        for (int p = 0; p < P; p++) v[p] = (uint16_t)((p * 7 + depth) % levels);
        if (depth == 8) v[P - 2] = 255;
        for (int trns = -1; trns <= 128; trns += 129) {
            png_by_hand_trns(path, W, H, depth, v, plte, levels, trns);
            uint8_t *m = mask_load_k(path, H, W, levels < MASK_IGNORED ? levels : MASK_IGNORED,
                                     NULL, err);
            if (depth == 8) {  // index 255 occurs: K ≤ 255 refuses it, naming the fix
                CHECK(!m && contains(err, "has class 255, but there are 255 classes") &&
                              contains(err, "(palette index)") &&
                              contains(err, "--ignore-index 255"),
                      "8-bit palette, index 255: '%s'", err);
                const MaskRules void255 = {1, {255}, NULL};
                m = mask_load_k(path, H, W, MASK_IGNORED, &void255, err);
            }
            CHECK(m != NULL, "depth %d, tRNS %d: %s", depth, trns, err);
            for (int p = 0; m && p < P; p++)
                CHECK(m[p] == (v[p] == 255 ? MASK_IGNORED : v[p]),
                      "depth %d, tRNS %d, pixel %d: %d, index %d", depth, trns, p, m[p], v[p]);
            free(m);
        }
        // the largest index with one class fewer: refused, named as stored
        png_by_hand(path, W, H, depth, v, plte, levels);
        int first = 0;
        while (v[first] != levels - 1) first++;
        char want[160];
        snprintf(want, sizeof want,
                 "masks/a.png: pixel (%d,%d) has class %d, but there are %d classes (0..%d) "
                 "(palette index)",
                 first % W, first / W, levels - 1, levels - 1, levels - 2);
        if (depth < 8) {
            uint8_t *m = mask_load_k(path, H, W, levels - 1, NULL, err);
            CHECK(!m && contains(err, want), "depth %d: '%s', want '%s'", depth, err, want);
            free(m);
        }
    }
    ds_remove(dir);
}

// --ignore-index and --label-map, through the data set: VOC's palette masks
// with 255 void, and a Cityscapes-like 16-bit mask of labelIds mapped to
// classes; counts and labels by hand, every refusal naming file, row or pixel.
TEST(mask_ignore_label_map) {
    char dir[300], path[400], map[400], err[SN_ERR_MAX] = "";
    ds_fixture(dir, sizeof dir, "mask_ignore", SEG_SUBS, 2);
    enum { W = 4, H = 3, P = W * H };
    uint8_t px[P * 3] = {0};
    ds_png(dir, "images/a.png", W, H, 3, px);
    snprintf(path, sizeof path, "%s/masks/a.png", dir);
    snprintf(map, sizeof map, "%s/map.csv", dir);
    const uint8_t plte[3 * 256] = {0};
    // VOC: a border of 255 around classes 1 and 2 on background 0
    const uint16_t voc[P] = {0, 255, 255, 0, 255, 1, 2, 255, 0, 255, 255, 0};
    png_by_hand(path, W, H, 8, voc, plte, 256);
    Dataset d;
    float x[P * 3];
    int32_t y[P];
    const int idx = 0;
    CHECK(dataset_open(&d, dir, 1, 3, H, W, 1 << 20, 1, err) == -1 &&
                  contains(err, "masks/a.png: pixel (1,0) has class 255") &&
                  contains(err, "--ignore-index 255"),
          "255 without --ignore-index: '%s'", err);
    MaskRules rules = {2, {255, 9}, NULL};
    int rc = dataset_open_named(&d, dir, 1, 3, H, W, 1 << 20, 1, NULL, &rules, err);
    CHECK(rc == 0 && dataset_batch(&d, &idx, 1, NULL, 0, x, y, err) == 0, "VOC: %s", err);
    for (int p = 0; rc == 0 && p < P; p++)
        CHECK(y[p] == (voc[p] == 255 ? SN_LABEL_IGNORED : voc[p]), "VOC pixel %d: label %d", p,
              y[p]);
    if (rc == 0) {
        CHECK(d.class_counts[0] == 4 && d.class_counts[1] == 1 && d.class_counts[2] == 1 &&
                      d.ignored == 6,
              "counts %" PRId64 " %" PRId64 " %" PRId64 ", ignored %" PRId64, d.class_counts[0],
              d.class_counts[1], d.class_counts[2], d.ignored);
        dataset_free(&d);
    }
    // Cityscapes-like labelIds (16-bit): 7 road → 0, 26 car → 1, 0 unlabelled → 255 (void)
    const uint16_t ids[P] = {7, 7, 26, 0, 7, 26, 26, 0, 0, 7, 33, 7};
    png_by_hand(path, W, H, 16, ids, NULL, 0);
    ds_text(dir, "map.csv", "value,class\n7,0\n26,1\n0,255\n");
    rules = (MaskRules){1, {255}, map};
    char want[600];
    snprintf(want, sizeof want, "masks/a.png: pixel (2,2) has the value 33, which %s does not list",
             map);
    CHECK(dataset_open_named(&d, dir, 1, 2, H, W, 1 << 20, 1, NULL, &rules, err) == -1 &&
                  contains(err, want),
          "unmapped value: '%s'", err);
    ds_text(dir, "map.csv", "value,class\n7,0\n26,1\n0,255\n33,5\n");
    CHECK(dataset_open_named(&d, dir, 1, 2, H, W, 1 << 20, 1, NULL, &rules, err) == -1 &&
                  contains(err, "pixel (2,2) has the value 33, class 5 by") &&
                  contains(err, "but there are 2 classes (0..1)"),
          "mapped out of range: '%s'", err);
    ds_text(dir, "map.csv", "7,0\n 26 , 1\n0,255\n33,1\n");  // no header, blanks
    rc = dataset_open_named(&d, dir, 1, 2, H, W, 1 << 20, 1, NULL, &rules, err);
    CHECK(rc == 0 && dataset_batch(&d, &idx, 1, NULL, 0, x, y, err) == 0, "mapped: %s", err);
    const int32_t want_y[P] = {0, 0, 1, -1, 0, 1, 1, -1, -1, 0, 1, 0};
    for (int p = 0; rc == 0 && p < P; p++)
        CHECK(y[p] == want_y[p], "mapped pixel %d: label %d, want %d", p, y[p], want_y[p]);
    if (rc == 0) dataset_free(&d);
    // --ignore-index names classes after the map: the raw 26 is class 1, not ignored
    rules = (MaskRules){2, {255, 26}, map};
    rc = dataset_open_named(&d, dir, 1, 2, H, W, 1 << 20, 1, NULL, &rules, err);
    CHECK(rc == 0 && d.ignored == 3 && d.class_counts[1] == 4,
          "ignore after the map: %s, ignored %" PRId64, err, rc ? 0 : d.ignored);
    if (rc == 0) dataset_free(&d);
    // bad maps: the file and row
    static const struct {
        const char *text, *want;
    } BAD[] = {
            {"7,0\n7,1\n", "map.csv: row 2: this value is listed twice"},
            {"value,class\n7,x\n", "map.csv: row 2: expected value,class: integers 0..65535"},
            {"70000,1\n", "map.csv: row 1: expected value,class"},
            {"7,-1\n", "map.csv: row 1: expected value,class"},
            {"7,0,1\n", "map.csv: row 1: more than two fields"},
            {"value,class\n\n", "map.csv: no rows"},
    };
    for (size_t k = 0; k < sizeof BAD / sizeof *BAD; k++) {
        ds_text(dir, "map.csv", BAD[k].text);
        CHECK(dataset_open_named(&d, dir, 1, 2, H, W, 1 << 20, 1, NULL, &rules, err) == -1 &&
                      contains(err, BAD[k].want) && !strchr(err, '\n'),
              "bad map %zu: '%s', want '%s'", k, err, BAD[k].want);
    }
    unlink(map);
    CHECK(dataset_open_named(&d, dir, 1, 2, H, W, 1 << 20, 1, NULL, &rules, err) == -1 &&
                  contains(err, "map.csv"),
          "a missing map: '%s'", err);
    ds_remove(dir);
}

// Every tensor of two safetensors files holds the same bytes (names in order)
static int same_tensors(const char *a, const char *b, char err[SN_ERR_MAX]) {
    SafetensorsFile fa, fb;
    if (safetensors_read(a, &fa, err)) return 0;
    if (safetensors_read(b, &fb, err)) {
        safetensors_free(&fa);
        return 0;
    }
    int eq = fa.n_tensors == fb.n_tensors && fa.n_tensors > 0;
    for (int i = 0; eq && i < fa.n_tensors; i++) {
        const SafetensorsTensor *x = &fa.tensors[i], *y = &fb.tensors[i];
        eq = !strcmp(x->name, y->name) && x->dtype == y->dtype && x->numel == y->numel &&
             !memcmp(x->data, y->data, x->numel * dtype_size(x->dtype));
        if (!eq) snprintf(err, SN_ERR_MAX, "tensor %s differs", x->name);
    }
    safetensors_free(&fa);
    safetensors_free(&fb);
    return eq;
}

// A Pascal-VOC-style set (palette masks, 255 void) trains with --ignore-index
// 255. Its void pixels count nothing: a label that is ignored gives the
// arithmetic of one whose class has weight 0 (w[y] = 0 in the loss, its
// normaliser and the gradient; its confusion row not counted), so training
// on the void set equals, bit for bit, training on the same set with class 0
// (weight 0) where the void is: metrics.csv (but its timing column) and
// every weight. config.txt keeps the setting for eval --run and --resume,
// which refuses another.
TEST(train_voc_ignore_index) {
    const char *plain = "/tmp/segnet_test_voc_plain", *voc = "/tmp/segnet_test_voc",
               *run_plain = "/tmp/segnet_test_voc_run_plain", *run_voc = "/tmp/segnet_test_voc_run";
    rm_rf(plain);
    rm_rf(voc);
    rm_rf(run_plain);
    rm_rf(run_voc);
    enum { N = 4, S = 8, P = S * S };
    write_seg_set(plain, N, S, S, 11);  // class 0 on the right 2 columns
    char path[600], args[1400], msg[4096], err[SN_ERR_MAX];
    snprintf(path, sizeof path, "mkdir -p %s/masks && cp -r %s/images %s/", voc, plain, voc);
    CHECK(system(path) == 0, "%s", path);
    uint8_t plte[3 * 256];
    for (int k = 0; k < 256; k++) {  // VOC's colour map would do as well: only indices count
        plte[3 * k] = (uint8_t)(k * 37);
        plte[3 * k + 1] = (uint8_t)(k * 91);
        plte[3 * k + 2] = (uint8_t)(k == 255 ? 192 : k * 53);
    }
    int voids = 0;
    for (int i = 0; i < N; i++) {
        int w, h, n;
        snprintf(path, sizeof path, "%s/masks/i%02d.png", plain, i);
        uint8_t *m = stbi_load(path, &w, &h, &n, 1);
        CHECK(m && w == S && h == S, "read %s", path);
        if (!m) break;
        uint16_t idx[P];
        for (int p = 0; p < P; p++) {
            idx[p] = m[p] ? m[p] : 255;
            voids += !m[p];
        }
        stbi_image_free(m);
        snprintf(path, sizeof path, "%s/masks/i%02d.png", voc, i);
        png_by_hand(path, S, S, 8, idx, plte, 256);
    }
    CHECK(voids == N * 2 * S, "the void band: %d pixels", voids);
    const char *common = "train --model unet --depth 1 --width 4 --size 8x8 --batch 2 --epochs 2 "
                         "--classes 3 --class-weights 0,1,1";
    snprintf(args, sizeof args, "%s --data %s --val %s --out %s", common, voc, voc, run_voc);
    CHECK(run_segnet(args, msg, sizeof msg) == 1 && contains(msg, "has class 255") &&
                  contains(msg, "--ignore-index 255"),
          "without --ignore-index: '%s'", msg);
    CHECK(!file_exists(run_voc), "a refused run left %s", run_voc);
    snprintf(args, sizeof args, "%s --ignore-index 255 --data %s --val %s --out %s", common, voc,
             voc, run_voc);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "VOC set: %s", msg);
    snprintf(args, sizeof args, "%s --data %s --val %s --out %s", common, plain, plain, run_plain);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "plain set: %s", msg);
    char a[700], b[700];
    snprintf(a, sizeof a, "%s/metrics.csv", run_voc);
    snprintf(b, sizeof b, "%s/metrics.csv", run_plain);
    CHECK(files_equal(a, b), "metrics.csv differs between the void and the weight-0 set");
    snprintf(a, sizeof a, "%s/last.safetensors", run_voc);
    snprintf(b, sizeof b, "%s/last.safetensors", run_plain);
    CHECK(same_tensors(a, b, err), "last.safetensors: %s", err);
    snprintf(path, sizeof path, "%s/config.txt", run_voc);
    size_t n;
    char *cfg = read_file(path, &n);
    CHECK(cfg && contains(cfg, "\nignore-index = 255\n"), "config.txt: %s", cfg ? cfg : "");
    free(cfg);
    // eval --run takes the setting from config.txt
    snprintf(args, sizeof args, "eval --run %s", run_voc);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "eval --run: %s", msg);
    // a resumed run may not change what the loss ignores
    snprintf(args, sizeof args, "train --resume %s --epochs 3 --ignore-index 7", run_voc);
    CHECK(run_segnet(args, msg, sizeof msg) == 2 &&
                  contains(msg, "--ignore-index 7, but the run was trained with 255"),
          "resume with another --ignore-index: '%s'", msg);
    snprintf(args, sizeof args, "%s --ignore-index 70000 --data %s", common, voc);
    CHECK(run_segnet(args, msg, sizeof msg) == 2 && contains(msg, "--ignore-index '70000'"),
          "a value out of range: '%s'", msg);
    rm_rf(plain);
    rm_rf(voc);
    rm_rf(run_plain);
    rm_rf(run_voc);
}

// Issue 31, finding 6: a 1-, 2- or 4-bit grey mask gives its stored values.
// stb_image scales them to 8 bits (×255, ×85, ×17 for depths 1, 2, 4), so
// without the division back a stored 1 was class 255, 85 or 17. Width 5
// makes every depth pad its rows (5, 10, 20 bits).
TEST(mask_low_depth) {
    char dir[300], path[400], err[SN_ERR_MAX] = "";
    ds_fixture(dir, sizeof dir, "mask_depth", SEG_SUBS, 2);
    snprintf(path, sizeof path, "%s/masks/a.png", dir);
    enum { W = 5, H = 3, P = W * H };
    static const int SCALE[5] = {0, 255, 85, 0, 17};  // 255 / (2^depth - 1), by hand
    for (int depth = 1; depth <= 4; depth *= 2) {
        const int levels = 1 << depth;
        uint16_t v[P];
        // depth 4: 15 distinct values
        for (int p = 0; p < P; p++) v[p] = (uint16_t)((p * 7 + depth) % levels);
        png_by_hand(path, W, H, depth, v, NULL, 0);
        int w, h, n;
        uint8_t *stb = stbi_load(path, &w, &h, &n, 0);
        int scaled = stb && w == W && h == H && n == 1;
        for (int p = 0; scaled && p < P; p++) scaled = stb[p] == v[p] * SCALE[depth];
        CHECK(scaled, "depth %d: stb_image no longer gives v*%d (the fix divides by it)", depth,
              SCALE[depth]);
        stbi_image_free(stb);
        uint8_t *m = mask_load_k(path, H, W, levels, NULL, err);
        CHECK(m != NULL, "depth %d: %s", depth, err);
        for (int p = 0; m && p < P; p++)
            CHECK(m[p] == v[p], "depth %d, pixel %d: class %d, stored %d", depth, p, m[p], v[p]);
        free(m);
        // the same through a transparent grey (tRNS: stb_image adds an alpha channel)
        png_by_hand_trns(path, W, H, depth, v, NULL, 0, 0);
        m = mask_load_k(path, H, W, levels, NULL, err);
        CHECK(m != NULL, "depth %d with tRNS: %s", depth, err);
        for (int p = 0; m && p < P; p++)
            CHECK(m[p] == v[p], "depth %d with tRNS, pixel %d: class %d, stored %d", depth, p, m[p],
                  v[p]);
        free(m);
        // the largest stored value, levels - 1, with levels - 1 classes: named as stored
        png_by_hand(path, W, H, depth, v, NULL, 0);
        int first = 0;
        while (v[first] != levels - 1) first++;
        char want[128];
        snprintf(want, sizeof want,
                 "masks/a.png: pixel (%d,%d) has class %d, but there are %d classes", first % W,
                 first / W, levels - 1, levels - 1);
        m = mask_load_k(path, H, W, levels - 1, NULL, err);
        CHECK(!m && contains(err, want), "depth %d out of range: '%s', want '%s'", depth, err,
              want);
        free(m);
    }
    // the finding's case: a 4-bit mask of {0, 1} with 18 classes, through the data set
    uint16_t v[P];
    for (int p = 0; p < P; p++) v[p] = (uint16_t)(p % 3 == 1);
    png_by_hand(path, W, H, 4, v, NULL, 0);
    uint8_t px[P * 3] = {0};
    ds_png(dir, "images/a.png", W, H, 3, px);
    Dataset d;
    float x[P * 3];
    int32_t y[P];
    const int idx = 0;
    int rc = dataset_open(&d, dir, 1, 18, H, W, 1 << 20, 1, err);
    CHECK(rc == 0 && dataset_batch(&d, &idx, 1, NULL, 0, x, y, err) == 0,
          "4-bit mask, 18 classes: %s", err);
    for (int p = 0; rc == 0 && p < P; p++)
        CHECK(y[p] == v[p], "pixel %d: class %d, stored %d", p, y[p], v[p]);
    if (rc == 0) dataset_free(&d);
    ds_remove(dir);
}

// Issue 31, finding 7: a colour mask (pixels of differing R, G, B) is refused,
// naming the first such pixel and its colour; RGB and RGBA whose pixels all
// have R = G = B, and grey + alpha, give the grey value (alpha ignored).
TEST(mask_colour) {
    char dir[300], path[400], err[SN_ERR_MAX] = "";
    ds_fixture(dir, sizeof dir, "mask_colour", SEG_SUBS, 2);
    snprintf(path, sizeof path, "%s/masks/a.png", dir);
    enum { W = 4, H = 3, P = W * H };
    static const uint8_t CLS[P] = {0, 1, 2, 3, 3, 2, 1, 0, 1, 1, 2, 2};
    uint8_t px[P * 4];
    for (int comp = 2; comp <= 4; comp++) {  // grey + alpha, RGB, RGBA
        for (int p = 0; p < P; p++)
            for (int c = 0; c < comp; c++)
                // alpha varies
                px[p * comp + c] =
                        (comp % 2 == 0 && c == comp - 1) ? (uint8_t)(255 - 20 * p) : CLS[p];
        CHECK(stbi_write_png(path, W, H, comp, px, W * comp) != 0, "writing %s", path);
        uint8_t *m = mask_load_k(path, H, W, 4, NULL, err);
        CHECK(m != NULL, "%d channels: %s", comp, err);
        for (int p = 0; m && p < P; p++)
            CHECK(m[p] == CLS[p], "%d channels, pixel %d: class %d, want %d", comp, p, m[p],
                  CLS[p]);
        free(m);
    }
    // classes as colours: black 0, green, blue; the first coloured pixel is (2,1)
    memset(px, 0, sizeof px);
    px[3 * 6 + 1] = 255;   // pixel 6 = (2,1): (0,255,0)
    px[3 * 9 + 2] = 255;   // pixel 9 = (1,2): (0,0,255)
    ds_png(dir, "masks/a.png", W, H, 3, px);
    uint8_t *m = mask_load_k(path, H, W, 4, NULL, err);
    CHECK(!m &&
                  contains(
                          err,
                          "masks/a.png: pixel (2,1) has the colour (0,255,0), not a class index") &&
                  contains(err, "pixel value = class index") && !strchr(err, '\n'),
          "RGB classes: '%s'", err);
    free(m);
    // RGBA: one channel off by one is colour too (no channel is preferred)
    for (int p = 0; p < P; p++) {
        px[4 * p] = px[4 * p + 1] = px[4 * p + 2] = 1;
        px[4 * p + 3] = 255;
    }
    px[4 * 11 + 2] = 2;    // pixel 11 = (3,2): (1,1,2)
    CHECK(stbi_write_png(path, W, H, 4, px, W * 4) != 0, "writing %s", path);
    m = mask_load_k(path, H, W, 4, NULL, err);
    CHECK(!m && contains(err, "masks/a.png: pixel (3,2) has the colour (1,1,2)"), "RGBA: '%s'",
          err);
    free(m);
    ds_remove(dir);
}

// The loader resizes decoded bytes straight to bytes (image_to_bytes): the
// bytes the model's resize op gives for the image as floats, rounded to
// nearest, exactly, shrinking, growing, one axis each way, and the same size.
TEST(image_to_bytes_is_the_resize_op) {
    static const int SIZES[][4] = {
            {720, 1200, 300, 500}, {7, 5, 16, 9}, {30, 8, 11, 24}, {13, 13, 13, 13}, {1, 9, 4, 2}};
    Rng r;
    rng_seed(&r, 44);
    for (size_t k = 0; k < sizeof SIZES / sizeof *SIZES; k++) {
        const int h = SIZES[k][0], w = SIZES[k][1], H = SIZES[k][2], W = SIZES[k][3];
        uint8_t *src = malloc((size_t)3 * h * w), *got = malloc((size_t)3 * H * W);
        float *x = malloc(sizeof(float) * 3 * h * w), *y = malloc(sizeof(float) * 3 * H * W);
        for (int i = 0; i < 3 * h * w; i++) x[i] = src[i] = (uint8_t)(rng_next(&r) & 255);
        ops_cpu.resize_bilinear_forward(&ops_cpu, tensor_f32(y, shape4(1, H, W, 3)),
                                        tensor_f32(x, shape4(1, h, w, 3)));
        image_to_bytes(got, H, W, src, h, w);
        int wrong = 0;
        for (int i = 0; i < 3 * H * W; i++) {
            const long v = lrintf(y[i]);
            wrong += got[i] != (v < 0 ? 0 : v > 255 ? 255 : v);
        }
        CHECK(wrong == 0, "%dx%d to %dx%d: %d bytes differ from the resize op's", w, h, W, H,
              wrong);
        free(src);
        free(got);
        free(x);
        free(y);
    }
}

// segnet bench --loader's timing (bench_loader): every timed batch arrives
// whole, the set's size is reported, and a missing set is the data set's error.
TEST(bench_loader_counts) {
    char dir[300], err[SN_ERR_MAX];
    static const char *const SUBS[] = {"a", "b"};
    ds_fixture(dir, sizeof dir, "bench_loader", SUBS, 2);
    Rng r;
    rng_seed(&r, 3);
    for (int i = 0; i < 6; i++) {
        char name[32];
        snprintf(name, sizeof name, "%s/i%d.png", SUBS[i % 2], i);
        write_png(dir, name, 20, 30, &r);
    }
    TrainCfg c;
    train_cfg_default(&c);
    c.model.model = "effv2-t";
    c.model.classes = 2;
    c.model.height = 16;
    c.model.width = 24;
    c.model.batch = 4;
    c.workers = 2;
    c.augment = (Augment){.flip = 1, .brightness = 0.5f, .contrast_lo = 0.5f, .contrast_hi = 1.5f};
    c.data = dir;
    LoaderBench lb = {.batches = 5, .warmup = 1};
    CHECK(bench_loader(&c, &lb, err) == 0, "%s", err);
    CHECK(lb.images == 6 && lb.ms_per_batch > 0 && isfinite(lb.images_per_s) &&
                  fabs(lb.images_per_s * lb.ms_per_batch / 1e3 - 4.0) < 1e-9,
          "6 images, batches of 4: %d images, %g ms per batch, %g images/s", lb.images,
          lb.ms_per_batch, lb.images_per_s);
    char missing[400];
    snprintf(missing, sizeof missing, "%s/none", dir);
    c.data = missing;
    CHECK(bench_loader(&c, &lb, err) == -1 && contains(err, missing), "missing: '%s'", err);
    ds_remove(dir);
}

// --class-weights auto by hand (issue 35, item 6). Two 4x4 masks, K = 4:
//   A: class 0 ×12 (2 of them void with --ignore-index 255), class 1 ×4
//   B: class 0 ×8, class 2 ×8; class 3 never occurs
// Without the void: counts (20, 4, 8), the pixels of the masks holding each
// class (32, 16, 16): freq (0.625, 0.25, 0.5), median 0.5, w (0.8, 2, 1, 0).
// With A's 2 void pixels: counts (18, 4, 8), holding (14 + 16, 14, 16): freq
// (0.6, 2/7, 0.5), w (5/6, 1.75, 1, 0). A classifier's labels (0,0,0,1,2,2):
// freq (1/2, 1/6, 1/3), w (2/3, 2, 1).
TEST(class_weights_auto_by_hand) {
    char dir[300], err[SN_ERR_MAX];
    ds_fixture(dir, sizeof dir, "cw_auto", SEG_SUBS, 2);
    uint8_t px[16 * 3] = {0}, a[16], b[16];
    for (int p = 0; p < 16; p++) {
        a[p] = p < 12 ? 0 : 1;
        b[p] = p < 8 ? 0 : 2;
    }
    ds_png(dir, "images/a.png", 4, 4, 3, px);
    ds_png(dir, "images/b.png", 4, 4, 3, px);
    ds_png(dir, "masks/a.png", 4, 4, 1, a);
    ds_png(dir, "masks/b.png", 4, 4, 1, b);
    float w[4];
    CHECK(class_weights_median_frequency(dir, 1, 4, 4, 4, NULL, w, err) == 0, "%s", err);
    CHECK(fabsf(w[0] - 0.8f) < 1e-6f && fabsf(w[1] - 2.0f) < 1e-6f && fabsf(w[2] - 1.0f) < 1e-6f &&
                  w[3] == 0.0f,
          "weights %g %g %g %g, want 0.8 2 1 0", w[0], w[1], w[2], w[3]);
    a[0] = a[1] = 255;
    ds_png(dir, "masks/a.png", 4, 4, 1, a);
    const MaskRules void255 = {1, {255}, NULL};
    CHECK(class_weights_median_frequency(dir, 1, 4, 4, 4, &void255, w, err) == 0, "%s", err);
    CHECK(fabsf(w[0] - 5.0f / 6.0f) < 1e-6f && fabsf(w[1] - 1.75f) < 1e-6f &&
                  fabsf(w[2] - 1.0f) < 1e-6f && w[3] == 0.0f,
          "with void: %g %g %g %g, want 5/6 1.75 1 0", w[0], w[1], w[2], w[3]);
    CHECK(class_weights_median_frequency(dir, 1, 4, 4, 4, NULL, w, err) == -1 &&
                  contains(err, "masks/a.png: pixel (0,0) has class 255"),
          "void without --ignore-index: '%s'", err);
    ds_text(dir, "list.csv",
            "images/a.png,0\nimages/a.png,0\nimages/b.png,0\n"
            "images/b.png,1\nimages/a.png,2\nimages/b.png,2\n");
    char csv[400];
    snprintf(csv, sizeof csv, "%s/list.csv", dir);
    CHECK(class_weights_median_frequency(csv, 0, 3, 4, 4, NULL, w, err) == 0, "%s", err);
    CHECK(fabsf(w[0] - 2.0f / 3.0f) < 1e-6f && fabsf(w[1] - 2.0f) < 1e-6f &&
                  fabsf(w[2] - 1.0f) < 1e-6f,
          "classifier: %g %g %g, want 2/3 2 1", w[0], w[1], w[2]);
    ds_remove(dir);
}

// --class-weights auto on the command line: the weights are printed and kept
// in config.txt as numbers (so eval --run and --resume use them), and a
// resumed run refuses to compute them again.
TEST(class_weights_auto_cli) {
    const char *data = "/tmp/segnet_test_cwa_data", *run = "/tmp/segnet_test_cwa_run";
    rm_rf(data);
    rm_rf(run);
    write_seg_set(data, 4, 8, 8, 6);
    char args[800], msg[4096], path[400];
    snprintf(args, sizeof args,
             "train --model unet --depth 1 --width 4 --size 8x8 --batch 2 --epochs 1 --classes 3 "
             "--class-weights auto --data %s --out %s --device cpu",
             data, run);
    CHECK(run_segnet(args, msg, sizeof msg) == 0 && contains(msg, "--class-weights auto"),
          "train: %s", msg);
    float w[3];
    char err[SN_ERR_MAX];
    CHECK(class_weights_median_frequency(data, 1, 3, 8, 8, NULL, w, err) == 0, "%s", err);
    char want[200], f[3][32];
    snprintf(want, sizeof want, "\nclass-weights = %s,%s,%s\n", float_str(f[0], w[0]),
             float_str(f[1], w[1]), float_str(f[2], w[2]));
    snprintf(path, sizeof path, "%s/config.txt", run);
    size_t n;
    char *cfg = read_file(path, &n);
    CHECK(cfg && contains(cfg, want) && contains(msg, want + 17), "config.txt holds%s: %s", want,
          cfg ? cfg : "");
    free(cfg);
    snprintf(args, sizeof args, "train --resume %s --epochs 2 --class-weights auto", run);
    CHECK(run_segnet(args, msg, sizeof msg) == 2 &&
                  contains(msg, "a resumed run keeps the weights in its config.txt"),
          "resume with auto: '%s'", msg);
    rm_rf(data);
    rm_rf(run);
}

// ---- segmentation augmentation (issue 35, item 5)

// The mask follows the image pixel for pixel: an image of 16 blocks of 8x8,
// block k of its own colour and class k, zoomed (0.6..1.6), rotated (±35°),
// cropped and flipped both ways. Wherever the augmented image holds a block's
// colour exactly (inside a block, where bilinear reads 4 equal pixels), the
// label is that block's class; where the label is SN_LABEL_IGNORED (outside the
// sample) the image is 0; and the same draws give the same batch.
TEST(augment_mask_follows_image) {
    char dir[300], err[SN_ERR_MAX];
    ds_fixture(dir, sizeof dir, "aug_follow", SEG_SUBS, 2);
    enum { H = 32, W = 32, K = 16 };
    uint8_t px[H * W * 3], m[H * W];
    uint8_t colour[K][3];
    for (int k = 0; k < K; k++) {
        colour[k][0] = (uint8_t)(15 + 15 * k);
        colour[k][1] = (uint8_t)(240 - 13 * k);
        colour[k][2] = (uint8_t)(100 + 9 * (k % 5));
    }
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++) {
            const int k = (y / 8) * 4 + x / 8;
            memcpy(px + 3 * (y * W + x), colour[k], 3);
            m[y * W + x] = (uint8_t)k;
        }
    ds_png(dir, "images/a.png", W, H, 3, px);
    ds_png(dir, "masks/a.png", W, H, 1, m);
    Dataset d;
    CHECK(dataset_open(&d, dir, 1, K, H, W, 1 << 20, 1, err) == 0, "%s", err);
    const Augment aug = {
            .flip = 1, .vflip = 1, .scale_lo = 0.6f, .scale_hi = 1.6f, .rotate = 35.0f};
    float x[H * W * 3], x2[H * W * 3];
    int32_t y[H * W], y2[H * W];
    const int idx = 0;
    int matched = 0, outside = 0, wrong = 0;
    for (uint64_t seed = 1; seed <= 20; seed++) {
        CHECK(dataset_batch(&d, &idx, 1, &aug, seed, x, y, err) == 0, "%s", err);
        for (int p = 0; p < H * W; p++) {
            if (y[p] == SN_LABEL_IGNORED) {
                outside++;
                wrong += x[3 * p] != 0 || x[3 * p + 1] != 0 || x[3 * p + 2] != 0;
                continue;
            }
            for (int k = 0; k < K; k++)
                if (fabsf(x[3 * p] - colour[k][0]) < 1e-3f &&
                    fabsf(x[3 * p + 1] - colour[k][1]) < 1e-3f &&
                    fabsf(x[3 * p + 2] - colour[k][2]) < 1e-3f) {
                    matched++;
                    wrong += y[p] != k;
                }
        }
        CHECK(dataset_batch(&d, &idx, 1, &aug, seed, x2, y2, err) == 0 &&
                      !memcmp(x, x2, sizeof x) && !memcmp(y, y2, sizeof y),
              "seed %" PRIu64 ": the same draws, another batch", seed);
    }
    CHECK(wrong == 0 && matched > 20 * H * W / 2 && outside > 0,
          "%d pixels whose label is not their colour's block (%d matched, %d outside)", wrong,
          matched, outside);
    dataset_free(&d);
    ds_remove(dir);
}

// segnet augment (augment_write): the image written is the batch epoch 2 of a
// run feeds the network (dataset_batch with that epoch's seed), rounded to
// bytes; the overlay blends the mask's colours; an existing file stops it.
// Names are zero-padded (epoch 2 of 10, sample 1 of 11: aug02-01-), so they list in order.
TEST(augment_write_files) {
    const char *data = "/tmp/segnet_test_augw_data", *out = "/tmp/segnet_test_augw_out";
    rm_rf(data);
    rm_rf(out);
    write_seg_set(data, 12, 8, 8, 4);
    TrainCfg c = tiny_seg_cfg(data, NULL);
    c.epochs = 10;
    c.augment =
            (Augment){.flip = 1, .scale_lo = 0.8f, .scale_hi = 1.3f, .rotate = 20.0f, .hue = 0.1f};
    char err[SN_ERR_MAX], path[400];
    CHECK(augment_write(&c, out, 11, 2, err) == 0, "%s", err);
    Dataset d;
    CHECK(dataset_open(&d, data, 1, 3, 8, 8, 1 << 20, 1, err) == 0, "%s", err);
    float x[8 * 8 * 3];
    int32_t y[64];
    const int idx = 1;
    CHECK(dataset_batch(&d, &idx, 1, &c.augment, augment_seed_of(epoch_seed_of(c.seed, 1)), x, y,
                        err) == 0,
          "%s", err);
    int w, h, n;
    snprintf(path, sizeof path, "%s/aug02-01-i01.png", out);
    uint8_t *img = stbi_load(path, &w, &h, &n, 3);
    int wrong = 0;
    for (int k = 0; img && k < 8 * 8 * 3; k++) {
        const long v = lrintf(x[k]);
        wrong += img[k] != (v < 0 ? 0 : v > 255 ? 255 : v);
    }
    CHECK(img && w == 8 && h == 8 && !wrong, "%s: the batch's image (%d values differ)", path,
          wrong);
    stbi_image_free(img);
    snprintf(path, sizeof path, "%s/aug02-01-i01_overlay.png", out);
    CHECK(file_exists(path), "%s", path);
    snprintf(path, sizeof path, "%s/aug02-10-i10.png", out);
    CHECK(file_exists(path), "%s", path);
    snprintf(path, sizeof path, "%s/aug02-11-i11.png", out);
    CHECK(!file_exists(path), "-n 11 writes 11 samples");
    CHECK(augment_write(&c, out, 11, 2, err) == -1 && contains(err, "aug02-00-i00.png: exists"),
          "again: '%s'", err);
    dataset_free(&d);
    rm_rf(data);
    rm_rf(out);
}

// pixel_hue_saturation against other forms of the same hexagonal HSV (tf's):
// RGB → HSV as Python's colorsys writes it, HSV → RGB as Wikipedia's
// "alternative" f(n) = V - V·S·max(0, min(k, 4 - k, 1)), k = (n + 6H) mod 6 for
// n = 5, 3, 1; on random pixels, shifts and factors; and by hand: red turned
// by a third of the circle is green, and saturation 0 is grey.
TEST(augment_hue_saturation) {
    Rng r;
    rng_seed(&r, 21);
    double worst = 0;
    for (int t = 0; t < 2000; t++) {
        float v[3], dh = 0.5f * (2 * rng_float(&r) - 1), fs = 2 * rng_float(&r);
        for (int c = 0; c < 3; c++) v[c] = rng_float(&r);
        const double R = v[0], G = v[1], B = v[2], mx = fmax(R, fmax(G, B)),
                     mn = fmin(R, fmin(G, B));
        double h = 0;
        if (mx > mn) {  // Python colorsys' form: distances from the max
            const double rc = (mx - R) / (mx - mn), gc = (mx - G) / (mx - mn),
                         bc = (mx - B) / (mx - mn);
            h = R == mx ? bc - gc : G == mx ? 2 + rc - bc : 4 + gc - rc;
            h = fmod(h / 6 + 1, 1);
        }
        double S = mx > 0 ? (mx - mn) / mx : 0;
        h = fmod(h + dh + 1.0, 1.0);
        S = fmin(S * fs, 1.0);
        double want[3];
        for (int c = 0; c < 3; c++) {
            const double k = fmod((c == 0 ? 5 : c == 1 ? 3 : 1) + 6 * h, 6);
            want[c] = mx - mx * S * fmax(0, fmin(fmin(k, 4 - k), 1));
        }
        pixel_hue_saturation(v, dh, fs);
        for (int c = 0; c < 3; c++) worst = fmax(worst, fabs(v[c] - want[c]));
    }
    // fp32 against fp64, some 10 roundings of values ≤ 1 (each ≤ 6e-8): 1e-5 is ample
    CHECK(worst < 1e-5, "HSV round trip off by %g from the other formulas", worst);
    float red[3] = {1, 0, 0}, grey[3] = {0.8f, 0.2f, 0.4f};
    pixel_hue_saturation(red, 1.0f / 3.0f, 1.0f);
    CHECK(fabsf(red[0]) < 1e-6f && fabsf(red[1] - 1) < 1e-6f && fabsf(red[2]) < 1e-6f,
          "red + 1/3 = green: %g %g %g", red[0], red[1], red[2]);
    pixel_hue_saturation(grey, 0.0f, 0.0f);
    CHECK(grey[0] == grey[1] && grey[1] == grey[2] && fabsf(grey[0] - 0.8f) < 1e-6f,
          "saturation 0 is the grey of the value: %g %g %g", grey[0], grey[1], grey[2]);
}

// ---- tiled prediction (issue 35, item 4)

// Tile starts by hand: n = ceil((L - T)/(T·(1 - overlap))) + 1, at round(i·(L - T)/(n - 1)).
TEST(tile_starts_by_hand) {
    int s[128];
    CHECK(tile_starts(100, 32, 0.5f, s) == 6 && s[0] == 0 && s[1] == 14 && s[2] == 27 &&
                  s[3] == 41 && s[4] == 54 && s[5] == 68,
          "100 by 32, overlap 0.5: 6 tiles at 0 14 27 41 54 68");
    CHECK(tile_starts(64, 32, 0.0f, s) == 2 && s[0] == 0 && s[1] == 32, "64 by 32: 0 32");
    CHECK(tile_starts(65, 32, 0.0f, s) == 3 && s[1] == 17 && s[2] == 33,
          "65 by 32: 0 17 33 (16.5 rounds up)");
    // the Gaussian map of an 8x4 tile: centre (3.5, 1.5), σ (1, 0.5)
    float g[32];
    tile_gaussian(g, 8, 4);
    CHECK_NEAR(g[0], exp(-(3.5 * 3.5 / 2 + 1.5 * 1.5 / 0.5)), 1e-12, "g(0,0)");
    CHECK_NEAR(g[3 * 4 + 1], exp(-(0.25 / 2 + 0.25 / 0.5)), 1e-7, "g(3,1), next to the centre");
    CHECK(g[3 * 4 + 1] == g[4 * 4 + 2] && g[0] == g[7 * 4 + 3], "symmetric about the centre");
    CHECK(tile_starts(32, 32, 0.5f, s) == 1 && s[0] == 0, "one tile when L = T");
    CHECK(tile_starts(20, 32, 0.5f, s) == 1 && s[0] == 0, "one tile when L < T");
}

// Stand-in models for predict_tiled: logits a function of the pixel alone.
// constant: z = (0.1, 2, -1) everywhere; pointwise: z_k = Σ_c A[k][c]·rgb_c/255.
static const float TILE_A[3][3] = {{1.0f, -2.0f, 0.5f}, {-0.5f, 1.5f, 1.0f}, {2.0f, 0.0f, -1.0f}};
static void tiles_pointwise(void *ctx, const float *x, int n, float *z) {
    const int *px = ctx, constant = px[1];
    for (size_t p = 0; p < (size_t)n * px[0]; p++)
        for (int k = 0; k < 3; k++)
            z[3 * p + k] = constant ? (k == 0   ? 0.1f
                                       : k == 1 ? 2.0f
                                                : -1.0f)
                                    : (TILE_A[k][0] * x[3 * p] + TILE_A[k][1] * x[3 * p + 1] +
                                       TILE_A[k][2] * x[3 * p + 2]) /
                                              255.0f;
}

// A model whose logits depend on the pixel alone sees every pixel whole in
// every tile, so the blend of its tiles is the whole image's prediction:
// Σ g·p / Σ g with every p the same. Its error is the rounding of at most 8
// terms (2×2 tiles overlap a pixel, ×2 with --tta flip) in fp32 each side of
// the division: |Δp| ≤ (8 + 8 + 1)·2^-24·p < 1.1e-6·p, so 2e-6. Shapes: tiles
// that overlap unevenly, an image smaller than a tile (padded by its edges),
// and a tile the image's size. The constant model's mask is the same class
// everywhere.
TEST(predict_tiled_pointwise) {
    static const int CASES[][5] = {
            {50, 70, 16, 24, 30}, {10, 12, 16, 16, 50}, {32, 32, 32, 32, 0}, {33, 97, 32, 32, 25}};
    Rng r;
    rng_seed(&r, 8);
    for (size_t c = 0; c < sizeof CASES / sizeof *CASES; c++)
        for (int tta = 0; tta < 2; tta++)
            for (int constant = 0; constant < 2; constant++) {
                const int h = CASES[c][0], w = CASES[c][1], th = CASES[c][2], tw = CASES[c][3];
                int ctx[2] = {th * tw, constant};
                const TileModel m = {tiles_pointwise, ctx, 3, th, tw, 3, NULL, 0};
                float *img = malloc(sizeof(float) * 3 * h * w),
                      *probs = malloc(sizeof(float) * 3 * h * w);
                uint8_t *img8 = malloc((size_t)3 * h * w);
                for (int i = 0; i < 3 * h * w; i++)
                    img[i] = img8[i] = (uint8_t)(rng_next(&r) % 256);
                predict_tiled(&m, img8, NULL, h, w, CASES[c][4] / 100.0f, tta, probs);
                free(img8);
                double worst = 0;
                int other_class = 0;
                for (int p = 0; p < h * w; p++) {
                    float z[3];
                    int one_pixel[2] = {1, constant};
                    tiles_pointwise(one_pixel, img + 3 * p, 1, z);
                    double zmax = fmax(z[0], fmax(z[1], z[2])), sum = 0;
                    for (int k = 0; k < 3; k++) sum += exp(z[k] - zmax);
                    for (int k = 0; k < 3; k++) {
                        const double want = exp(z[k] - zmax) / sum,
                                     e = fabs(probs[3 * p + k] - want) / want;
                        worst = e > worst ? e : worst;
                    }
                    uint8_t cls;
                    argmax_rows(&cls, probs + 3 * p, 1, 3);
                    other_class += constant && cls != 1;
                }
                CHECK(worst < 2e-6 && !other_class,
                      "%dx%d in %dx%d tiles, overlap %d%%, tta %d, %s: relative error %.3g, %d "
                      "pixels not class 1",
                      w, h, tw, th, CASES[c][4], tta, constant ? "constant" : "pointwise", worst,
                      other_class);
                free(img);
                free(probs);
            }
}

TEST(png_write_atomic) {
    char dir[300], path[400], err[SN_ERR_MAX] = "";
    ds_fixture(dir, sizeof dir, "png", NULL, 0);
    Rng r; rng_seed(&r, 6);
    for (int comp = 1; comp <= 3; comp += 2) {
        uint8_t *px = ds_random(&r, (size_t)7 * 3 * comp, 256);
        snprintf(path, sizeof path, "%s/out.png", dir);
        // the second round replaces the first
        CHECK(png_write_atomic(path, 7, 3, comp, px, err) == 0, "%s", err);
        int w = 0, h = 0, n = 0;
        uint8_t *back = stbi_load(path, &w, &h, &n, 0);
        CHECK(back && w == 7 && h == 3 && n == comp && !memcmp(back, px, (size_t)21 * comp),
              "comp %d read back", comp);
        stbi_image_free(back);
        free(px);
    }
    uint8_t px[4] = {1, 2, 3, 4};
    snprintf(path, sizeof path, "%s/sub", dir);
    CHECK(mkdir(path, 0755) == 0, "mkdir");
    CHECK(png_write_atomic(path, 2, 2, 1, px, err) == -1 && contains(err, "sub") &&
                  contains(err, "renaming"),
          "over a folder: '%s'", err);
    struct stat sb;
    CHECK(stat(path, &sb) == 0 && S_ISDIR(sb.st_mode), "the folder is untouched");
    snprintf(path, sizeof path, "%s/nodir/x.png", dir);
    CHECK(png_write_atomic(path, 2, 2, 1, px, err) == -1 && contains(err, "nodir/x.png") &&
                  contains(err, "No such file"),
          "into a missing folder: '%s'", err);
    DIR *d = opendir(dir);
    int leftovers = 0;
    for (struct dirent *e; d && (e = readdir(d));) leftovers += strstr(e->d_name, ".tmp.") != NULL;
    if (d) closedir(d);
    CHECK(leftovers == 0, "no temporary file left behind");
    ds_remove(dir);
}

// A PNG of a given size whose pixel data never comes: the header is all a
// size check may read (stb_image does not check chunk CRCs).
static void write_png_header_only(const char *path, uint32_t w, uint32_t h) {
    uint8_t b[33] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n', 0, 0, 0, 13, 'I', 'H', 'D', 'R'};
    for (int i = 0; i < 4; i++) {
        b[16 + i] = (uint8_t)(w >> (24 - 8 * i));
        b[20 + i] = (uint8_t)(h >> (24 - 8 * i));
    }
    b[24] = 8; b[25] = 2;  // 8-bit RGB
    write_file_bytes(path, b, sizeof b);
}

// Readers of a path: 0 when they refused it as "not a regular file".
static int read_as_image(const char *path) {
    char err[SN_ERR_MAX];
    int h, w;
    float *p = image_load_rgb(path, &h, &w, err);
    free(p);
    return !p && contains(err, "not a regular file") ? 0 : 1;
}
static int read_as_csv(const char *path) {
    char err[SN_ERR_MAX];
    Dataset d;
    int rc = dataset_open(&d, path, 0, 3, 4, 4, 0, 1, err);
    if (rc == 0) dataset_free(&d);
    return rc && contains(err, "not a regular file") ? 0 : 1;
}
static int read_as_safetensors(const char *path) {
    char err[SN_ERR_MAX];
    SafetensorsFile f;
    int rc = safetensors_read(path, &f, err);
    if (rc == 0) safetensors_free(&f);
    return rc && contains(err, "not a regular file") ? 0 : 1;
}

// reader(path) in a child, so that a read that blocks fails the test instead of stopping it
static int refused_without_blocking(int (*reader)(const char *), const char *path) {
    pid_t child = fork();
    if (child == 0) _exit(reader(path));
    int status = -1, waited = 0;
    for (; waited < 100 && waitpid(child, &status, WNOHANG) == 0; waited++) usleep(50000);
    if (waited == 100) { kill(child, SIGKILL); waitpid(child, &status, 0); }
    return waited < 100 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// Findings 3, 4, 8, 9: an image's declared size is checked before decoding
// (--max-pixels); images are recognised by content and masks must be PNG; a
// FIFO is refused without blocking (only regular files are read); messages are
// one printable line.
TEST(image_files_checked) {
    char dir[300], path[400], err[SN_ERR_MAX];
    const char *const subs[] = {"x"};
    ds_fixture(dir, sizeof dir, "images_checked", subs, 1);
    int h, w;
    snprintf(path, sizeof path, "%s/bomb.png", dir);
    write_png_header_only(path, 16000, 16000);
    float *img = image_load_rgb(path, &h, &w, err);
    CHECK(!img && contains(err, "bomb.png: 16000x16000 is 256000000 pixels, more than the limit of "
                                "100000000 (--max-pixels)"),
          "'%s'", err);
    free(img);
    Rng r; rng_seed(&r, 5);
    uint8_t *px = ds_random(&r, 8 * 8 * 3, 3);
    ds_png(dir, "small.png", 8, 8, 3, px);
    snprintf(path, sizeof path, "%s/small.png", dir);
    image_max_pixels = 63;
    img = image_load_rgb(path, &h, &w, err);
    CHECK(!img && contains(err, "8x8 is 64 pixels, more than the limit of 63"), "'%s'", err);
    free(img);
    image_max_pixels = IMAGE_MAX_PIXELS_DEFAULT;
    // JPEG data under a .png name: an image (by content), never a mask
    snprintf(path, sizeof path, "%s/photo.png", dir);
    CHECK(stbi_write_jpg(path, 8, 8, 3, px, 90) != 0, "write %s", path);
    img = image_load_rgb(path, &h, &w, err);
    CHECK(img && h == 8 && w == 8, "JPEG content named .png is an image: %s", img ? "" : err);
    free(img);
    uint8_t *m = mask_load_k(path, 8, 8, 3, NULL, err);
    CHECK(!m && contains(err, "photo.png: holds JPEG data, but a mask must be a PNG"), "'%s'", err);
    free(m);
    snprintf(path, sizeof path, "%s/text.png", dir);
    write_file_bytes(path, "GIF89a not really", 17);
    img = image_load_rgb(path, &h, &w, err);
    CHECK(!img && contains(err, "text.png: not a PNG or JPEG file"), "'%s'", err);
    free(img);
    // FIFOs named as an image, a CSV, a checkpoint: refused at once
    snprintf(path, sizeof path, "%s/fifo.png", dir);
    CHECK(mkfifo(path, 0644) == 0, "mkfifo %s", path);
    CHECK(refused_without_blocking(read_as_image, path), "an image that is a FIFO");
    CHECK(refused_without_blocking(read_as_csv, path), "a CSV that is a FIFO");
    CHECK(refused_without_blocking(read_as_safetensors, path), "a safetensors file that is a FIFO");
    // bytes of a message that are not printable are shown escaped, on one line
    FILE *f = tmpfile();
    print_message(f, "segnet eval", "a\nb\rc\x01" "d\x7f" "e caf\xc3\xa9");
    rewind(f);
    char line[200] = "";
    CHECK(fgets(line, sizeof line, f) &&
                  !strcmp(line, "segnet eval: a\\x0ab\\x0dc\\x01d\\x7fe caf\xc3\xa9\n"),
          "'%s'", line);
    fclose(f);
    CHECK(decoder_reason() != NULL, "a decoder failure always has a reason");
    free(px);
    ds_remove(dir);
}

// Finding 7: a CSV's fields are trimmed, a BOM is skipped, and a row with a
// blank label, a label too long to keep or more than two fields is refused
// naming the row.
TEST(csv_strict) {
    char dir[300], path[400], err[SN_ERR_MAX];
    const char *const subs[] = {"imgs"};
    ds_fixture(dir, sizeof dir, "csv_strict", subs, 1);
    Rng r; rng_seed(&r, 6);
    uint8_t *px = ds_random(&r, 4 * 4 * 3, 256);
    ds_png(dir, "imgs/a.png", 4, 4, 3, px);
    ds_png(dir, "imgs/b.png", 4, 4, 3, px);
    ds_text(dir, "ok.csv", "\xef\xbb\xbfpath,label\n imgs/a.png , 1 \n\"imgs/b.png\"  ,\t2\n");
    snprintf(path, sizeof path, "%s/ok.csv", dir);
    Dataset d;
    int rc = dataset_open(&d, path, 0, 3, 4, 4, 0, 1, err);
    CHECK(rc == 0 && d.n == 2 && d.labels[0] == 1 && d.labels[1] == 2,
          "BOM, blanks around fields: %s", rc ? err : "");
    if (rc == 0) dataset_free(&d);
    char long_label[200];
    snprintf(long_label, sizeof long_label, "path,label\nimgs/a.png,1%070dx\n", 0);
    for (char *p = strchr(long_label, '1') + 1; *p == '0'; p++) *p = ' ';
    struct { const char *text, *want; } cases[] = {
        {"path,label\nimgs/a.png,1\nimgs/b.png,   \n", "row 3: no label"},
        {long_label, "row 2: a field is too long"},
        {"imgs/a.png,1,extra\n", "row 1: more than two fields"},
        {"imgs/a.png,1,\n", "row 1: more than two fields"},
        {"\"imgs/a.png\"x,1\n", "row 1: text after a closing quote"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        ds_text(dir, "bad.csv", cases[k].text);
        snprintf(path, sizeof path, "%s/bad.csv", dir);
        rc = dataset_open(&d, path, 0, 3, 4, 4, 0, 1, err);
        CHECK(rc == -1 && contains(err, "bad.csv: ") && contains(err, cases[k].want),
              "case %zu: '%s' should say '%s'", k, rc ? err : "accepted", cases[k].want);
        if (rc == 0) dataset_free(&d);
    }
    free(px);
    ds_remove(dir);
}

// Finding 8: a data set without one pixel (image) of a class whose weight is
// above 0 is refused when the data is checked, naming the set and the classes
// it holds; nothing is written.
TEST(dataset_without_weighted_label) {
    const char *data = "/tmp/segnet_test_unlabelled", *run = "/tmp/segnet_test_unlabelled_run";
    rm_rf(data); rm_rf(run);
    write_seg_set(data, 4, 8, 8, 31);
    char val[300], path[1400], err[SN_ERR_MAX];
    snprintf(val, sizeof val, "%s/val", data);
    snprintf(path, sizeof path,
             "mkdir -p '%s/images' '%s/masks' && cp %s/images/i00.png %s/images/", val, val, data,
             val);
    CHECK(system(path) == 0, "%s", path);
    uint8_t zeros[64] = {0};
    snprintf(path, sizeof path, "%s/masks/i00.png", val);
    CHECK(stbi_write_png(path, 8, 8, 1, zeros, 8) != 0, "write %s", path);
    TrainCfg c = tiny_seg_cfg(data, val);  // class weights 0,1,1
    c.out = run;
    CHECK(train_run(&c, NULL, err) == -1 && contains(err, val) &&
                  contains(err, "not one pixel of a class whose weight is above 0") &&
                  contains(err, "only class 0 (weight 0)"),
          "an unlabelled validation set: '%s'", err);
    CHECK(!file_exists(run), "the refused run left %s", run);
    c.data = val; c.val = NULL;
    CHECK(train_run(&c, NULL, err) == -1 && contains(err, "not one pixel"),
          "an unlabelled training set: '%s'", err);
    c.class_weights[0] = 1.0f;  // with class 0 weighed, the same set trains
    c.epochs = 1;
    CHECK(train_run(&c, NULL, err) == 0, "class 0 weighed: %s", err);
    // a classifier whose only labels have weight 0
    char csv[400];
    snprintf(csv, sizeof csv, "%s/list.csv", data);
    write_file_bytes(csv, "images/i00.png,2\nimages/i01.png,2\n", 34);
    TrainCfg k = c;
    k.model = model_cfg_default();
    k.model.model = "effv2-t";
    k.model.classes = 3;
    k.model.height = k.model.width = 32;
    k.model.batch = 2;
    k.class_weights[0] = 1; k.class_weights[1] = 1; k.class_weights[2] = 0;
    k.data = csv; k.val = NULL;
    k.out = "/tmp/segnet_test_unlabelled_cls";
    CHECK(train_run(&k, NULL, err) == -1 && contains(err, "not one image") &&
                  contains(err, "only class 2 (weight 0)"),
          "a classifier: '%s'", err);
    rm_rf(data); rm_rf(run); rm_rf(k.out);
}

// ---- EXIF orientation (issue 31, finding 14): the tag read strictly, the
// eight orientations applied with --exif apply, size mismatches naming it

static void tiff_put16(uint8_t *p, uint32_t v, int big) {
    p[big ? 0 : 1] = (uint8_t)(v >> 8);
    p[big ? 1 : 0] = (uint8_t)v;
}
static void tiff_put32(uint8_t *p, uint32_t v, int big) {
    tiff_put16(p + (big ? 0 : 2), v >> 16, big);
    tiff_put16(p + (big ? 2 : 0), v & 0xffff, big);
}

// An APP1 segment, marker to end (EXIF_APP1_LEN bytes): "Exif\0\0", then a
// TIFF header in byte order MM (big) or II whose IFD0 (at offset 8) has two
// entries, Make = "ab" (ASCII, 3 bytes inline) and Orientation = o (SHORT,
// count 1), and no next IFD. Where its fields are, from the marker:
#define EXIF_APP1_LEN   48  // 2 marker + 2 length + 6 "Exif\0\0" + 38 TIFF
#define EXIF_AT_TIFF    10  // byte order; 12: 42; 14: IFD0's offset
#define EXIF_AT_COUNT   18  // IFD0's entry count
#define EXIF_AT_ORIENT  32  // the Orientation entry: tag; 34 type; 36 count; 40 value
static void exif_app1(uint8_t s[EXIF_APP1_LEN], int o, int big) {
    memset(s, 0, EXIF_APP1_LEN);
    s[0] = 0xff; s[1] = 0xe1;
    s[2] = 0; s[3] = EXIF_APP1_LEN - 2;  // JPEG lengths are big-endian whatever the TIFF's order
    memcpy(s + 4, "Exif\0\0", 6);
    uint8_t *t = s + EXIF_AT_TIFF;
    memcpy(t, big ? "MM" : "II", 2);
    tiff_put16(t + 2, 42, big);
    tiff_put32(t + 4, 8, big);
    tiff_put16(t + 8, 2, big);
    tiff_put16(t + 10, 0x010f, big);
    tiff_put16(t + 12, 2, big);
    tiff_put32(t + 14, 3, big);
    memcpy(t + 18, "ab", 3);
    tiff_put16(t + 22, 0x0112, big);
    tiff_put16(t + 24, 3, big);
    tiff_put32(t + 26, 1, big);
    tiff_put16(t + 30, (uint32_t)o, big);
}

// The head of a JPEG as a phone writes it: SOI, APP0 (JFIF), the APP1 above,
// then the start of a scan. Returns its length; the APP1 ends at EXIF_HEAD_APP1_END.
#define EXIF_HEAD_APP1_AT  20
#define EXIF_HEAD_APP1_END (EXIF_HEAD_APP1_AT + EXIF_APP1_LEN)
static size_t exif_jpeg_head(uint8_t *b, int o, int big) {
    static const uint8_t SOI_APP0[EXIF_HEAD_APP1_AT] = {
            0xff, 0xd8, 0xff, 0xe0, 0, 16, 'J', 'F', 'I', 'F', 0, 1, 1, 0, 0, 1, 0, 1, 0, 0};
    memcpy(b, SOI_APP0, sizeof SOI_APP0);
    exif_app1(b + EXIF_HEAD_APP1_AT, o, big);
    memcpy(b + EXIF_HEAD_APP1_END, "\xff\xda\x00\x02", 4);
    return EXIF_HEAD_APP1_END + 4;
}

// n bytes at the end of a readable page that an unreadable one follows: a
// read past the end faults. guarded_free unmaps it.
static const uint8_t *guarded_copy(const uint8_t *src, size_t n) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    snCheck(n <= page, "guarded_copy: %zu bytes", n);
    uint8_t *map = mmap(NULL, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    snCheck(map != MAP_FAILED && mprotect(map + page, page, PROT_NONE) == 0, "guarded_copy: mmap");
    if (n) memcpy(map + page - n, src, n);
    return map + page - n;
}
static void guarded_free(const uint8_t *b, size_t n) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    munmap((uint8_t *)b + n - page, 2 * page);
}
// exif_orientation on a guarded copy of b[0..n); -1 when it read past the end
// (the fault caught, so that the test fails instead of the run)
static sigjmp_buf g_guard_jump;
static void guard_fault(int sig) { (void)sig; siglongjmp(g_guard_jump, 1); }
static int exif_orientation_guarded(const uint8_t *b, size_t n) {
    const uint8_t *g = guarded_copy(b, n);
    struct sigaction sa, old;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = guard_fault;
    sigaction(SIGSEGV, &sa, &old);
    volatile int o = -1;
    if (!sigsetjmp(g_guard_jump, 1)) o = exif_orientation(g, n);
    sigaction(SIGSEGV, &old, NULL);
    guarded_free(g, n);
    return o;
}

TEST(exif_orientation_reader) {
    uint8_t b[256], v[256];
    // (a result of -1: the reader read past the end of its bytes)
    // every orientation in both byte orders; every shorter prefix (a file cut
    // short) gives 1 until the whole APP1 segment is there
    for (int big = 0; big < 2; big++)
        for (int o = 1; o <= 8; o++) {
            const size_t n = exif_jpeg_head(b, o, big);
            for (size_t k = 0; k <= n; k++) {
                const int want = k >= EXIF_HEAD_APP1_END ? o : 1,
                          got = exif_orientation_guarded(b, k);
                CHECK(got == want, "%s, orientation %d, first %zu of %zu bytes: %d, want %d",
                      big ? "MM" : "II", o, k, n, got, want);
            }
        }
    // malformed: each gives 1, read whole and cut at the APP1 segment's end
    // (a guarded page after each: a read past the end faults)
    const size_t n = exif_jpeg_head(b, 6, 1);
    const uint8_t *t = b + EXIF_HEAD_APP1_AT + EXIF_AT_TIFF;
    const size_t T = t - b, C = T + (EXIF_AT_COUNT - EXIF_AT_TIFF),
                 O = T + (EXIF_AT_ORIENT - EXIF_AT_TIFF);
    struct { const char *what; size_t at; const char *bytes; size_t len; } bad[] = {
        {"byte order IM", T, "IM", 2},
        {"II with a big-endian 42", T, "II\x00\x2a", 4},
        {"not 42", T + 2, "\x00\x2b", 2},
        {"IFD0 at 0xfffffff0", T + 4, "\xff\xff\xff\xf0", 4},
        {"IFD0 at the TIFF's last byte", T + 4, "\x00\x00\x00\x25", 4},
        {"IFD0 where only its count fits", T + 4, "\x00\x00\x00\x24", 4},
        {"IFD0 inside the header", T + 4, "\x00\x00\x00\x04", 4},
        {"65535 entries", C, "\xff\xff", 2},
        {"3 entries where 2 fit", C, "\x00\x03", 2},
        {"Orientation a LONG", O + 2, "\x00\x04", 2},
        {"Orientation of count 2", O + 4, "\x00\x00\x00\x02", 4},
        {"Orientation 0", O + 8, "\x00\x00", 2},
        {"Orientation 9", O + 8, "\x00\x09", 2},
        {"no Orientation tag", O, "\x01\x13", 2},
        {"APP1 of length 1", EXIF_HEAD_APP1_AT + 2, "\x00\x01", 2},
        {"APP1 longer than the file", EXIF_HEAD_APP1_AT + 2, "\xff\xff", 2},
        {"Exif\\0X", EXIF_HEAD_APP1_AT + 9, "X", 1},
        {"no marker after APP0", EXIF_HEAD_APP1_AT, "\x00", 1},
        {"a scan before the APP1", EXIF_HEAD_APP1_AT + 1, "\xda", 1},
        {"not a JPEG", 0, "\x89PNG", 4},
    };
    for (size_t k = 0; k < sizeof bad / sizeof *bad; k++) {
        memcpy(v, b, n);
        memcpy(v + bad[k].at, bad[k].bytes, bad[k].len);
        CHECK(exif_orientation_guarded(v, n) == 1, "%s: orientation %d", bad[k].what,
              exif_orientation_guarded(v, n));
        CHECK(exif_orientation_guarded(v, EXIF_HEAD_APP1_END) == 1, "%s, cut after the APP1: not 1",
              bad[k].what);
    }
    // a TIFF shorter than its IFD: the segment's length says 30 of its 38 bytes
    memcpy(v, b, n);
    v[EXIF_HEAD_APP1_AT + 3] -= 8;
    CHECK(exif_orientation_guarded(v, EXIF_HEAD_APP1_END - 8) == 1,
          "an IFD past the segment's end");
    CHECK(exif_orientation_guarded(b, 0) == 1 && exif_orientation_guarded(b, 1) == 1,
          "0 or 1 bytes");
    // found past another APP1 (XMP) and fill bytes
    static const uint8_t XMP[] = {0xff, 0xe1, 0,   12,  'h', 't', 't',
                                  'p',  ':',  '/', '/', 'n', 's', '.'};
    size_t m = 0;
    memcpy(v, b, EXIF_HEAD_APP1_AT); m = EXIF_HEAD_APP1_AT;
    memcpy(v + m, XMP, sizeof XMP); m += sizeof XMP;
    v[m++] = 0xff; v[m++] = 0xff;  // fill bytes before the next marker
    memcpy(v + m, b + EXIF_HEAD_APP1_AT, EXIF_APP1_LEN); m += EXIF_APP1_LEN;
    CHECK(exif_orientation_guarded(v, m) == 6, "after an XMP APP1 and fill bytes: %d",
          exif_orientation_guarded(v, m));
}

// A JPEG of stored size w×h written by stb_image_write (quality 100: every
// quantiser 1, no chroma subsampling), with exif_app1(o, big) spliced in after
// its SOI marker (o 0: none).
typedef struct { uint8_t *p; size_t n, cap; } TestBytes;
static void test_bytes_put(void *ctx, void *data, int size) {
    TestBytes *b = ctx;
    if (b->n + (size_t)size > b->cap) {
        b->cap = 2 * (b->n + (size_t)size);
        b->p = realloc(b->p, b->cap);
        snCheck(b->p != NULL, "out of host memory");
    }
    memcpy(b->p + b->n, data, (size_t)size);
    b->n += (size_t)size;
}
static void jpeg_with_exif(const char *path, int w, int h, const uint8_t *rgb, int o, int big) {
    TestBytes jpg = {0};
    CHECK(stbi_write_jpg_to_func(test_bytes_put, &jpg, w, h, 3, rgb, 100) != 0, "encoding %s",
          path);
    uint8_t app1[EXIF_APP1_LEN];
    exif_app1(app1, o, big);
    TestBytes out = {0};
    test_bytes_put(&out, jpg.p, 2);
    if (o) test_bytes_put(&out, app1, EXIF_APP1_LEN);
    test_bytes_put(&out, jpg.p + 2, (int)jpg.n - 2);
    CHECK(write_file_bytes(path, out.p, out.n) == 0, "writing %s", path);
    free(jpg.p);
    free(out.p);
}

// The EXIF table: "the 0th row is the visual <row side>, the 0th column the
// visual <column side>" (Top, Bottom, Left, Right) for orientations 1..8.
static const char EXIF_SIDES[9][3] = {"", "TL", "TR", "BR", "BL", "LT", "RT", "RB", "LB"};
// Where stored pixel (sy,sx) of an h×w image is displayed: stored rows run away
// from the row side, stored columns away from the column side.
static void exif_displayed_at(int o, int h, int w, int sy, int sx, int *dy, int *dx) {
    const int H = o >= 5 ? w : h, W = o >= 5 ? h : w;
    for (int i = 0; i < 2; i++) {
        const int k = i ? sx : sy;
        switch (EXIF_SIDES[o][i]) {
        case 'T': *dy = k; break;
        case 'B': *dy = H - 1 - k; break;
        case 'L': *dx = k; break;
        case 'R': *dx = W - 1 - k; break;
        }
    }
}

// Images of 8×8 blocks of flat colour, block k's colour below (R 40 apart).
// A flat block at quality 100 (quantisers 1, no subsampling) keeps only its
// DC term, so it comes back within the rounding of its Y, Cb, Cr to integers
// (±0.5 each): B = Y + 1.772·(Cb − 128) moves by at most 0.5 + 1.772·0.5 =
// 1.39 (R, G less), and the decoder rounds once more (±0.5): under 2; 3
// leaves a margin for the decoder's fixed point. Blocks differ by 25 or more.
#define EXIF_BLOCK 8
#define EXIF_TOL 3
static void exif_block_colour(int k, uint8_t c[3]) {
    c[0] = (uint8_t)(20 + 40 * k);
    c[1] = (uint8_t)(230 - 40 * k);
    c[2] = (uint8_t)(90 + 25 * k);
}
static uint8_t *exif_blocks(int h, int w) {
    uint8_t *px = malloc((size_t)h * w * 3);
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++)
            exif_block_colour(y / EXIF_BLOCK * (w / EXIF_BLOCK) + x / EXIF_BLOCK,
                              px + 3 * ((size_t)y * w + x));
    return px;
}

// --exif apply: each orientation's pixels are the stored ones where the
// EXIF table displays them; --exif ignore: as stored.
TEST(exif_apply_pixels) {
    char dir[300], path[400], err[SN_ERR_MAX] = "";
    ds_fixture(dir, sizeof dir, "exif_pixels", NULL, 0);
    snprintf(path, sizeof path, "%s/photo.jpg", dir);
    enum { h = 16, w = 24 };  // 2×3 blocks: a 90° turn, a mirror, a transpose each differ
    uint8_t *px = exif_blocks(h, w);
    for (int o = 1; o <= 8; o++)
        for (int apply = 0; apply < 2; apply++) {
            jpeg_with_exif(path, w, h, px, o, o % 2);
            image_exif = apply ? EXIF_APPLY : EXIF_IGNORE;
            int H = 0, W = 0, orientation = 0;
            uint8_t *img = image_load_oriented(path, &H, &W, &orientation, err);
            image_exif = EXIF_IGNORE;
            const int turned = apply && o >= 5;
            CHECK(img && orientation == o && H == (turned ? w : h) && W == (turned ? h : w),
                  "orientation %d, %s: %dx%d, orientation %d (%s)", o, apply ? "apply" : "ignore",
                  W, H, orientation, img ? "" : err);
            if (!img || H != (turned ? w : h)) { free(img); continue; }
            double worst = 0;
            int wrong = 0;
            for (int sy = 0; sy < h; sy++)
                for (int sx = 0; sx < w; sx++) {
                    int dy = sy, dx = sx;
                    if (apply) exif_displayed_at(o, h, w, sy, sx, &dy, &dx);
                    for (int c = 0; c < 3; c++) {
                        const double e = fabs((double)img[3 * ((size_t)dy * W + dx) + c] -
                                              px[3 * ((size_t)sy * w + sx) + c]);
                        worst = e > worst ? e : worst;
                        wrong += e > EXIF_TOL;
                    }
                }
            CHECK(!wrong, "orientation %d, %s: %d values off by more than %d (worst %g)", o,
                  apply ? "apply" : "ignore", wrong, EXIF_TOL, worst);
            free(img);
        }
    free(px);
    ds_remove(dir);
}

// A mask drawn on the displayed photo: with --exif ignore its size mismatch
// names the orientation; with apply it lines up (class k where block k's
// colour is), and a mask of the stored view's size says the orientation was applied.
TEST(exif_mask_mismatch) {
    char dir[300], path[400], err[SN_ERR_MAX] = "";
    ds_fixture(dir, sizeof dir, "exif_masks", SEG_SUBS, 2);
    enum { h = 16, w = 24, K = 6 };
    uint8_t *px = exif_blocks(h, w), mask[h * w];
    snprintf(path, sizeof path, "%s/images/a.jpg", dir);
    jpeg_with_exif(path, w, h, px, 6, 1);
    for (int sy = 0; sy < h; sy++)  // orientation 6 displays w×h as h×w (16 wide, 24 high)
        for (int sx = 0; sx < w; sx++) {
            int dy, dx;
            exif_displayed_at(6, h, w, sy, sx, &dy, &dx);
            mask[dy * h + dx] = (uint8_t)(sy / EXIF_BLOCK * (w / EXIF_BLOCK) + sx / EXIF_BLOCK);
        }
    ds_png(dir, "masks/a.png", h, w, 1, mask);
    Dataset d;
    CHECK(dataset_open(&d, dir, 1, K, w, h, 1 << 20, 1, err) == -1 &&
                  contains(err,
                           "masks/a.png: mask is 16x24 but its image is 24x16 (the image's EXIF "
                           "orientation is 6, rotated 90° "
                           "clockwise when displayed; --exif apply reads images as displayed)") &&
                  !strchr(err, '\n'),
          "ignore: '%s'", err);
    image_exif = EXIF_APPLY;
    float x[h * w * 3];
    int32_t y[h * w];
    const int idx = 0;
    int rc = dataset_open(&d, dir, 1, K, w, h, 1 << 20, 1, err);
    CHECK(rc == 0 && dataset_batch(&d, &idx, 1, NULL, 0, x, y, err) == 0, "apply: %s", err);
    int misaligned = 0;
    for (int p = 0; rc == 0 && p < h * w; p++) {
        uint8_t c[3];
        exif_block_colour(y[p], c);
        misaligned += y[p] != mask[p] || fabsf(x[3 * p] - c[0]) > EXIF_TOL ||
                      fabsf(x[3 * p + 1] - c[1]) > EXIF_TOL ||
                      fabsf(x[3 * p + 2] - c[2]) > EXIF_TOL;
    }
    CHECK(!misaligned, "apply: %d pixels whose colour is not their class's block", misaligned);
    if (rc == 0) dataset_free(&d);
    uint8_t stored_view[h * w] = {0};
    ds_png(dir, "masks/a.png", w, h, 1, stored_view);
    CHECK(dataset_open(&d, dir, 1, K, w, h, 1 << 20, 1, err) == -1 &&
                  contains(err,
                           "masks/a.png: mask is 24x16 but its image is 16x24 (the image's EXIF "
                           "orientation 6 was applied: it "
                           "is read rotated 90° clockwise; --exif ignore reads images as stored)"),
          "apply, stored-view mask: '%s'", err);
    image_exif = EXIF_IGNORE;
    jpeg_with_exif(path, w, h, px, 0, 0);  // no EXIF: the message says nothing of it
    ds_png(dir, "masks/a.png", h, w, 1, mask);
    CHECK(dataset_open(&d, dir, 1, K, w, h, 1 << 20, 1, err) == -1 &&
                  contains(err, "its image is 24x16") && !contains(err, "EXIF"),
          "no orientation: '%s'", err);
    jpeg_with_exif(path, w, h, px, 1, 0);  // orientation 1: neither
    CHECK(dataset_open(&d, dir, 1, K, w, h, 1 << 20, 1, err) == -1 &&
                  contains(err, "its image is 24x16") && !contains(err, "EXIF"),
          "orientation 1: '%s'", err);
    free(px);
    ds_remove(dir);
}

// The command line: --exif apply for train, recorded in config.txt and so
// used by --resume, eval --run and predict --run (whose masks are then of the
// displayed image); --exif ignore on top of the run's; a bad value; --help.
TEST(exif_cli) {
    const char *data = "/tmp/segnet_test_exif_data", *run = "/tmp/segnet_test_exif_run";
    const char *o1 = "/tmp/segnet_test_exif_o1", *o2 = "/tmp/segnet_test_exif_o2";
    rm_rf(data); rm_rf(run); rm_rf(o1); rm_rf(o2);
    const char *const subs[] = {"images", "masks"};
    char path[600], args[2048], msg[4096];
    CHECK(mkdir(data, 0755) == 0, "mkdir %s", data);
    for (int k = 0; k < 2; k++) {
        snprintf(path, sizeof path, "%s/%s", data, subs[k]);
        CHECK(mkdir(path, 0755) == 0, "mkdir %s", path);
    }
    enum { h = 8, w = 16 };  // stored 16 wide, 8 high; orientation 6 displays it 8 wide, 16 high
    uint8_t *px = exif_blocks(h, w), mask[h * w];
    // displayed: block 0 on top, 1 below
    for (int p = 0; p < h * w; p++) mask[p] = (uint8_t)(p >= h * w / 2);
    for (int i = 0; i < 4; i++) {
        snprintf(path, sizeof path, "%s/images/i%02d.jpg", data, i);
        jpeg_with_exif(path, w, h, px, 6, i % 2);
        snprintf(path, sizeof path, "masks/i%02d.png", i);
        ds_png(data, path, h, w, 1, mask);
    }
    const char *base = "--model unet --depth 1 --width 2 --size 8x8 --batch 2 --classes 2 --device "
                       "cpu --threads 1";
    snprintf(args, sizeof args, "train %s --epochs 1 --data %s --out %s/default", base, data, run);
    CHECK(run_segnet(args, msg, sizeof msg) == 1 && contains(msg, "EXIF orientation is 6") &&
                  contains(msg, "--exif apply"),
          "train without --exif: %s", msg);
    snprintf(args, sizeof args, "train %s --epochs 1 --data %s --out %s/bad --exif sideways", base,
             data, run);
    CHECK(run_segnet(args, msg, sizeof msg) == 2 &&
                  contains(msg, "--exif 'sideways' must be ignore or apply"),
          "%s", msg);
    snprintf(args, sizeof args, "train %s --epochs 1 --data %s --out %s --exif apply", base, data,
             run);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "train --exif apply: %s", msg);
    snprintf(path, sizeof path, "%s/config.txt", run);
    char *cfg = read_text(path);
    CHECK(cfg && contains(cfg, "\nexif = apply\n"), "config.txt: %s", cfg ? cfg : "(none)");
    free(cfg);
    snprintf(args, sizeof args, "train --resume %s --epochs 2", run);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "--resume: %s", msg);
    snprintf(args, sizeof args, "eval --run %s --data %s --device cpu --threads 1", run, data);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "eval --run: %s", msg);
    snprintf(args, sizeof args, "eval --run %s --data %s --device cpu --threads 1 --exif ignore",
             run, data);
    CHECK(run_segnet(args, msg, sizeof msg) == 1 && contains(msg, "EXIF orientation is 6"),
          "eval --run --exif ignore: %s", msg);
    for (int ignore = 0; ignore < 2; ignore++) {
        snprintf(args, sizeof args,
                 "predict --run %s --input %s/images --out %s --device cpu --threads 1%s", run,
                 data, ignore ? o2 : o1, ignore ? " --exif ignore" : "");
        CHECK(run_segnet(args, msg, sizeof msg) == 0, "predict --run%s: %s",
              ignore ? " --exif ignore" : "", msg);
        for (int f = 0; f < 2; f++) {
            int pw = 0, ph = 0, pc;
            snprintf(path, sizeof path, "%s/i00%s.png", ignore ? o2 : o1, f ? "_overlay" : "");
            CHECK(stbi_info(path, &pw, &ph, &pc) && pw == (ignore ? w : h) &&
                          ph == (ignore ? h : w),
                  "%s: %dx%d, want %dx%d", path, pw, ph, ignore ? w : h, ignore ? h : w);
        }
    }
    const char *cmds[] = {"train", "eval", "predict"};
    for (int k = 0; k < 3; k++) {
        snprintf(args, sizeof args, "%s --help", cmds[k]);
        CHECK(run_segnet(args, msg, sizeof msg) == 0, "%s --help", cmds[k]);
        char *out = read_text("/tmp/segnet_test_out.txt");
        CHECK(out && contains(out, "--exif MODE"), "%s --help does not mention --exif", cmds[k]);
        free(out);
    }
    free(px);
    rm_rf(data); rm_rf(run); rm_rf(o1); rm_rf(o2);
}

// ----------------------------------------------------------------------------
// the training run end to end on tiny data sets written here

// The epoch's loss and mIoU from the trainer equal Σ w·nll / Σ w (or / pixels)
// and the IoU computed here from the logits of the same forward pass.
TEST(train_loss_by_hand) {
    const char *dir = "/tmp/segnet_test_lossdata";
    rm_rf(dir);
    write_seg_set(dir, 4, 8, 8, 1);
    for (int keras = 0; keras < 2; keras++) {
        TrainCfg c = tiny_seg_cfg(dir, NULL);
        c.lr = 0.0f;  // the weights stay those of the forward computed below
        c.loss_norm_keras = keras;
        Trainer t;
        char err[SN_ERR_MAX];
        CHECK(trainer_open(&t, &c, dir, NULL, err) == 0, "%s", err);
        if (!t.has_train) { trainer_close(&t); break; }
        int64_t cm[9];
        PassTotals pt = {.cm = cm};
        CHECK(run_pass(&t, &t.train, 1, &pt, err) == 0, "%s", err);
        // the same forward here: one batch holds all 4 images (BN sees them all)
        int idx[4] = {0, 1, 2, 3};
        float *x = t.net.act[t.g.input];
        int32_t lab[4 * 64];
        CHECK(dataset_batch(&t.train, idx, 4, NULL, 0, x, lab, err) == 0, "%s", err);
        net_forward(&t.net, net_capacity(&t.net), 1);
        const float *z = t.net.act[t.logits];
        double num = 0, den = 0;
        int64_t tp[3] = {0}, fp[3] = {0}, fn[3] = {0};
        for (int i = 0; i < 4 * 64; i++) {
            double zmax = fmax(fmax(z[i * 3], z[i * 3 + 1]), z[i * 3 + 2]), s = 0;
            for (int k = 0; k < 3; k++) s += exp(z[i * 3 + k] - zmax);
            double wy = c.class_weights[lab[i]];
            num += wy * (log(s) + zmax - z[i * 3 + lab[i]]);
            den += keras ? 1.0 : wy;
            int p = z[i * 3 + 1] > z[i * 3] ? 1 : 0;
            if (z[i * 3 + 2] > z[i * 3 + p]) p = 2;
            if (wy == 0) continue;
            if (p == lab[i]) tp[p]++; else { fp[p]++; fn[lab[i]]++; }
        }
        double loss = pt.loss_sum / pt.norm_sum;
        CHECK(fabs(loss - num / den) <= 1e-5 * fabs(num / den), "%s loss %.9g, by hand %.9g",
              keras ? "keras" : "weighted", loss, num / den);
        double iou[3];
        Metrics m = {.iou = iou};
        metrics_compute(cm, 3, c.class_weights, &m);
        double miou = 0;
        for (int k = 1; k < 3; k++) miou += (double)tp[k] / (tp[k] + fp[k] + fn[k]) / 2;
        CHECK_NEAR(m.mean_iou, miou, 1e-12, "mIoU from the training pass");
        trainer_close(&t);
    }
    rm_rf(dir);
}

// The trainer's loss menu, ce + 0.3·focal + 0.5·dice with class weights (0, 1, 1),
// over the batch and per image (there with --iou-per-image, its mIoU by hand within
// 1e-9: 2^-32 a fixed-point image): the pass's loss (lr 0, one batch of the 4 images)
// and the logits' gradient score_batch writes, against the formulas written
// out here (softmax_f64, sm_focal's and region_loss_f64's) summed with the same
// weights: the loss within 1e-5 relative (the pass's fp32 sums, as
// train_loss_by_hand), the gradient within 1e-5 of its largest element of central
// differences of that sum (as loss_region_by_hand).
static double menu_loss_f64(const float *z, const int32_t *y, int M, const float *w, int per_image,
                            int images) {
    enum { K = 3 };
    double ce = 0.0, focal = 0.0, norm = 0.0, p[K];
    for (int i = 0; i < M; i++) {
        softmax_f64(z + i * K, K, p);
        const double wy = w[y[i]], pr = fmin(fmax(p[y[i]], 1e-7), 1.0 - 1e-7);
        ce += wy * -log(p[y[i]]);
        focal += wy * 0.25 * pow(1.0 - pr, 2.0) * -log(pr) / K;
        norm += wy;
    }
    double dice = 0.0;
    const int groups = per_image ? images : 1, per = M / groups;
    for (int g = 0; g < groups; g++)
        dice += region_loss_f64(z + g * per * K, y + g * per, per, K, LOSS_DICE, 1e-5, w, 1, 1, 1);
    return ce / norm + 0.3 * focal / norm + 0.5 * dice / groups;
}
TEST(train_loss_menu_by_hand) {
    const char *dir = "/tmp/segnet_test_menudata";
    rm_rf(dir);
    write_seg_set(dir, 4, 8, 8, 1);
    for (int per_image = 0; per_image < 2; per_image++) {
        TrainCfg c = tiny_seg_cfg(dir, NULL);
        c.lr = 0.0f;
        c.loss.n = 3;
        c.loss.kind[0] = LOSS_CE;
        c.loss.weight[0] = 1.0f;
        c.loss.kind[1] = LOSS_FOCAL;
        c.loss.weight[1] = 0.3f;
        c.loss.kind[2] = LOSS_DICE;
        c.loss.weight[2] = 0.5f;
        c.loss.per_image = per_image;
        c.iou_per_image = per_image;
        Trainer t;
        char err[SN_ERR_MAX];
        CHECK(trainer_open(&t, &c, dir, NULL, err) == 0, "%s", err);
        if (!t.has_train) {
            trainer_close(&t);
            break;
        }
        int64_t cm[9 + 2];
        PassTotals pt = {.cm = cm};
        CHECK(run_pass(&t, &t.train, 1, &pt, err) == 0, "%s", err);
        int idx[4] = {0, 1, 2, 3};
        int32_t lab[4 * 64];
        CHECK(dataset_batch(&t.train, idx, 4, NULL, 0, t.net.act[t.g.input], lab, err) == 0, "%s",
              err);
        net_forward(&t.net, net_capacity(&t.net), 1);
        float *z = t.net.act[t.logits];
        const double want = menu_loss_f64(z, lab, 4 * 64, c.class_weights, per_image, 4);
        const double loss = pt.loss_sum / pt.norm_sum;
        CHECK(fabs(loss - want) <= 1e-5 * want, "per_image %d: loss %.9g, by hand %.9g", per_image,
              loss, want);
        if (per_image) {  // --iou-per-image: each image's mean IoU over classes 1, 2, averaged
            double miou = 0.0;
            for (int n = 0; n < 4; n++) {
                int64_t tp[3] = {0}, fp[3] = {0}, fn[3] = {0};
                for (int i = n * 64; i < (n + 1) * 64; i++) {
                    int p = z[i * 3 + 1] > z[i * 3] ? 1 : 0;
                    if (z[i * 3 + 2] > z[i * 3 + p]) p = 2;
                    if (lab[i] == 0) continue;  // weight 0
                    if (p == lab[i]) tp[p]++; else { fp[p]++; fn[lab[i]]++; }
                }
                for (int k = 1; k < 3; k++)
                    miou += (tp[k] + 1e-5) / (tp[k] + fp[k] + fn[k] + 1e-5) / 2 / 4;
            }
            double iou[3];
            Metrics m = {.iou = iou};
            pass_metrics(&t, cm, &m);
            CHECK(fabs(m.mean_iou - miou) <= 1e-9, "per-image mIoU %.12g, by hand %.12g",
                  m.mean_iou, miou);
        }
        // the gradient score_batch writes for these logits (loss scale 1)
        memcpy(t.labels, lab, sizeof lab);
        memset(t.state, 0, sizeof *t.state);
        t.state->loss_scale = 1.0f;
        t.state->xent_scale = (float)(1.0 / label_weight_sum(lab, 4 * 64, c.class_weights, 3));
        Tensor dz = net_grad(&t.net, t.logits);
        CHECK(score_batch(&t, dz, 4, 4) == 0, "score_batch");
        double worst = 0.0, largest = 0.0;
        for (int i = 0; i < 4 * 64 * 3; i++) {
            const float keep = z[i], zp = keep + 1e-3f, zm = keep - 1e-3f;
            z[i] = zp;
            const double up = menu_loss_f64(z, lab, 4 * 64, c.class_weights, per_image, 4);
            z[i] = zm;
            const double down = menu_loss_f64(z, lab, 4 * 64, c.class_weights, per_image, 4);
            z[i] = keep;
            const double fd = (up - down) / ((double)zp - zm);
            largest = fmax(largest, fabs(fd));
            worst = fmax(worst, fabs(fd - ((float *)dz.data)[i]));
        }
        if (g_verbose)
            printf("    per_image %d: loss %.6f (by hand %.6f), gradient error %.2e\n", per_image,
                   loss, want, worst / largest);
        CHECK(worst <= 1e-5 * largest, "per_image %d: gradient error %.3g of %.3g", per_image,
              worst, largest);
        trainer_close(&t);
    }
    rm_rf(dir);
}

// n images h×w, image i: red = 30·i + x (so images are told apart by the red
// value at x = 0, and a flip shows), green and blue 0; every mask pixel class 1
static void write_id_set(const char *dir, int n, int h, int w) {
    char path[512];
    snprintf(path, sizeof path, "mkdir -p '%s/images' '%s/masks'", dir, dir);
    CHECK(system(path) == 0, "mkdir %s", dir);
    uint8_t *img = calloc((size_t)h * w * 3, 1), *mask = malloc((size_t)h * w);
    memset(mask, 1, (size_t)h * w);
    for (int i = 0; i < n; i++) {
        for (int p = 0; p < h * w; p++) img[3 * p] = (uint8_t)(30 * i + p % w);
        snprintf(path, sizeof path, "%s/images/i%02d.png", dir, i);
        CHECK(stbi_write_png(path, w, h, 3, img, w * 3), "write %s", path);
        snprintf(path, sizeof path, "%s/masks/i%02d.png", dir, i);
        CHECK(stbi_write_png(path, w, h, 1, mask, w), "write %s", path);
    }
    free(img); free(mask);
}

// Every epoch has its own order and its own augmentations. The input after
// run_pass holds the epoch's last batch: over 6 epochs it is not always the
// same 4 of 8 images, and one image under flip + brightness is not augmented
// the same way in every epoch (while a validation pass never augments it).
// The trainer's net with one allocation per tensor instead of the arena, so
// that the input stays readable after a pass (in the arena its place is reused)
static void use_per_tensor_net(Trainer *t) {
    char err[SN_ERR_MAX];
    net_free(&t->net);
    CHECK(net_create(&t->net, &t->g, t->o, t->c->precision, 0, err) == 0, "%s", err);
    net_init_params(&t->net, t->c->seed);
    t->net.seed = t->c->seed;
}

TEST(train_epochs_reshuffle) {
    const char *dir = "/tmp/segnet_test_reshuffle", *one = "/tmp/segnet_test_reshuffle_one";
    rm_rf(dir); rm_rf(one);
    write_id_set(dir, 8, 8, 8);
    write_id_set(one, 1, 8, 8);
    TrainCfg c = tiny_seg_cfg(dir, NULL);
    c.lr = 0.0f;
    c.class_weights[0] = 1.0f;
    Trainer t;
    char err[SN_ERR_MAX];
    CHECK(trainer_open(&t, &c, dir, NULL, err) == 0, "%s", err);
    if (!t.has_train) { trainer_close(&t); rm_rf(dir); rm_rf(one); return; }
    use_per_tensor_net(&t);
    int sets[6], distinct = 0;
    for (int e = 0; e < 6; e++) {
        int64_t cm[9];
        PassTotals pt = {.cm = cm};
        t.epoch = e;
        CHECK(run_pass(&t, &t.train, 1, &pt, err) == 0, "%s", err);
        const float *x = t.net.act[t.g.input];
        sets[e] = 0;
        for (int j = 0; j < 4; j++) {
            int id = (int)lrintf(x[(size_t)j * 64 * 3] / 30.0f);  // red at pixel (0,0)
            CHECK(id >= 0 && id < 8 && x[(size_t)j * 64 * 3] == 30.0f * id,
                  "image %d of the last batch: red %g", j, x[(size_t)j * 64 * 3]);
            if (id >= 0 && id < 8) sets[e] |= 1 << id;
        }
        CHECK(__builtin_popcount((unsigned)sets[e]) == 4,
              "epoch %d: the last batch holds 4 different images (%#x)", e, sets[e]);
        int seen = 0;
        for (int f = 0; f < e; f++) seen |= sets[f] == sets[e];
        distinct += !seen;
    }
    CHECK(distinct >= 2,
          "the last batch is the same 4 images in all 6 epochs: the order is not drawn per epoch");
    trainer_close(&t);
    // one image, flip + brightness: 6 epochs, at least 3 different inputs
    c = tiny_seg_cfg(one, one);
    c.lr = 0.0f;
    c.class_weights[0] = 1.0f;
    c.augment = (Augment){.flip = 1, .brightness = 0.2f, .contrast_lo = 0, .contrast_hi = 0};
    CHECK(trainer_open(&t, &c, one, one, err) == 0, "%s", err);
    use_per_tensor_net(&t);
    float seen[6][64 * 3];
    int n_distinct = 0;
    for (int e = 0; e < 6; e++) {
        int64_t cm[9];
        PassTotals pt = {.cm = cm};
        t.epoch = e;
        CHECK(run_pass(&t, &t.train, 1, &pt, err) == 0, "%s", err);
        memcpy(seen[e], t.net.act[t.g.input], sizeof seen[e]);
        int dup = 0;
        for (int f = 0; f < e; f++) dup |= !memcmp(seen[f], seen[e], sizeof seen[e]);
        n_distinct += !dup;
    }
    CHECK(n_distinct >= 3, "%d different augmentations of one image in 6 epochs", n_distinct);
    int64_t cm[9];
    PassTotals pt = {.cm = cm};
    CHECK(run_pass(&t, &t.val, 0, &pt, err) == 0, "%s", err);
    const float *x = t.net.act[t.g.input];
    int bad = 0;
    for (int p = 0; p < 64; p++)
        bad += x[3 * p] != (float)(p % 8) || x[3 * p + 1] != 0 || x[3 * p + 2] != 0;
    CHECK(bad == 0, "the validation pass changed %d pixels of the image (%g %g %g %g)", bad, x[0],
          x[1], x[3], x[4]);
    trainer_close(&t);
    rm_rf(dir); rm_rf(one);
}

// 6 images in batches of 4: every image counts, once. The training pass's
// normaliser is Σ w[y] over all 6 masks and its confusion matrix counts all
// 6·64 pixels; the validation pass's loss is Σ w·nll / Σ w over both batches
// (not a mean of batch means) and its IoUs those of the logits computed here.
TEST(train_epoch_totals) {
    const char *dir = "/tmp/segnet_test_totals";
    rm_rf(dir);
    write_seg_set(dir, 6, 8, 8, 12);
    TrainCfg c = tiny_seg_cfg(dir, dir);
    c.lr = 0.0f;
    Trainer t;
    char err[SN_ERR_MAX];
    CHECK(trainer_open(&t, &c, dir, dir, err) == 0, "%s", err);
    if (!t.has_train) { trainer_close(&t); rm_rf(dir); return; }
    int idx[6] = {0, 1, 2, 3, 4, 5};
    float *img = malloc(sizeof(float) * 6 * 64 * 3);
    int32_t lab[6 * 64];
    CHECK(dataset_batch(&t.train, idx, 6, NULL, 0, img, lab, err) == 0, "%s", err);
    double wsum = 0;
    for (int i = 0; i < 6 * 64; i++) wsum += c.class_weights[lab[i]];
    int64_t cm[9];
    PassTotals pt = {.cm = cm};
    CHECK(run_pass(&t, &t.train, 1, &pt, err) == 0, "%s", err);
    int64_t total = 0;
    for (int k = 0; k < 9; k++) total += cm[k];
    CHECK(pt.norm_sum == wsum, "training normaliser %g, Σ w[y] over the 6 masks %g", pt.norm_sum,
          wsum);
    CHECK(total == 6 * 64, "the training confusion matrix counts %" PRId64 " pixels of %d", total,
          6 * 64);
    // the validation pass, by hand: BN in inference mode, so images are independent
    CHECK(run_pass(&t, &t.val, 0, &pt, err) == 0, "%s", err);
    double num = 0, den = 0, batch_means = 0;
    int64_t tp[3] = {0}, fp[3] = {0}, fn[3] = {0};
    for (int b = 0; b < 2; b++) {
        const int first = 4 * b, n = b ? 2 : 4;
        memcpy(t.net.act[t.g.input], img + (size_t)first * 64 * 3, sizeof(float) * n * 64 * 3);
        net_forward(&t.net, n, 0);
        const float *z = t.net.act[t.logits];
        double bn = 0, bd = 0;
        for (int i = 0; i < n * 64; i++) {
            const int y = lab[first * 64 + i];
            double zmax = fmax(fmax(z[i * 3], z[i * 3 + 1]), z[i * 3 + 2]), s = 0;
            for (int k = 0; k < 3; k++) s += exp(z[i * 3 + k] - zmax);
            double wy = c.class_weights[y];
            bn += wy * (log(s) + zmax - z[i * 3 + y]);
            bd += wy;
            int p = z[i * 3 + 1] > z[i * 3] ? 1 : 0;
            if (z[i * 3 + 2] > z[i * 3 + p]) p = 2;
            if (wy == 0) continue;
            if (p == y) tp[p]++; else { fp[p]++; fn[y]++; }
        }
        num += bn; den += bd; batch_means += bn / bd / 2;
    }
    const double loss = pt.loss_sum / pt.norm_sum;
    CHECK(fabs(num / den - batch_means) > 1e-4 * fabs(num / den),
          "the example tells the global mean from the mean of batch means");
    CHECK(fabs(loss - num / den) <= 1e-5 * fabs(num / den), "val loss %.9g, by hand %.9g", loss,
          num / den);
    double iou[3];
    Metrics m = {.iou = iou};
    metrics_compute(cm, 3, c.class_weights, &m);
    for (int k = 1; k < 3; k++)
        CHECK_NEAR(iou[k], (double)tp[k] / (tp[k] + fp[k] + fn[k]), 1e-12, "val IoU");
    free(img);
    trainer_close(&t);
    rm_rf(dir);
}

// patience 1: training stops at the first epoch whose val_loss is not below
// every earlier one, and best.safetensors holds the best epoch's weights
TEST(early_stopping) {
    const char *data = "/tmp/segnet_test_es_data", *a = "/tmp/segnet_test_es_a",
               *b = "/tmp/segnet_test_es_b";
    rm_rf(data); rm_rf(a); rm_rf(b);
    write_seg_set(data, 8, 8, 8, 4);
    write_seg_set("/tmp/segnet_test_es_data/val", 4, 8, 8, 5);
    char val[256], path[300];
    snprintf(val, sizeof val, "%s/val", data);
    TrainCfg c = tiny_seg_cfg(data, val);
    c.epochs = 40;
    c.lr = 0.05f;  // large steps on tiny data: val_loss soon stops improving
    c.patience = 1;
    c.out = a;
    char err[SN_ERR_MAX];
    CHECK(train_run(&c, NULL, err) == 0, "%s", err);
    double vl[64];
    snprintf(path, sizeof path, "%s/metrics.csv", a);
    int n = csv_column(path, "val_loss", vl, 64), stop = 0, best = 1;
    for (int e = 2; e <= 40 && !stop; e++) {
        if (vl[e - 1] < vl[best - 1]) best = e;
        else stop = e;
    }
    CHECK(stop > 0 && n == stop, "stopped after %d epochs, the rule says %d", n, stop);
    // the same run cut at the best epoch has the weights best.safetensors holds
    c.epochs = best; c.patience = 0; c.out = b;
    CHECK(train_run(&c, NULL, err) == 0, "%s", err);
    SafetensorsFile fa, fb;
    char pa[300], pb[300];
    snprintf(pa, sizeof pa, "%s/best.safetensors", a);
    snprintf(pb, sizeof pb, "%s/last.safetensors", b);
    CHECK(safetensors_read(pa, &fa, err) == 0 && safetensors_read(pb, &fb, err) == 0, "%s", err);
    int differ = fa.n_tensors != fb.n_tensors;
    for (int i = 0; !differ && i < fa.n_tensors; i++) {
        const SafetensorsTensor *ta = &fa.tensors[i], *tb = safetensors_find(&fb, ta->name);
        differ = !tb || tb->numel != ta->numel ||
                 memcmp(ta->data, tb->data, ta->numel * dtype_size(ta->dtype));
    }
    CHECK(!differ, "best.safetensors is not the state after the best epoch (%d)", best);
    safetensors_free(&fa); safetensors_free(&fb);
    rm_rf(data); rm_rf(a); rm_rf(b);
}

static const char *meta_of(const SafetensorsFile *f, const char *key) {
    for (int i = 0; i < f->n_meta; i++) if (!strcmp(f->meta_keys[i], key)) return f->meta_values[i];
    return "";
}

// A val_loss that never changes (head weights 0, lr 0: the logits are the head's
// bias) is not an improvement (Keras: strictly lower, min_delta 0): with
// patience 2, epoch 1 is the best and training stops after epoch 3, also when
// the run is interrupted after epoch 2 and resumed.
TEST(early_stopping_ties) {
    const char *data = "/tmp/segnet_test_ties_data", *run = "/tmp/segnet_test_ties_run",
               *run2 = "/tmp/segnet_test_ties_run2", *w = "/tmp/segnet_test_ties.safetensors";
    rm_rf(data); rm_rf(run); rm_rf(run2); unlink(w);
    write_seg_set(data, 4, 8, 8, 13);
    TrainCfg c = tiny_seg_cfg(data, data);
    char err[SN_ERR_MAX];
    Trainer t;
    CHECK(trainer_open(&t, &c, NULL, NULL, err) == 0, "%s", err);
    const ParamInfo *hw = &t.g.params[graph_find_param(&t.g, "head.weight")];
    memset(t.net.params + hw->offset, 0, sizeof(float) * hw->count);
    CHECK(net_save_weights(&t.net, w, err) == 0, "%s", err);
    trainer_close(&t);
    c.weights = w;
    c.lr = 0.0f;
    c.epochs = 6;
    c.patience = 2;
    c.out = run;
    CHECK(train_run(&c, NULL, err) == 0, "%s", err);
    double vl[8];
    char path[300];
    snprintf(path, sizeof path, "%s/metrics.csv", run);
    int n = csv_column(path, "val_loss", vl, 8);
    CHECK(n >= 2 && vl[1] == vl[0], "the example's val_loss is constant (%g, %g)", vl[0], vl[1]);
    CHECK(n == 3,
          "stopped after %d epochs; patience 2 with no improvement after epoch 1 stops after epoch "
          "3",
          n);
    SafetensorsFile f;
    snprintf(path, sizeof path, "%s/best.safetensors", run);
    CHECK(safetensors_read(path, &f, err) == 0, "%s", err);
    CHECK(!strcmp(meta_of(&f, "epoch"), "1") && !strcmp(meta_of(&f, "best_epoch"), "1"),
          "best.safetensors is from epoch %s (best %s), not 1", meta_of(&f, "epoch"),
          meta_of(&f, "best_epoch"));
    safetensors_free(&f);
    // the same run stopped after epoch 2 (one epoch without improvement) and
    // resumed: the best loss, best epoch and patience count come back, so it
    // stops after epoch 3 too, with the same files
    c.out = run2;
    c.stop_after_epochs = 2;
    CHECK(train_run(&c, NULL, err) == 0, "%s", err);
    c.stop_after_epochs = 0;
    CHECK(train_run(&c, run2, err) == 0, "resume: %s", err);
    const char *files[] = {"last.safetensors", "best.safetensors", "metrics.csv"};
    for (int k = 0; k < 3; k++) {
        char pa[300], pb[300];
        snprintf(pa, sizeof pa, "%s/%s", run, files[k]);
        snprintf(pb, sizeof pb, "%s/%s", run2, files[k]);
        CHECK(files_equal(pa, pb), "%s differs between the resumed and the uninterrupted run",
              files[k]);
    }
    rm_rf(data); rm_rf(run); rm_rf(run2); unlink(w);
}

// --min-delta: an epoch improves only by more than min_delta. With patience 1
// a run whose val_loss falls every epoch runs all its 5 epochs with min_delta
// 0, and stops after its second with min_delta 100 (more than the loss can
// fall); --monitor val_mIoU with min_delta 1 (more than mIoU can rise) stops
// there too. The monitor is in config.txt; a metric the model does not
// report is refused.
TEST(monitor_min_delta) {
    const char *data = "/tmp/segnet_test_monitor_data", *run = "/tmp/segnet_test_monitor_run";
    rm_rf(data); rm_rf(run);
    write_seg_set(data, 4, 8, 8, 11);
    char args[2048], msg[4096], path[600];
    const struct { const char *opts; int want; } cases[] = {
        {"--min-delta 0", 5}, {"--min-delta 100", 2}, {"--monitor val_mIoU --min-delta 1", 2}};
    for (int i = 0; i < 3; i++) {
        rm_rf(run);
        snprintf(args, sizeof args,
                 "train --model unet --depth 1 --width 2 --size 8x8 --batch 2 --epochs 5 --classes "
                 "3 "
                 "--data %s --val %s --out %s --device cpu --threads 1 --lr 0.01 --early-stopping "
                 "1 %s",
                 data, data, run, cases[i].opts);
        CHECK(run_segnet(args, msg, sizeof msg) == 0, "train: %s", msg);
        double col[8];
        snprintf(path, sizeof path, "%s/metrics.csv", run);
        int rows = csv_column(path, "val_loss", col, 8);
        CHECK(rows == cases[i].want, "%s: %d epochs ran, want %d (val_loss %g %g %g %g %g)",
              cases[i].opts, rows, cases[i].want, col[0], col[1], col[2], col[3], col[4]);
    }
    snprintf(path, sizeof path, "%s/config.txt", run);
    size_t n;
    char *cfg = read_file(path, &n);
    CHECK(cfg && contains(cfg, "monitor = val_mIoU") && contains(cfg, "min-delta = 1"),
          "config.txt: %s", cfg ? cfg : "(none)");
    free(cfg);
    rm_rf(run);
    snprintf(args, sizeof args,
             "train --model unet --depth 1 --width 2 --size 8x8 --batch 2 --epochs 1 --classes 3 "
             "--data %s --out %s --device cpu --monitor val_accuracy",
             data, run);
    CHECK(run_segnet(args, msg, sizeof msg) == 2 && contains(msg, "--monitor val_accuracy") &&
                  contains(msg, "val_mIoU"),
          "a classifier's metric for a U-Net: '%s'", msg);
    rm_rf(data); rm_rf(run);
}

// `segnet <common> --data DATA --val DATA` for `epochs` into a, and for `first` epochs
// into b that `train --resume b --epochs <epochs>` continues: b's metrics.csv,
// last.safetensors, best.safetensors and config.txt equal a's byte for byte (step_ms aside)
static void whole_and_resumed_runs(const char *common, const char *data, const char *a,
                                   const char *b, int epochs, int first) {
    char args[1200], msg[4096], pa[300], pb[300];
    rm_rf(a);
    rm_rf(b);
    snprintf(args, sizeof args, "%s --epochs %d --data %s --val %s --out %s", common, epochs, data,
             data, a);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "%s", msg);
    snprintf(args, sizeof args, "%s --epochs %d --data %s --val %s --out %s", common, first, data,
             data, b);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "%s", msg);
    snprintf(args, sizeof args, "train --resume %s --epochs %d", b, epochs);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "resume: %s", msg);
    const char *files[] = {"metrics.csv", "last.safetensors", "best.safetensors", "config.txt"};
    for (int k = 0; k < 4; k++) {
        snprintf(pa, sizeof pa, "%s/%s", a, files[k]);
        snprintf(pb, sizeof pb, "%s/%s", b, files[k]);
        CHECK(files_equal(pa, pb), "%s differs between the resumed and the whole run", files[k]);
    }
}

// --loss through the command line: config.txt keeps the terms and the constants
// of the terms it has; a resumed run keeps them (another --loss is refused);
// resuming from config.txt trains the same bits as one run; the refusals.
// segnet train's last stdout line says where the run's time went: every part
// a number >= 0, the parts (start-up, steps, loader wait, validation,
// checkpoints) adding up to the total less `other` (which is the difference,
// so it is checked to be >= 0: a part counted twice would make it negative
// beyond the 10 ms steps of the process's start time), and steps > 0. The
// identity total = parts + other holds to the print's rounding: 7 values
// each within 0.0005, so 0.0035. The run is large enough that its steps take
// well over that (a part counted twice fails).
TEST(train_seconds_line) {
    const char *data = "/tmp/segnet_test_seconds", *out = "/tmp/segnet_test_seconds_run";
    rm_rf(data);
    rm_rf(out);
    write_seg_set(data, 16, 32, 32, 5);
    char args[600], msg[4096];
    snprintf(args, sizeof args,
             "train --model unet --depth 2 --width 8 --size 32x32 --batch 4 --classes 3 --epochs 3 "
             "--device cpu --data %s --val %s --out %s",
             data, data, out);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "train: %s", msg);
    size_t n;
    char *text = read_file("/tmp/segnet_test_out.txt", &n);
    const char *line = text ? strstr(text, "\nseconds: ") : NULL;
    double v[7] = {0};
    static const char *const FORMAT = "\nseconds: total %lf startup %lf steps %lf loader_wait %lf "
                                      "validation %lf checkpoint %lf other %lf";
    const int got =
            line ? sscanf(line, FORMAT, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6]) : 0;
    CHECK(got == 7, "no whole seconds: line in train's stdout: %s", text ? text : "(none)");
    if (got == 7) {
        double parts = 0;
        for (int k = 1; k < 6; k++) {
            CHECK(v[k] >= 0, "seconds: part %d is %g", k, v[k]);
            parts += v[k];
        }
        CHECK(v[2] > 0 && v[6] >= -0.02 && fabs(v[0] - parts - v[6]) < 0.0035,
              "seconds: total %g, parts %g, other %g, steps %g", v[0], parts, v[6], v[2]);
    }
    free(text);
    rm_rf(data);
    rm_rf(out);
}

TEST(train_loss_cli) {
    const char *data = "/tmp/segnet_test_losscli", *a = "/tmp/segnet_test_losscli_a",
               *b = "/tmp/segnet_test_losscli_b";
    rm_rf(data);
    write_seg_set(data, 4, 8, 8, 9);
    const char *common = "train --model unet --depth 1 --width 4 --size 8x8 --batch 2 --classes 3 "
                         "--class-weights 0,1,1 --device cpu --lr 0.01 "
                         "--loss 0.5*tversky+focal+ce+0.25*lovasz --tversky-alpha 0.3 "
                         "--tversky-beta 0.7 "
                         "--focal-gamma 1.5 --loss-smooth 0.5";
    whole_and_resumed_runs(common, data, a, b, 3, 2);
    char args[1200], msg[4096], pa[300];
    snprintf(pa, sizeof pa, "%s/config.txt", a);
    char *cfg = read_text(pa);
    CHECK(cfg && strstr(cfg, "\nloss = ce+focal+0.5*tversky+0.25*lovasz\nfocal-gamma = 1.5\n"
                             "focal-alpha = "
                             "0.25\nloss-smooth = 0.5\nloss-per-image = off\ntversky-alpha = "
                             "0.3\ntversky-beta = 0.7\ntversky-gamma = 1\n"),
          "config.txt's loss lines: %s", cfg ? cfg : "(none)");
    free(cfg);
    snprintf(args, sizeof args, "train --resume %s --epochs 4 --loss ce", b);
    CHECK(run_segnet(args, msg, sizeof msg) == 1 && strstr(msg, "--loss ce") &&
                  strstr(msg, "stays for the whole run"),
          "another --loss on resume: %s", msg);
    // the default writes ce alone and no constants
    rm_rf(a);
    snprintf(args, sizeof args,
             "train --model unet --depth 1 --width 4 --size 8x8 --batch 2 --classes 3 --epochs 1 "
             "--device cpu --data %s --out %s",
             data, a);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "%s", msg);
    snprintf(pa, sizeof pa, "%s/config.txt", a);
    cfg = read_text(pa);
    CHECK(cfg && strstr(cfg, "\nloss = ce\niou-per-image = off\nseed = "),
          "config.txt, default loss: %s", cfg ? cfg : "(none)");
    free(cfg);
    // refusals: usage (2) and settings that cannot train (1), each naming the problem
    const struct {
        const char *extra, *says;
        int rc;
    } bad[] = {
            {"--loss dice+dice", "dice twice", 2},
            {"--loss 0*dice", "the weight of '0*dice' is not a number > 0", 2},
            {"--loss hinge", "NAME one of ce, focal, dice, jaccard, tversky, lovasz", 2},
            {"--loss lovasz", "", 0},
            {"--loss lovasz --replicas 2",
             "over the global batch needs it whole in one step "
             "(--replicas): add --loss-per-image",
             1},
            {"--loss ce+lovasz --accum 2", "(--accum): add --loss-per-image", 1},
            {"--loss lovasz --loss-smooth 1", "--loss-smooth applies to", 2},
            {"--loss 'ce+'", "an empty term", 2},
            {"--loss dice --accum 2", "", 0},
            {"--loss dice --accum 2 --loss-per-image", "", 0},
            {"--loss ce --loss-per-image", "--loss-per-image applies to", 2},
            {"--loss focal --loss-smooth 1", "--loss-smooth applies to", 2},
            {"--loss dice --tversky-beta 1", "--tversky-beta applies to", 2},
    };
    for (size_t k = 0; k < sizeof bad / sizeof *bad; k++) {
        rm_rf(b);
        snprintf(args, sizeof args,
                 "train --model unet --depth 1 --width 4 --size 8x8 --batch 2 --classes 3 "
                 "--epochs 1 --device cpu --data %s --out %s %s",
                 data, b, bad[k].extra);
        const int rc = run_segnet(args, msg, sizeof msg);
        CHECK(rc == bad[k].rc && strstr(msg, bad[k].says), "%s: status %d (want %d): %s",
              bad[k].extra, rc, bad[k].rc, msg);
    }
    rm_rf(b);
    snprintf(args, sizeof args,
             "train --model effv2-t --size 32x32 --batch 2 --classes 3 --epochs 1 --device cpu "
             "--data %s --out %s --loss ce+jaccard",
             data, b);
    CHECK(run_segnet(args, msg, sizeof msg) == 1 && strstr(msg, "jaccard") &&
                  strstr(msg, "classifier"),
          "a classifier's region loss: %s", msg);
    rm_rf(data);
    rm_rf(a);
    rm_rf(b);
}

// --schedule plateau through the command line: with patience 1 and a
// min_delta no loss can beat, every epoch after the first lowers the lr by
// --lr-factor (0.5) down to --min-lr, as metrics.csv's lr column shows; the
// state is in the checkpoint, so a run stopped after epoch 2 and resumed
// (settings from config.txt) writes the same metrics.csv and weights as one
// that was not stopped. --schedule poly decays to 0.
TEST(schedule_plateau_poly) {
    const char *data = "/tmp/segnet_test_plateau_data", *a = "/tmp/segnet_test_plateau_a",
               *b = "/tmp/segnet_test_plateau_b";
    rm_rf(data);
    write_seg_set(data, 4, 8, 8, 9);
    const char *common = "train --model unet --depth 1 --width 4 --size 8x8 --batch 2 --classes 3 "
                         "--class-weights 0,1,1 --device cpu --lr 0.01 --schedule plateau "
                         "--lr-factor 0.5 --lr-patience 1 --lr-min-delta 100 --min-lr 0.002";
    whole_and_resumed_runs(common, data, a, b, 5, 2);
    char args[1200], msg[4096], pa[300];
    snprintf(pa, sizeof pa, "%s/metrics.csv", a);
    double lr[5];
    // the lr during epoch e: lowered after epochs 2, 3, 4 (fp32 halvings), at least min_lr
    const double want[5] = {0.01f, 0.01f, 0.005f, 0.0025f, 0.002f};
    CHECK(csv_column(pa, "lr", lr, 5) == 5, "5 epochs");
    for (int e = 0; e < 5; e++)
        CHECK(fabs(lr[e] - want[e]) <= 1e-6 * want[e], "epoch %d: lr %g, want %g", e + 1, lr[e],
              want[e]);
    snprintf(pa, sizeof pa, "%s/config.txt", a);
    size_t n;
    char *cfg = read_file(pa, &n);
    CHECK(cfg && contains(cfg, "schedule = plateau\nwarmup = 0") &&
                  contains(cfg, "lr-factor = 0.5\nlr-patience = 1\nmin-lr = 0.002\n"),
          "config.txt: %s", cfg ? cfg : "");
    free(cfg);
    rm_rf(a);
    snprintf(args, sizeof args,
             "train --model unet --depth 1 --width 4 --size 8x8 --batch 2 --classes 3 --device cpu "
             "--lr 0.01 --schedule poly --epochs 2 --data %s --out %s",
             data, a);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "poly: %s", msg);
    snprintf(pa, sizeof pa, "%s/metrics.csv", a);
    // 4 steps; the lr after step k (1-based) is 0.01·(1 - (k-1)/4)^0.9: epoch 1 ends at k = 2
    CHECK(csv_column(pa, "lr", lr, 2) == 2 && fabs(lr[0] - 0.01 * pow(0.75, 0.9)) < 1e-8 &&
                  fabs(lr[1] - 0.01 * pow(0.25, 0.9)) < 1e-8,
          "poly lr %g %g", lr[0], lr[1]);
    snprintf(args, sizeof args, "train --schedule step --data %s", data);
    CHECK(run_segnet(args, msg, sizeof msg) == 2 &&
                  contains(msg, "must be constant, cosine, poly or plateau"),
          "an unknown schedule: '%s'", msg);
    rm_rf(data);
    rm_rf(a);
    rm_rf(b);
}

// The Dice columns (issue 35, item 3): metrics.csv's dice and Dice_<class>
// follow from its IoU columns, Dice = 2·IoU/(1 + IoU) per class (both from one
// confusion matrix: 2TP/(2TP + FP + FN) against TP/(TP + FP + FN)), within the
// file's 6 decimals; --monitor val_dice picks best.safetensors by val_dice,
// and eval --run prints that epoch's val_dice. A run whose metrics.csv has no
// Dice columns (written before them) resumes with them empty.
TEST(dice_metric) {
    const char *data = "/tmp/segnet_test_dice_data", *run = "/tmp/segnet_test_dice_run";
    rm_rf(data);
    rm_rf(run);
    write_seg_set(data, 4, 8, 8, 5);
    TrainCfg c = tiny_seg_cfg(data, data);  // class weights 0,1,1
    c.epochs = 3;
    c.lr = 0.1f;
    c.monitor_metric = 2;
    c.out = run;
    char err[SN_ERR_MAX], path[600], args[700], msg[4096];
    CHECK(train_run(&c, NULL, err) == 0, "%s", err);
    snprintf(path, sizeof path, "%s/metrics.csv", run);
    double iou[2][3], dice[2][3], vdice[3], vm[3];
    for (int k = 1; k <= 2; k++) {
        char a[32], b[32];
        snprintf(a, sizeof a, "val_IoU_%d", k);
        snprintf(b, sizeof b, "val_Dice_%d", k);
        CHECK(csv_column(path, a, iou[k - 1], 3) == 3 && csv_column(path, b, dice[k - 1], 3) == 3,
              "columns %s, %s", a, b);
        for (int e = 0; e < 3; e++) {
            const double u = iou[k - 1][e];
            CHECK(fabs(dice[k - 1][e] - 2 * u / (1 + u)) < 2e-6, "epoch %d Dice_%d %g from IoU %g",
                  e + 1, k, dice[k - 1][e], u);
        }
    }
    CHECK(csv_column(path, "val_dice", vdice, 3) == 3 && csv_column(path, "val_mIoU", vm, 3) == 3,
          "val_dice, val_mIoU");
    int best = 0;
    for (int e = 0; e < 3; e++) {
        CHECK(fabs(vdice[e] - (dice[0][e] + dice[1][e]) / 2) < 2e-6,
              "epoch %d: val_dice %g is not the classes' mean", e + 1, vdice[e]);
        if (vdice[e] > vdice[best]) best = e;
    }
    snprintf(path, sizeof path, "%s/config.txt", run);
    size_t n;
    char *cfg = read_file(path, &n);
    CHECK(cfg && contains(cfg, "monitor = val_dice"), "config.txt: %s", cfg ? cfg : "");
    free(cfg);
    // the checkpoint judges by -val_dice (higher is better)
    SafetensorsFile f;
    snprintf(path, sizeof path, "%s/last.safetensors", run);
    CHECK(safetensors_read(path, &f, err) == 0, "%s", err);
    const char *best_loss = safetensors_meta(&f, "best_loss"),
               *best_epoch = safetensors_meta(&f, "best_epoch");
    CHECK(best_loss && best_epoch && fabs(strtod(best_loss, NULL) + vdice[best]) < 2e-6 &&
                  atoi(best_epoch) == best + 1,
          "best %s at epoch %s, want -%.6f at %d", best_loss ? best_loss : "?",
          best_epoch ? best_epoch : "?", vdice[best], best + 1);
    safetensors_free(&f);
    snprintf(args, sizeof args, "eval --run %s", run);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "eval: %s", msg);
    char *out = read_file("/tmp/segnet_test_out.txt", &n);
    const char *p = out ? strstr(out, "val_dice: ") : NULL;
    CHECK(p && fabs(strtod(p + 10, NULL) - vdice[best]) < 2e-6 && contains(out, "val_Dice_1: ") &&
                  !contains(out, "val_Dice_0"),
          "eval --run prints the best epoch's (%d) val_dice %.6f: %s", best + 1, vdice[best],
          out ? out : "");
    free(out);
    // a run written before the Dice columns (monitoring val_loss): drop them, resume
    rm_rf(run);
    c.monitor_metric = 0;
    c.epochs = 1;
    CHECK(train_run(&c, NULL, err) == 0, "%s", err);
    snprintf(path, sizeof path, "%s/metrics.csv", run);
    char *csv = read_file(path, &n), *cut = malloc(n + 1), *w = cut;
    for (char *line = csv, *end; line && *line; line = end + 1) {
        end = strchr(line, '\n');
        const char *q = line;
        for (int commas = 0; q < end; q++)  // the first column of the Dice: dice
            if (*q == ',' && ++commas == 4 + 2 * (2 + 3) + STEP_STATS_N_COLUMNS) break;
        memcpy(w, line, (size_t)(q - line));
        w += q - line;
        *w++ = '\n';
    }
    *w = 0;
    CHECK(contains(cut, ",step_ms\n") && !contains(cut, "dice"), "the older header: %.80s", cut);
    write_file_bytes(path, cut, strlen(cut));
    c.epochs = 2;
    CHECK(train_run(&c, run, err) == 0, "resume: %s", err);
    char *again = read_file(path, &n);
    CHECK(again && contains(again, ",step_ms,dice,Dice_0,") && contains(again, "val_Dice_2\n"),
          "the resumed file has the Dice columns");
    double d2[2];
    CHECK(csv_column(path, "val_dice", d2, 2) == 2 && isnan(d2[0]) && !isnan(d2[1]),
          "the older epoch's Dice empty, the new one's there: %g %g", d2[0], d2[1]);
    free(csv);
    free(cut);
    free(again);
    rm_rf(data);
    rm_rf(run);
}

// --dropout sets both dropouts of the classifier head (the seed's head: --head-hidden
// 128 --dropout 0.2); without it the model's own rate (effv2-l: torchvision's 0.4)
TEST(head_dropout) {
    for (int given = 0; given < 2; given++) {
        ModelCfg c = model_cfg_default();
        c.model = "effv2-l"; c.classes = 6; c.height = 64; c.width = 64; c.head_hidden = 128;
        if (given) c.dropout = 0.2f;
        Graph g;
        graph_init(&g);
        CHECK(model_build(&g, &c) >= 0, "%s", g.err);
        int n = 0;
        for (int i = 0; i < g.n_layers; i++)
            if (g.layers[i].kind == LAYER_DROPOUT &&
                !strncmp(g.layers[i].name, "classifier.", 11)) {
                CHECK(g.layers[i].rate == (given ? 0.2f : 0.4f), "%s: rate %g", g.layers[i].name,
                      g.layers[i].rate);
                n++;
            }
        CHECK(n == 2, "%d head dropouts, want 2", n);
        graph_free(&g);
    }
}

// Seed 001's two phases: phase 1 trains with the base frozen; phase 2 is a new
// run with --weights RUN1/best.safetensors and everything trainable (the
// optimiser starts afresh; the checkpoint's Adam moments are not weights and
// are skipped). Phase 2 loads every tensor (the report says so; with lr 0
// its weights stay phase 1's exactly) and trains the formerly frozen encoder.
TEST(two_phase_finetune) {
    const char *data = "/tmp/segnet_test_phases_data", *r1 = "/tmp/segnet_test_phase1",
               *r2 = "/tmp/segnet_test_phase2";
    rm_rf(data); rm_rf(r1); rm_rf(r2);
    write_seg_set(data, 4, 8, 8, 13);
    char args[2048], msg[4096], path[600];
    const char *base = "train --model unet --depth 1 --width 2 --size 8x8 --batch 2 --classes 3 "
                       "--device cpu --threads 1";
    snprintf(args, sizeof args,
             "%s --epochs 2 --data %s --val %s --out %s --freeze base --unfreeze-last 1", base,
             data, data, r1);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "phase 1: %s", msg);
    SafetensorsFile best, last;
    char err[SN_ERR_MAX];
    snprintf(path, sizeof path, "%s/best.safetensors", r1);
    CHECK(safetensors_read(path, &best, err) == 0, "%s", err);
    for (int lr0 = 1; lr0 >= 0; lr0--) {
        rm_rf(r2);
        snprintf(args, sizeof args,
                 "%s --epochs 1 --data %s --out %s --weights %s/best.safetensors%s", base, data, r2,
                 r1, lr0 ? " --lr 0" : "");
        CHECK(run_segnet(args, msg, sizeof msg) == 0, "phase 2: %s", msg);
        size_t n;
        char *out = read_file("/tmp/segnet_test_out.txt", &n), want[700];
        snprintf(want, sizeof want,
                 "tensors loaded from %s/best.safetensors (torchvision names), 0 initialised, 0 "
                 "ignored",
                 r1);
        CHECK(out && !strncmp(out, "weights: ", 9) && contains(out, want), "phase 2's report: '%s'",
              out ? out : "");
        free(out);
        snprintf(path, sizeof path, "%s/last.safetensors", r2);
        CHECK(safetensors_read(path, &last, err) == 0, "%s", err);
        int enc_same = 1, all_same = 1, n_enc = 0;
        for (int i = 0; i < best.n_tensors; i++) {
            const SafetensorsTensor *a = &best.tensors[i], *b = safetensors_find(&last, a->name);
            if (!strncmp(a->name, TRAIN_STATE_PREFIX, strlen(TRAIN_STATE_PREFIX)) ||
                strstr(a->name, "running_"))
                continue;
            int same = b && a->numel == b->numel && a->dtype == b->dtype &&
                       !memcmp(a->data, b->data, a->numel * dtype_size(a->dtype));
            all_same &= same;
            if (!strncmp(a->name, "enc0.", 5)) { enc_same &= same; n_enc++; }
        }
        if (lr0) CHECK(all_same, "phase 2 with lr 0: its weights are not phase 1's best");
        else
            CHECK(n_enc > 0 && !enc_same,
                  "phase 2 did not train the encoder frozen in phase 1 (%d tensors)", n_enc);
        safetensors_free(&last);
    }
    safetensors_free(&best);
    rm_rf(data); rm_rf(r1); rm_rf(r2);
}

// Class names: class folders sorted by name, or a CSV's distinct text labels
// sorted; a validation set takes the training set's numbering by name (a class
// it lacks shifts nothing, one the training set lacks is refused); a run keeps
// them in classes.txt and predict --run writes each image's class name.
TEST(class_names) {
    const char *dir = "/tmp/segnet_test_class_names", *run = "/tmp/segnet_test_class_names_run";
    char cmd[1400], err[SN_ERR_MAX], path[700], msg[4096];
    rm_rf(dir); rm_rf(run);
    snprintf(cmd, sizeof cmd,
             "mkdir -p %s/train/cat %s/train/dog %s/train/emu %s/val/cat %s/val/emu %s/bad/fox",
             dir, dir, dir, dir, dir, dir);
    CHECK(system(cmd) == 0, "mkdir");
    uint8_t px[8 * 8 * 3];
    for (int i = 0; i < 8 * 8 * 3; i++) px[i] = (uint8_t)(i * 37);
    const char *files[] = {"train/cat/a.png", "train/cat/b.png",
                           "train/dog/c.png", "train/emu/d.png",
                           "val/cat/e.png",   "val/emu/f.png",
                           "bad/fox/g.png",   "h.png",
                           "i.png",           "j.png"};
    for (int i = 0; i < 10; i++) ds_png(dir, files[i], 8, 8, 3, px);
    Dataset tr, va;
    snprintf(path, sizeof path, "%s/train", dir);
    CHECK(dataset_open(&tr, path, 0, 3, 8, 8, 1 << 20, 1, err) == 0, "%s", err);
    CHECK(tr.n_names == 3 && !strcmp(tr.names[0], "cat") && !strcmp(tr.names[1], "dog") &&
                  !strcmp(tr.names[2], "emu") && tr.n == 4 && tr.labels[0] == 0 &&
                  tr.labels[1] == 0 && tr.labels[2] == 1 && tr.labels[3] == 2,
          "training folders: %d names, labels %d %d %d %d", tr.n_names, tr.labels[0], tr.labels[1],
          tr.labels[2], tr.labels[3]);
    snprintf(path, sizeof path, "%s/val", dir);
    CHECK(dataset_open_named(&va, path, 0, 3, 8, 8, 1 << 20, 1, &tr, NULL, err) == 0, "%s", err);
    CHECK(va.n == 2 && va.labels[0] == 0 && va.labels[1] == 2 && va.n_names == 3,
          "validation: emu is class %d, want 2", va.n == 2 ? va.labels[1] : -1);
    dataset_free(&va);
    snprintf(path, sizeof path, "%s/bad", dir);
    CHECK(dataset_open_named(&va, path, 0, 3, 8, 8, 1 << 20, 1, &tr, NULL, err) == -1 &&
                  contains(err, "'fox'") && contains(err, "cat, dog, emu") &&
                  contains(err, "bad/fox"),
          "an unknown class folder: '%s'", err);
    // a CSV of names, and one with more names than classes
    ds_text(dir, "names.csv", "path,label\nh.png,zebra\ni.png,ant\nj.png,zebra\n");
    snprintf(path, sizeof path, "%s/names.csv", dir);
    Dataset cs;
    CHECK(dataset_open(&cs, path, 0, 3, 8, 8, 1 << 20, 1, err) == 0, "%s", err);
    CHECK(cs.n_names == 2 && !strcmp(cs.names[0], "ant") && !strcmp(cs.names[1], "zebra") &&
                  cs.labels[0] == 1 && cs.labels[1] == 0 && cs.labels[2] == 1,
          "CSV names: %d, labels %d %d %d", cs.n_names, cs.labels[0], cs.labels[1], cs.labels[2]);
    dataset_free(&cs);
    ds_text(dir, "many.csv", "h.png,a\ni.png,b\nj.png,c\nh.png,d\n");
    snprintf(path, sizeof path, "%s/many.csv", dir);
    CHECK(dataset_open(&cs, path, 0, 3, 8, 8, 1 << 20, 1, err) == -1 &&
                  contains(err, "4 class names") && contains(err, "there are 3 classes"),
          "too many names: '%s'", err);
    dataset_free(&tr);
    // a run keeps them; predict --run names each image's class
    snprintf(cmd, sizeof cmd,
             "train --model effv2-t --classes 3 --size 32x32 --batch 2 --epochs 1 --data %s/train "
             "--val %s/val --out %s --device cpu --threads 1",
             dir, dir, run);
    CHECK(run_segnet(cmd, msg, sizeof msg) == 0, "train: %s", msg);
    char **names;
    int n = read_class_names(run, &names);
    CHECK(n == 3 && !strcmp(names[0], "cat") && !strcmp(names[2], "emu"), "classes.txt: %d names",
          n);
    for (int k = 0; k < n; k++) free(names[k]);
    free(names);
    snprintf(cmd, sizeof cmd,
             "predict --run %s --input %s/val/emu --out %s/p.csv --device cpu --threads 1", run,
             dir, dir);
    CHECK(run_segnet(cmd, msg, sizeof msg) == 0, "predict: %s", msg);
    snprintf(path, sizeof path, "%s/p.csv", dir);
    size_t len;
    char *csv = read_file(path, &len);
    int pred = -1, off = 0;
    char name[16] = "";
    CHECK(csv && !strncmp(csv, "path,pred,pred_name,p0,p1,p2\n", 29) &&
                  sscanf(csv + 29, "%*[^,],%d,%15[^,],%n", &pred, name, &off) == 2 && off > 0 &&
                  pred >= 0 && pred < 3 &&
                  !strcmp(name, pred == 0   ? "cat"
                                : pred == 1 ? "dog"
                                            : "emu"),
          "predictions: '%s'", csv ? csv : "");
    free(csv);
    rm_rf(dir); rm_rf(run);
}

// --train-eval with the training set as the validation set: the train columns
// are then the validation ones, to the bit (the same images, mode and weights)
TEST(train_eval) {
    const char *data = "/tmp/segnet_test_teval_data", *run = "/tmp/segnet_test_teval_run";
    rm_rf(data); rm_rf(run);
    write_seg_set(data, 6, 8, 8, 43);
    TrainCfg c = tiny_seg_cfg(data, data);
    c.epochs = 2;
    c.out = run;
    c.train_eval = 1;
    char err[SN_ERR_MAX], metrics[300];
    CHECK(train_run(&c, NULL, err) == 0, "%s", err);
    snprintf(metrics, sizeof metrics, "%s/metrics.csv", run);
    const char *pairs[3][2] = {{"loss", "val_loss"}, {"mIoU", "val_mIoU"}, {"IoU_1", "val_IoU_1"}};
    for (int e = 1; e <= 2; e++)
        for (int k = 0; k < 3; k++) {
            char *a = csv_field_text(metrics, pairs[k][0], e),
                 *b = csv_field_text(metrics, pairs[k][1], e);
            CHECK(a[0] && !strcmp(a, b), "epoch %d: %s %s vs %s %s", e, pairs[k][0], a, pairs[k][1],
                  b);
            free(a); free(b);
        }
    char config[300];
    snprintf(config, sizeof config, "%s/config.txt", run);
    char *text = read_text(config);
    CHECK(text && contains(text, "train-eval = on\n") && contains(text, "log-every = 0\n"),
          "config.txt keeps the settings");
    free(text);
    // the inference-mode pass changes nothing else: the same weights and validation figures without
    // it
    const char *plain = "/tmp/segnet_test_teval_plain";
    rm_rf(plain);
    c.train_eval = 0;
    c.out = plain;
    CHECK(train_run(&c, NULL, err) == 0, "%s", err);
    char pa[300], pb[300];
    snprintf(pa, sizeof pa, "%s/last.safetensors", run);
    snprintf(pb, sizeof pb, "%s/last.safetensors", plain);
    CHECK(files_equal(pa, pb), "--train-eval changed the weights");
    snprintf(pb, sizeof pb, "%s/metrics.csv", plain);
    for (int e = 1; e <= 2; e++) {
        char *a = csv_field_text(metrics, "val_mIoU", e), *b = csv_field_text(pb, "val_mIoU", e);
        CHECK(!strcmp(a, b), "epoch %d: val_mIoU %s with --train-eval, %s without", e, a, b);
        free(a); free(b);
    }
    rm_rf(data); rm_rf(run); rm_rf(plain);
}

// effv2 tiny with the hidden head on a CSV data set: trains, reports accuracy,
// and learns an easy rule (dark vs bright images)
TEST(classifier_csv_trains) {
    const char *dir = "/tmp/segnet_test_cls", *run = "/tmp/segnet_test_cls_run";
    rm_rf(dir); rm_rf(run);
    char path[512];
    snprintf(path, sizeof path, "mkdir -p %s/img", dir);
    CHECK(system(path) == 0, "mkdir");
    snprintf(path, sizeof path, "%s/labels.csv", dir);
    FILE *csv = fopen(path, "w");
    fprintf(csv, "path,label\n");
    Rng r;
    rng_seed(&r, 9);
    uint8_t img[32 * 32 * 3];
    for (int i = 0; i < 32; i++) {
        int label = i % 2;
        for (int p = 0; p < 32 * 32 * 3; p++)
            img[p] = (uint8_t)((label ? 150 : 0) + rng_next(&r) % 100);
        snprintf(path, sizeof path, "%s/img/%02d.png", dir, i);
        CHECK(stbi_write_png(path, 32, 32, 3, img, 32 * 3), "write");
        fprintf(csv, "img/%02d.png,%d\n", i, label);
    }
    fclose(csv);
    char args[1024], msg[4096];
    snprintf(
            args, sizeof args,
            "train --model effv2-t --head-hidden 16 --classes 2 --size 32x32 --batch 8 --epochs 20 "
            "--lr 0.01 --data %s/labels.csv --val %s/labels.csv --out %s",
            dir, dir, run);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "%s", msg);
    double acc[32], vacc[32];
    snprintf(path, sizeof path, "%s/metrics.csv", run);
    int n = csv_column(path, "accuracy", acc, 32);
    CHECK(n == 20 && csv_column(path, "val_accuracy", vacc, 32) == 20,
          "20 rows with accuracy and val_accuracy");
    for (int e = 0; e < n; e++)
        CHECK(acc[e] >= 0 && acc[e] <= 1 && vacc[e] >= 0 && vacc[e] <= 1, "accuracy in [0,1]");
    double vl[32];
    CHECK(csv_column(path, "val_loss", vl, 32) == 20, "val_loss column");
    // the best epoch's validation (a minimum over the run) and the highest train
    // accuracy: the last epoch's alone is one point of an Adam trajectory at lr
    // 0.01 and batch 8, where a spike (0.81 after a change of rounding) is normal
    int best = 0, top = 0;
    for (int e = 1; e < n; e++) {
        if (vl[e] < vl[best]) best = e;
        if (acc[e] > acc[top]) top = e;
    }
    CHECK(vacc[best] == 1.0 && acc[top] > 0.9,
          "dark vs bright learnt: val accuracy %g at the best epoch %d, train at most %g",
          vacc[best], best + 1, acc[top]);
    // eval of the run prints the best epoch's validation figures
    snprintf(args, sizeof args, "eval --run %s", run);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "%s", msg);
    size_t len;
    char *out = read_file("/tmp/segnet_test_out.txt", &len);
    CHECK(out && contains(out, "val_loss: ") && contains(out, "val_accuracy: "), "eval output: %s",
          out ? out : "");
    free(out);
    if (!getenv("SEGNET_KEEP")) { rm_rf(dir); rm_rf(run); }
}

// segnet eval --run: the loss and mIoU of best.safetensors, as metrics.csv recorded them
TEST(eval_matches_run) {
    const char *data = "/tmp/segnet_test_eval_data", *run = "/tmp/segnet_test_eval_run";
    rm_rf(data); rm_rf(run);
    write_seg_set(data, 4, 8, 8, 7);
    char args[1024], msg[4096], path[600];
    snprintf(args, sizeof args,
             "train --model unet --depth 1 --width 4 --size 8x8 --batch 2 --epochs 2 --classes 3 "
             "--class-weights 0,1,1 --data %s --val %s --out %s",
             data, data, run);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "%s", msg);
    double vl[4], vm[4];
    snprintf(path, sizeof path, "%s/metrics.csv", run);
    CHECK(csv_column(path, "val_loss", vl, 4) == 2 && csv_column(path, "val_mIoU", vm, 4) == 2,
          "two rows");
    int best = vl[1] < vl[0] ? 1 : 0;
    snprintf(path, sizeof path, "%s/last.safetensors", run);
    CHECK(unlink(path) == 0, "remove %s: eval --run reads best.safetensors only", path);
    snprintf(args, sizeof args, "eval --run %s", run);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "%s", msg);
    size_t len;
    char *out = read_file("/tmp/segnet_test_out.txt", &len);
    double loss = NAN, miou = NAN;
    const char *p;
    if (out && (p = strstr(out, "val_loss: "))) loss = strtod(p + 10, NULL);
    if (out && (p = strstr(out, "val_mIoU: "))) miou = strtod(p + 10, NULL);
    CHECK_NEAR(loss, vl[best], 2e-6, "eval val_loss vs metrics.csv");
    CHECK_NEAR(miou, vm[best], 2e-6, "eval val_mIoU vs metrics.csv");
    CHECK(out && contains(out, "val_pixel_accuracy: ") && contains(out, "val_IoU_1: ") &&
                  !contains(out, "val_IoU_0"),
          "per-class lines for the weighted classes: %s", out ? out : "");
    free(out);
    rm_rf(data); rm_rf(run);
}

// Bad arguments and bad run folders: one clear line, non-zero exit, and every
// file of an existing run folder unchanged.
TEST(train_bad_input) {
    const char *data = "/tmp/segnet_test_bad_data", *run = "/tmp/segnet_test_bad_run";
    rm_rf(data); rm_rf(run);
    write_seg_set(data, 2, 8, 8, 6);
    char args[1024], msg[4096];
    const char *base = "train --model unet --depth 1 --width 2 --size 8x8 --batch 2 --epochs 1";
    struct { const char *extra, *want; int rc; } cases[] = {
        {"--classes 3 --class-weights 1,1", "has 2 values but there are 3 classes", 2},
        {"--classes 3 --class-weights 1,1,1,1", "has 4 values but there are 3 classes", 2},
        {"--classes 3 --class-weights 1,-1,1", "item 2 is not a number", 2},
        {"--classes 3 --class-weights 1,x,1", "item 2 is not a number", 2},
        {"--classes 3 --bogus 1", "unknown option '--bogus'", 2},
        {"--classes 3 --schedule linear", "--schedule 'linear'", 2},
        {"--classes 3 --augment flip,blur", "--augment item 'blur'", 2},
        {"--classes 3 --early-stopping 2", "needs a validation set", 1},
        {"--classes 2", "pixel", 1},  // masks hold class 2: out of range for 2 classes
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        snprintf(args, sizeof args, "%s --data %s --out %s/r%zu %s", base, data, run, k,
                 cases[k].extra);
        int rc = run_segnet(args, msg, sizeof msg);
        CHECK(rc == cases[k].rc && contains(msg, cases[k].want),
              "`segnet %s`: exit %d, message: %s", args, rc, msg);
        CHECK(strchr(msg, '\n') == msg + strlen(msg) - 1, "one line: %s", msg);
    }
    snprintf(args, sizeof args, "train --model unet9 --data %s --classes 3 --out %s/m", data, run);
    CHECK(run_segnet(args, msg, sizeof msg) == 1 && contains(msg, "unknown model 'unet9'"), "%s",
          msg);
    // a finished run: neither a new run over it nor a bad resume changes a byte
    snprintf(args, sizeof args, "%s --data %s --classes 3 --out %s/ok", base, data, run);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "%s", msg);
    const char *files[] = {"config.txt", "metrics.csv", "curves.svg", "last.safetensors",
                           "best.safetensors"};
    size_t sizes[5];
    char *before[5], path[600];
    for (int f = 0; f < 5; f++) {
        snprintf(path, sizeof path, "%s/ok/%s", run, files[f]);
        before[f] = read_file(path, &sizes[f]);
    }
    CHECK(run_segnet(args, msg, sizeof msg) == 1 && contains(msg, "already holds a run"), "%s",
          msg);
    snprintf(args, sizeof args, "train --resume %s/nothing", run);
    CHECK(run_segnet(args, msg, sizeof msg) == 2 && contains(msg, "nothing/config.txt"), "%s", msg);
    // a truncated checkpoint
    snprintf(path, sizeof path, "%s/ok/last.safetensors", run);
    char *ck = before[3];
    if (!ck) {
        CHECK(0, "no checkpoint was written");
        for (int f = 0; f < 5; f++) free(before[f]);
        rm_rf(data);
        rm_rf(run);
        return;
    }
    FILE *f = fopen(path, "wb");
    fwrite(ck, 1, sizes[3] / 2, f);
    fclose(f);
    snprintf(args, sizeof args, "train --resume %s/ok --epochs 3", run);
    CHECK(run_segnet(args, msg, sizeof msg) == 1 && contains(msg, "last.safetensors"), "%s", msg);
    size_t n_trunc;
    char *trunc = read_file(path, &n_trunc);
    CHECK(trunc && n_trunc == sizes[3] / 2 && !memcmp(trunc, ck, n_trunc),
          "the truncated checkpoint was left as it was");
    free(trunc);
    f = fopen(path, "wb");
    fwrite(ck, 1, sizes[3], f);
    fclose(f);
    for (int k = 0; k < 5; k++) {
        size_t n;
        snprintf(path, sizeof path, "%s/ok/%s", run, files[k]);
        char *after = read_file(path, &n);
        CHECK(before[k] && after && n == sizes[k] && !memcmp(before[k], after, n), "%s changed",
              files[k]);
        free(after); free(before[k]);
    }
    rm_rf(data); rm_rf(run);
}

// A heavy check (SEGNET_HEAVY=1, `make test-heavy`: minutes, so not in make test).
// fp32, bf16 and fp16 storage train the bundled data set (the quickstart of
// `make train`, 12 epochs) to within 0.02 val mIoU of each other. Mid-run the
// curves wander apart by up to 0.1 (rounding makes the runs different
// trajectories), so only whole runs are compared.
static double quickstart_miou(const char *precision) {
    char out[256], cmd[2048];
    snprintf(out, sizeof out, "/tmp/segnet_test_%ld_precision_%s", (long)getpid(), precision);
    snprintf(cmd, sizeof cmd,
             "rm -rf %s && ./segnet train %s --precision %s --device cpu --out %s 2>%s.log "
             "| sed -n 's/^val_mIoU: //p'",
             out, QUICKSTART_ARGS, precision, out, out);
    FILE *f = popen(cmd, "r");
    double miou = NAN;
    if (!f || fscanf(f, "%lf", &miou) != 1) miou = NAN;
    if (f) pclose(f);
    CHECK(!isnan(miou), "segnet train --precision %s printed no val_mIoU: see %s.log", precision,
          out);
    if (isnan(miou)) snprintf(cmd, sizeof cmd, "rm -rf %s", out);
    else snprintf(cmd, sizeof cmd, "rm -rf %s %s.log", out, out);
    CHECK(system(cmd) == 0, "cleanup");
    printf("    %s: val mIoU %.4f\n", precision, miou);
    return miou;
}
TEST(heavy_precision_miou) {
    double m32 = quickstart_miou("fp32"), m16 = quickstart_miou("fp16"),
           mb16 = quickstart_miou("bf16");
    CHECK(m32 > 0.85, "fp32 quickstart reached val mIoU %.4f (want > 0.85)", m32);
    CHECK(fabs(m16 - m32) <= 0.02, "fp16 val mIoU %.4f vs fp32 %.4f: more than 0.02 apart", m16,
          m32);
    CHECK(fabs(mb16 - m32) <= 0.02, "bf16 val mIoU %.4f vs fp32 %.4f: more than 0.02 apart", mb16,
          m32);
}

// ----------------------------------------------------------------------------
// the optimisation diagnostics (metrics.csv's last columns, steps.csv, the warnings),
// and curves.svg

// fd 2 into a file while `run` runs; the file's text (malloc'd)
static char *with_stderr_captured(int (*run)(void *), void *arg, int *rc) {
    char path[128];
    snprintf(path, sizeof path, "/tmp/segnet_test_%ld_stderr.txt", (long)getpid());
    fflush(stderr);
    int saved = dup(2), fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 2);
    close(fd);
    *rc = run(arg);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    char *text = read_text(path);
    unlink(path);
    return text ? text : strdup("");
}

typedef struct { TrainCfg *c; char err[SN_ERR_MAX]; } TrainJob;
static int train_job(void *arg) { TrainJob *j = arg; return train_run(j->c, NULL, j->err); }

// One step per epoch (the batch holds the 4 images), so each epoch's columns are
// one step's, computed here again from the formulas:
// - lr 0 and --clipnorm 1e-6: the gradient norm is ‖g‖ of the step's gradient
//   (the same first step run here, its gradient read back), clipping acts on
//   every step, the weights do not move (update ratio 0), and the clipping
//   warning names the figures; steps.csv's rows are the epochs' (--log-every 1).
// - lr 1e-3, no clipping: Adam's first step moves weight i by lr·g/(|g| + ε/√(1-β2))
//   (m = (1-β1)g, v = (1-β2)g², α = lr·√(1-β2)/(1-β1)), so the epoch-1 update ratio
//   is lr·‖g/(|g| + ε')‖/‖w0‖, w0 the initial weights (6 digits in the file; fp32
//   weights: 1e-5 of the difference).
// - fp16 with the first step's gradients overflowing: that epoch skips 1 of 1
//   steps (no update: ratio 0, no norm), the loss scale is halved, the next
//   epoch applies its step; the overflow warning fires.
TEST(train_diagnostics) {
    const char *data = "/tmp/segnet_test_diag_data", *run = "/tmp/segnet_test_diag_run";
    rm_rf(data); rm_rf(run);
    write_seg_set(data, 4, 8, 8, 41);
    char metrics[300], steps[300], err[SN_ERR_MAX];
    snprintf(metrics, sizeof metrics, "%s/metrics.csv", run);
    snprintf(steps, sizeof steps, "%s/steps.csv", run);
    TrainCfg c = tiny_seg_cfg(data, NULL);
    c.model.batch = 4;
    c.epochs = 2;
    c.threads = 1;
    c.out = run;
    c.progress = 1;  // the warnings are part of the progress output

    // the same first step in-process: its gradient g and the initial weights w0
    Trainer t;
    CHECK(trainer_open(&t, &c, data, NULL, err) == 0, "%s", err);
    const size_t P = t.n_trainable;
    float *w0 = malloc(sizeof(float) * P), *g = malloc(sizeof(float) * P);
    // every parameter is trainable: one range
    t.o->download(t.o, w0, t.net.params, sizeof(float) * P);
    CHECK(t.n_ranges == 1 && t.ranges[0].offset == 0 && t.ranges[0].count == P,
          "one range of trainable weights");
    int64_t cm[9];
    PassTotals pt = {.cm = cm};
    CHECK(run_pass(&t, &t.train, 1, &pt, err) == 0, "%s", err);
    t.o->download(t.o, g, t.net.grads, sizeof(float) * P);
    trainer_close(&t);
    double gg = 0, ww = 0, uu = 0;
    const double eps = ADAM_EPS / sqrt(1.0 - ADAM_BETA2);
    for (size_t i = 0; i < P; i++) {
        gg += (double)g[i] * g[i];
        ww += (double)w0[i] * w0[i];
        const double u = g[i] / (fabs(g[i]) + eps);
        uu += u * u;
    }

    c.lr = 0.0f;
    c.clipnorm = 1e-6f;
    c.log_every = 1;
    TrainJob job = {&c, ""};
    int rc;
    char *out = with_stderr_captured(train_job, &job, &rc);
    CHECK(rc == 0, "%s", job.err);
    for (int e = 1; e <= 2; e++) {
        char *norm = csv_field_text(metrics, "grad_norm_mean", e),
             *max = csv_field_text(metrics, "grad_norm_max", e);
        char *clip = csv_field_text(metrics, "clip_fraction", e),
             *ratio = csv_field_text(metrics, "update_ratio", e);
        char *scale = csv_field_text(metrics, "loss_scale", e),
             *skipped = csv_field_text(metrics, "skipped_steps", e);
        char *ms = csv_field_text(metrics, "step_ms", e),
             *snorm = csv_field_text(steps, "grad_norm_mean", e);
        char *sstep = csv_field_text(steps, "step", e);
        CHECK(fabs(atof(norm) / sqrt(gg) - 1) < 1e-5 && !strcmp(norm, max),
              "epoch %d: gradient norm %s (max %s), by hand %.6g", e, norm, max, sqrt(gg));
        CHECK(!strcmp(clip, "1") && !strcmp(ratio, "0") && !strcmp(scale, "1") &&
                      !strcmp(skipped, "0"),
              "epoch %d: clip fraction %s, update ratio %s, loss scale %s, skipped %s", e, clip,
              ratio, scale, skipped);
        CHECK(atof(ms) > 0 && isfinite(atof(ms)), "epoch %d: step_ms '%s'", e, ms);
        CHECK(atoi(sstep) == e && !strcmp(snorm, norm),
              "steps.csv row %d: step %s, norm %s (metrics.csv %s)", e, sstep, snorm, norm);
        free(norm);
        free(max);
        free(clip);
        free(ratio);
        free(scale);
        free(skipped);
        free(ms);
        free(snorm);
        free(sstep);
    }
    CHECK(contains(out, "warning: epoch 1: --clipnorm 1e-06 scaled down the gradients of 100% of "
                        "the steps") &&
                  count_substr(out, "warning") == 1 && !contains(out, "note:"),
          "the clipping warning, once: %s", out);
    free(out);

    rm_rf(run);
    c.lr = 1e-3f;
    c.clipnorm = 0.0f;
    c.log_every = 0;
    out = with_stderr_captured(train_job, &job, &rc);
    CHECK(rc == 0, "%s", job.err);
    char *ratio = csv_field_text(metrics, "update_ratio", 1),
         *clip = csv_field_text(metrics, "clip_fraction", 1);
    const double want = c.lr * sqrt(uu / ww);
    CHECK(fabs(atof(ratio) / want - 1) < 1e-4 && !strcmp(clip, "0"),
          "update ratio %s, by hand %.6g; clip fraction %s", ratio, want, clip);
    CHECK(!contains(out, "warning") && access(steps, F_OK) != 0, "no warning, no steps.csv: %s",
          out);
    free(ratio); free(clip); free(out);

    rm_rf(run);
    c.precision = DT_F16;
    c.overflow_at_step = 1;
    out = with_stderr_captured(train_job, &job, &rc);
    CHECK(rc == 0, "%s", job.err);
    char *f[2][4];
    const char *names[4] = {"skipped_steps", "loss_scale", "update_ratio", "grad_norm_mean"};
    for (int e = 0; e < 2; e++)
        for (int k = 0; k < 4; k++) f[e][k] = csv_field_text(metrics, names[k], e + 1);
    CHECK(!strcmp(f[0][0], "1") && !strcmp(f[0][1], "16384") && !strcmp(f[0][2], "0") &&
                  !strcmp(f[0][3], ""),
          "epoch 1: skipped %s, scale %s, ratio %s, norm '%s'", f[0][0], f[0][1], f[0][2], f[0][3]);
    // epoch 2's step is the first one applied, at w0 on the same batch: the fp32 run's ‖g‖
    // unscaled, to 10 fp16 roundings (2^-11 each) of the activations (measured 3e-4); a scale left
    // in: 16384 times it
    CHECK(!strcmp(f[1][0], "0") && !strcmp(f[1][1], "16384") && atof(f[1][2]) > 0 &&
                  fabs(atof(f[1][3]) / sqrt(gg) - 1) < 5e-3,
          "epoch 2: skipped %s, scale %s, ratio %s, norm %s (fp32 %.6g)", f[1][0], f[1][1], f[1][2],
          f[1][3], sqrt(gg));
    if (g_verbose) printf("    fp16 gradient norm %s, fp32 %.6g\n", f[1][3], sqrt(gg));
    CHECK(contains(out, "warning: epoch 1: fp16 overflow skipped 1 of 1 steps") &&
                  contains(out, "16384 now"),
          "the overflow warning: %s", out);
    for (int e = 0; e < 2; e++)
        for (int k = 0; k < 4; k++) free(f[e][k]);
    free(out);
    free(w0); free(g);
    rm_rf(data); rm_rf(run);
}

// checks of one curves.svg: one element, no non-finite numbers, every marker
// inside the plot areas, `polylines` series, the labels
static void check_svg(const char *path, int polylines, int circles, const char *metric,
                      const char *what) {
    char *s = read_text(path);
    CHECK(s != NULL, "%s: %s not written", what, path);
    if (!s) return;
    size_t n = strlen(s);
    while (n && isspace((unsigned char)s[n - 1])) s[--n] = 0;
    CHECK(!strncmp(s, "<svg ", 5) && n > 6 && !strcmp(s + n - 6, "</svg>"),
          "%s: starts with <svg, ends with </svg>", what);
    CHECK(count_substr(s, "<svg") == 1 && count_substr(s, "<g>") == 4 &&
                  count_substr(s, "</g>") == 4,
          "%s: element nesting", what);
    CHECK(count_substr(s, "<") == count_substr(s, ">"), "%s: every < has its >", what);
    CHECK(count_substr(s, "<polyline") == polylines, "%s: %d polylines, expected %d", what,
          count_substr(s, "<polyline"), polylines);
    CHECK(count_substr(s, "<circle") == circles, "%s: %d markers, expected %d", what,
          count_substr(s, "<circle"), circles);
    CHECK(count_substr(s, ">epoch<") == 4 && count_substr(s, ">loss<") == 2 &&
                  count_substr(s, metric) == 2 && count_substr(s, ">gradient norm<") == 2 &&
                  count_substr(s, ">learning rate<") == 2,
          "%s: axis labels and titles", what);
    for (const char *p = s; (p = strstr(p, "<circle cx=\"")); p++) {
        double cx = strtod(p + 12, NULL), cy = strtod(strstr(p, "cy=\"") + 4, NULL);
        int in_panel = 0;
        for (int k = 0; k < 4; k++) {
            const double x0 = (k % 2) * SVG_PANEL_W, y0 = (k / 2) * SVG_PANEL_H;
            in_panel |= cx >= x0 + SVG_LEFT && cx <= x0 + SVG_PANEL_W - SVG_RIGHT &&
                        cy >= y0 + SVG_TOP && cy <= y0 + SVG_PANEL_H - SVG_BOTTOM;
        }
        CHECK(in_panel, "%s: marker (%g, %g) outside the plots", what, cx, cy);
    }
    for (char *p = s; *p; p++) *p = (char)tolower((unsigned char)*p);
    CHECK(!strstr(s, "nan") && !strstr(s, "inf"), "%s: a non-finite number in the output", what);
    free(s);
}

// an epoch's figures without its diagnostics; then set_diagnostics
#define EPOCH(e, lr_, loss_, val_loss_, metric_, val_metric_) \
    {.epoch = e, .lr = lr_, .loss = loss_, .val_loss = val_loss_, .metric = metric_, \
     .val_metric = val_metric_}
// an epoch's diagnostics (EpochRecord's last fields)
static void set_diagnostics(EpochRecord *r, double mean, double max, double clip, double scale,
                            double skipped, double ratio) {
    r->grad_norm_mean = mean;
    r->grad_norm_max = max;
    r->clip_fraction = clip;
    r->loss_scale = scale;
    r->skipped_steps = skipped; r->update_ratio = ratio; r->step_ms = 10;
}

// Series counted by hand: loss and metric (train, val), the gradient norm (mean,
// max, the loss scale when it is not 1), the learning rate and the update ratio.
TEST(curves_svg) {
    char path[256], err[SN_ERR_MAX];
    snprintf(path, sizeof path, "/tmp/segnet_test_%ld_curves.svg", (long)getpid());
    EpochRecord rows[3] = {EPOCH(1, 1e-3, 1.25, 1.5, 0.3, 0.25),
                           EPOCH(2, 1e-3, 0.75, NAN, 0.5, NAN), EPOCH(3, 5e-4, 0.5, 0.9, 0.7, 0.6)};
    set_diagnostics(&rows[0], 2, 5, 0.5, 32768, 0, 1e-3);
    set_diagnostics(&rows[1], 3, 9, 1, 16384, 2, 8e-4);
    set_diagnostics(&rows[2], 2.5, 4, 0.25, 16384, 0, 5e-4);
    const CurveMarks marks = {3, 4.0};
    CHECK(write_curves_svg(path, rows, 3, "mIoU", &marks, err) == 0, "%s", err);
    check_svg(path, 9, 25, ">mIoU<", "3 epochs, a missing val, fp16 and clipping");
    char *text = read_text(path);
    CHECK(text && count_substr(text, ">best<") == 4 && count_substr(text, ">clipnorm<") == 1 &&
                  count_substr(text, "<path") == 2 && count_substr(text, ">skipped steps<") == 1 &&
                  count_substr(text, ">loss scale<") == 1,
          "the best epoch in 4 panels, the clip line, one epoch with skipped steps and its legend, "
          "the loss scale");
    free(text);
    for (int i = 0; i < 3; i++) {  // a run from before the diagnostics, without validation
        rows[i].val_loss = rows[i].val_metric = NAN;
        set_diagnostics(&rows[i], NAN, NAN, NAN, NAN, NAN, NAN);
    }
    CHECK(write_curves_svg(path, rows, 3, "accuracy", NULL, err) == 0, "%s", err);
    check_svg(path, 3, 9, ">accuracy<", "no validation, no diagnostics");
    CHECK(write_curves_svg(path, rows, 1, "a<b", NULL, err) == 0, "%s", err);
    check_svg(path, 3, 3, ">a&lt;b<", "one epoch, an escaped name");
    EpochRecord flat[2] = {EPOCH(1, 1e-3, 0, 0, 0, 0), EPOCH(2, 1e-3, 0, 0, 0, 0)};
    for (int i = 0; i < 2; i++) set_diagnostics(&flat[i], 0, 0, 0, 1, 0, 0);
    CHECK(write_curves_svg(path, flat, 2, "mIoU", NULL, err) == 0, "%s", err);
    check_svg(path, 8, 16, ">mIoU<", "all values 0");
    EpochRecord huge[3] = {EPOCH(1, 1e-3, DBL_MAX, -DBL_MAX, 0.1, INFINITY),
                           EPOCH(2, 1e-3, 1e300, 3, 0.2, 2), EPOCH(3, 1e-3, INFINITY, 1, NAN, 0.5)};
    set_diagnostics(&huge[0], DBL_MAX, INFINITY, 1, 65536, 0, NAN);
    set_diagnostics(&huge[1], NAN, 1e300, 0, 1, 1, INFINITY);
    set_diagnostics(&huge[2], INFINITY, NAN, 0, 2, 0, NAN);
    CHECK(write_curves_svg(path, huge, 3, "mIoU", NULL, err) == 0, "%s", err);
    // loss 2 + metric 2 + norm mean, max, scale 3 + lr 1 series; 5 + 4 + (1 + 1 + 3) + 3 markers
    check_svg(path, 8, 17, ">mIoU<", "huge and infinite values");
    unlink(path);
    CHECK(write_curves_svg("/nonexistent/dir/curves.svg", rows, 3, "mIoU", NULL, err) == -1 &&
          contains(err, "/nonexistent/dir/curves.svg"), "unwritable: '%s'", err);
}

// Text boxes of a curves.svg that overlap, within a panel (<g>): each text's box from its x, y,
// anchor and size (default 12), a character 0.64 em wide at most (DejaVu Sans' digits: 0.636)
// and the glyphs from 0.8 em above the baseline to 0.2 em below; rotate(-90) about (x, y) turns
// it. The first overlap in *why.
static int svg_text_overlaps(const char *svg, char *why, size_t cap) {
    int overlaps = 0;
    for (const char *g = strstr(svg, "<g>"); g; g = strstr(g + 1, "<g>")) {
        const char *end = strstr(g, "</g>");
        double box[128][4];
        char text[128][48];
        int n = 0;
        for (const char *t = strstr(g, "<text "); t && t < end && n < 128;
             t = strstr(t + 1, "<text ")) {
            const char *close = strchr(t, '>'), *stop = strstr(t, "</text>"), *a;
            double x = (a = strstr(t, " x=\"")) && a < close ? strtod(a + 4, NULL) : 0,
                   y = (a = strstr(t, " y=\"")) && a < close ? strtod(a + 4, NULL) : 0,
                   fs = (a = strstr(t, "font-size=\"")) && a < close ? strtod(a + 11, NULL) : 12;
            a = strstr(t, "text-anchor=\"");
            const char anchor = a && a < close ? a[13] : 's';  // start, middle, end
            const int rotated = (a = strstr(t, "rotate(-90")) && a < close;
            int chars = 0;
            for (const char *c = close + 1; c < stop; c++) {
                if (*c == '&') c = strchr(c, ';');
                else if (((unsigned char)*c & 0xc0) == 0x80) continue;  // UTF-8 continuation
                chars++;
            }
            const double w = 0.64 * fs * chars,
                         along = anchor == 'm' ? -w / 2 : anchor == 'e' ? -w : 0;
            if (rotated) {  // (x + dx, y + dy) → (x + dy, y − dx)
                box[n][0] = x - 0.8 * fs; box[n][1] = x + 0.2 * fs;
                box[n][2] = y - along - w; box[n][3] = y - along;
            } else {
                box[n][0] = x + along; box[n][1] = x + along + w;
                box[n][2] = y - 0.8 * fs; box[n][3] = y + 0.2 * fs;
            }
            const int len = (int)(stop - close - 1 < 40 ? stop - close - 1 : 40);
            snprintf(text[n], sizeof text[n], "%.*s", len, close + 1);
            for (int i = 0; i < n; i++)
                if (box[i][0] < box[n][1] && box[n][0] < box[i][1] && box[i][2] < box[n][3] &&
                    box[n][2] < box[i][3] && !overlaps++)
                    snprintf(why, cap,
                             "'%.40s' (%.1f..%.1f, %.1f..%.1f) and "
                             "'%.40s' (%.1f..%.1f, %.1f..%.1f)",
                             text[i], box[i][0], box[i][1], box[i][2], box[i][3], text[n],
                             box[n][0], box[n][1], box[n][2], box[n][3]);
            n++;
        }
    }
    return overlaps;
}

// Gap 6: curves.svg stays readable. Tick labels of 7 characters (an lr of 1e-4) beside the axis
// title, "best" at the first epoch (the top-left tick) and at the last (the right axis' top
// tick): no text box overlaps another. A first epoch's gradient spike (50, then 2 .. 1) leaves
// the later epochs apart: on a linear axis to 100 they would span 2.7 px, on the log axis 41.
TEST(curves_svg_readable) {
    char path[256], err[SN_ERR_MAX], why[400] = "";
    snprintf(path, sizeof path, "/tmp/segnet_test_%ld_curves_readable.svg", (long)getpid());
    EpochRecord rows[5];
    const double norm[5] = {50, 2, 1.5, 1.2, 1}, lr[5] = {1.2e-4, 1e-4, 8e-5, 6e-5, 4e-5};
    for (int i = 0; i < 5; i++) {
        rows[i] = (EpochRecord)EPOCH(i + 1, lr[i], 1.0 / (i + 1), 1.2 / (i + 1), 0.1 * i, 0.1 * i);
        set_diagnostics(&rows[i], norm[i], 1.6 * norm[i], 0, 1, 0, 1e-3 / (i + 1));
    }
    for (int best = 1; best <= 5; best += 4) {
        const CurveMarks marks = {best, 0};
        CHECK(write_curves_svg(path, rows, 5, "mIoU", &marks, err) == 0, "%s", err);
        check_svg(path, 8, 40, ">mIoU<", "a gradient spike, small learning rates");
        char *s = read_text(path);
        why[0] = 0;
        CHECK(s && svg_text_overlaps(s, why, sizeof why) == 0, "best epoch %d: text overlaps: %s",
              best, why);
        // the gradient panel (bottom left): the mean's markers after the spike
        double lo = 1e9, hi = -1e9;
        int seen = 0;
        for (const char *p = s; p && (p = strstr(p, "<circle cx=\"")); p++) {
            const double cx = strtod(p + 12, NULL), cy = strtod(strstr(p, "cy=\"") + 4, NULL);
            if (cx < SVG_PANEL_W && cy > SVG_PANEL_H && strstr(p, "fill=\"#1f77b4\"") &&
                strstr(p, "fill=\"#1f77b4\"") < strchr(p, '>') && seen++ > 0) {
                lo = fmin(lo, cy);
                hi = fmax(hi, cy);
            }
        }
        CHECK(seen == 5 && hi - lo > 30,
              "the gradient norms 2 .. 1 after 50: %d markers %.1f px apart", seen, hi - lo);
        free(s);
    }
    unlink(path);
}

typedef struct { const Trainer *t; const EpochRecord *r, *prev; int *warned; } WarnCall;
static int warn_call(void *arg) {
    WarnCall *w = arg;
    training_warnings(w->t, w->r, w->prev, w->warned);
    return 0;
}

// The warnings on constructed epochs: each fires at the first epoch where it
// holds, once, with its figures; figures that do not call for one print
// nothing (the quickstart's epochs 2 and 7: train just below val, then above).
TEST(training_warnings) {
    TrainCfg c;
    train_cfg_default(&c);
    c.clipnorm = 1.0f;
    Trainer t = {0};
    t.c = &c;
    t.has_val = 1;
    t.segmentation = 1;
    struct { EpochRecord r; StepStats st; const char *want;
    } cases[] = {
            {EPOCH(2, 1e-3, 0.52, 0.43, 0.4355, 0.4430), {.steps = 60, .clipped = 30}, NULL},
            {EPOCH(7, 1e-3, 0.08, 0.15, 0.9344, 0.7611),
             {.steps = 60, .skipped = 3, .skip_run_max = 3},
             NULL},
            {EPOCH(3, 1e-3, 0.5, 0.5, 0.5, 0.5),
             {.steps = 60, .clipped = 31},
             "--clipnorm 1 scaled down the gradients of 52%"},
            {EPOCH(4, 1e-3, 0.5, 0.5, 0.5, 0.5), {.steps = 60, .clipped = 60}, NULL},  // once
            {EPOCH(5, 1e-3, 0.5, 0.5, 0.5, 0.5),
             {.steps = 60, .skipped = 4, .skip_run_max = 1},
             "skipped 4 of 60 steps"},
            {EPOCH(6, 1e-3, 0.5, 0.5, 0.6, 0.7),
             {.steps = 60},
             "train mIoU 0.600 is below val_mIoU 0.700"},
            {EPOCH(7, 1e-3, 0.5, 0.5, 0.5, 0.7), {.steps = 60}, NULL},  // once
    };
    int warned[3] = {0, 0, 0};
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        cases[k].r.clip_fraction =
                cases[k].st.steps ? (double)cases[k].st.clipped / cases[k].st.steps : 0;
        cases[k].r.loss_scale = 1;
        t.epoch_stats = cases[k].st;
        int rc;
        WarnCall a = {&t, &cases[k].r, NULL, warned};
        char *out = with_stderr_captured(warn_call, &a, &rc);
        if (cases[k].want)
            CHECK(contains(out, cases[k].want) && count_substr(out, "\n") == 1,
                  "epoch %d: '%s' should say '%s' on one line", cases[k].r.epoch, out,
                  cases[k].want);
        else CHECK(!out[0], "epoch %d: nothing to say, but: %s", cases[k].r.epoch, out);
        free(out);
    }
    // a train metric falling while the validation one holds
    int fresh[3] = {0, 0, 0};
    EpochRecord prev = EPOCH(8, 1e-3, 0.3, 0.3, 0.90, 0.75),
                now = EPOCH(9, 1e-3, 0.4, 0.3, 0.82, 0.76);
    t.epoch_stats = (StepStats){.steps = 60};
    WarnCall b = {&t, &now, &prev, fresh};
    int rc;
    char *out = with_stderr_captured(warn_call, &b, &rc);
    CHECK(contains(out, "train mIoU fell from 0.900 to 0.820 while val_mIoU held (0.760)") &&
                  contains(out, "--train-eval"),
          "falling train metric: %s", out);
    free(out);
    c.train_eval = 1;  // with --train-eval the two compare like with like already
    fresh[2] = 0;
    out = with_stderr_captured(warn_call, &b, &rc);
    CHECK(!out[0], "--train-eval: nothing to say, but %s", out);
    free(out);
}

// ----------------------------------------------------------------------------
// checkpoints, resume and interruptions: a run stopped anywhere ends where an
// uninterrupted one ends; its folder is claimed; a run that stops being finite saves nothing

// save_checkpoint then load_checkpoint into a fresh trainer gives back exactly
// what was set: the counters, a best loss with no short decimal form (1/3), the
// Adam moments, the weights and the BN statistics.
TEST(checkpoint_round_trip) {
    const char *dir = "/tmp/segnet_test_ckpt", *path = "/tmp/segnet_test_ckpt/c.safetensors";
    rm_rf(dir);
    write_seg_set(dir, 2, 8, 8, 16);
    TrainCfg c = tiny_seg_cfg(dir, NULL);
    Trainer a, b;
    char err[SN_ERR_MAX];
    CHECK(trainer_open(&a, &c, NULL, NULL, err) == 0 && trainer_open(&b, &c, NULL, NULL, err) == 0,
          "%s", err);
    const size_t P = a.g.n_param_floats, B = a.g.n_buffer_floats;
    Rng r;
    rng_seed(&r, 17);
    for (size_t i = 0; i < P; i++) {
        a.net.params[i] = rng_normal(&r);
        a.adam_m[i] = rng_normal(&r);
        a.adam_v[i] = rng_float(&r);
    }
    for (size_t i = 0; i < B; i++) a.net.buffers[i] = rng_float(&r) + 0.5f;
    a.epoch = 7;
    a.step = 123456789012LL;
    a.best = 1.0 / 3.0;
    a.best_epoch = 5;
    a.bad_epochs = 2;
    a.finished = 1;
    PassSaved ps;
    CHECK(save_checkpoint(&a, path, NULL, err) == 0, "%s", err);
    CHECK(load_checkpoint(&b, path, &ps, err) == 0 && ps.batch == 0, "%s", err);
    CHECK(b.epoch == 7 && b.step == 123456789012LL && b.best_epoch == 5 && b.bad_epochs == 2 &&
                  b.finished == 1,
          "counters: epoch %d, step %" PRId64 ", best epoch %d, bad epochs %d, finished %d",
          b.epoch, b.step, b.best_epoch, b.bad_epochs, b.finished);
    CHECK(b.best == 1.0 / 3.0, "best loss %.17g, want 1/3 exactly", b.best);
    CHECK(!memcmp(a.net.params, b.net.params, sizeof(float) * P) &&
                  !memcmp(a.adam_m, b.adam_m, sizeof(float) * P) &&
                  !memcmp(a.adam_v, b.adam_v, sizeof(float) * P) &&
                  !memcmp(a.net.buffers, b.net.buffers, sizeof(float) * B),
          "weights, Adam moments or BN statistics differ after the round trip");
    trainer_close(&a); trainer_close(&b);
    rm_rf(dir);
}

// A copy of the checkpoint at path with metadata key set to value (added if absent).
static void checkpoint_with_meta(const char *path, const char *key, const char *value) {
    SafetensorsFile f;
    char err[SN_ERR_MAX];
    if (safetensors_read(path, &f, err)) { CHECK(0, "%s", err); return; }
    const char *keys[32], *values[32];
    int n = 0, set = 0;
    for (int i = 0; i < f.n_meta && n < 31; i++, n++) {
        keys[n] = f.meta_keys[i];
        values[n] = strcmp(f.meta_keys[i], key) ? f.meta_values[i] : (set = 1, value);
    }
    if (!set) { keys[n] = key; values[n++] = value; }
    CHECK(safetensors_write(path, f.tensors, f.n_tensors, keys, values, n, err) == 0, "%s", err);
    safetensors_free(&f);
}

// Finding 1: a checkpoint's metadata is range-checked; a damaged one is refused
// naming the file and the field, and the run folder is left as it was.
TEST(checkpoint_metadata_checked) {
    const char *data = "/tmp/segnet_test_meta_data", *run = "/tmp/segnet_test_meta_run";
    rm_rf(data); rm_rf(run);
    write_seg_set(data, 4, 8, 8, 31);
    TrainCfg c = tiny_seg_cfg(data, NULL);
    c.epochs = 2;
    c.out = run;
    char err[SN_ERR_MAX], path[300];
    CHECK(train_run(&c, NULL, err) == 0, "%s", err);
    c.epochs = 3;
    snprintf(path, sizeof path, "%s/last.safetensors", run);
    size_t n;
    uint8_t *good = read_file_bytes(path, &n);
    CHECK(good != NULL, "no checkpoint");
    if (!good) { rm_rf(data); rm_rf(run); return; }
    struct { const char *key, *value, *key2, *value2, *want;
    } cases[] = {
            {"best_epoch", "100000000", NULL, NULL,
             "metadata 'best_epoch' is '100000000', not an integer in 0..2"},
            {"best_epoch", "-5", NULL, NULL, "metadata 'best_epoch' is '-5'"},
            {"best_epoch", "1", "best_loss", "-0x1p+10",
             "metadata 'best_loss' is -1024, but metrics.csv's epoch 1"},
            {"best_loss", "inf", NULL, NULL,
             "metadata 'best_loss' 'inf' does not fit 'best_epoch'"},
            {"step", "-9223372036854775807", NULL, NULL,
             "metadata 'step' is '-9223372036854775807'"},
            {"epoch", "2x", NULL, NULL, "metadata 'epoch' is '2x'"},
            {"loss_scale", "nan", NULL, NULL, "metadata 'loss_scale' is 'nan', not a number"},
            {"loss_scale", "-1", NULL, NULL, "metadata 'loss_scale' is '-1', not a positive float"},
            {"finished", "2", NULL, NULL, "metadata 'finished' is '2'"},
            {"batch", "999", "pass_totals", "0x0p+0 0x0p+0 0 0 0 0 0 0 0 0 0",
             "interrupted at batch 999 of an epoch"},
            {"batch", "1", "pass_totals", "0x0p+0 0x0p+0 1 2",
             "metadata 'pass_totals': replica 0, item 4"},
            {"batch", "1", NULL, NULL, "metadata has 'batch' without 'pass_totals'"},
            {"log_stats", "1 0 0 0 0 0x1p+0 0x1p+0 0x1p+0 0x1p+0 0x1p+0", NULL, NULL,
             "metadata 'log_stats': item 10 is not a number"},
            {"epoch_stats", "1 2 0 0 0 0x1p+0 0x1p+0 0x1p+0 0x1p+0 0x1p+0 nan", NULL, NULL,
             "metadata 'epoch_stats' is '1 2 0"},
            {"epoch_stats", "1 0 0 0 0 0x1p+0 0x1p+0 0x1p+0 -0x1p+0 0x1p+0 nan", NULL, NULL,
             "out of range"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        write_file_bytes(path, good, n);
        checkpoint_with_meta(path, cases[k].key, cases[k].value);
        if (cases[k].key2) checkpoint_with_meta(path, cases[k].key2, cases[k].value2);
        size_t n_before;
        uint8_t *before = read_file_bytes(path, &n_before);
        int rc = train_run(&c, run, err);
        CHECK(rc == -1 && contains(err, "last.safetensors") && contains(err, cases[k].want) &&
                      !strchr(err, '\n'),
              "%s = %s: rc %d, '%s' should say '%s'", cases[k].key, cases[k].value, rc,
              rc ? err : "", cases[k].want);
        size_t n_after;
        uint8_t *after = read_file_bytes(path, &n_after);
        CHECK(before && after && n_before == n_after && !memcmp(before, after, n_after),
              "%s: the checkpoint was changed", cases[k].key);
        free(before); free(after);
    }
    write_file_bytes(path, good, n);
    CHECK(train_run(&c, run, err) == 0, "the undamaged checkpoint resumes: %s", err);
    free(good);
    rm_rf(data); rm_rf(run);
}

// A run stopped after epoch 1 and resumed ends bit for bit where an
// uninterrupted run ends (weights, BN statistics, Adam moments, metrics.csv).
TEST(resume_bitwise) {
    const char *data = "/tmp/segnet_test_resume_data", *a = "/tmp/segnet_test_resume_a",
               *b = "/tmp/segnet_test_resume_b";
    rm_rf(data); rm_rf(a); rm_rf(b);
    write_seg_set(data, 6, 8, 8, 2);
    write_seg_set("/tmp/segnet_test_resume_data/val", 3, 8, 8, 3);
    char val[256];
    snprintf(val, sizeof val, "%s/val", data);
    TrainCfg c = tiny_seg_cfg(data, val);  // 6 images, batch 4: a smaller last batch
    c.epochs = 3;
    c.schedule = SCHEDULE_COSINE;
    c.warmup = 2;
    c.clipnorm = 0.5f;
    c.weight_decay = 0.01f;
    c.augment = (Augment){.flip = 1, .brightness = 0.1f, .contrast_lo = 0.8f, .contrast_hi = 1.2f};
    c.out = a;
    char err[SN_ERR_MAX];
    CHECK(train_run(&c, NULL, err) == 0, "%s", err);
    c.out = b;
    c.stop_after_epochs = 1;
    CHECK(train_run(&c, NULL, err) == 0, "%s", err);
    char pa[300], pb[300];
    snprintf(pa, sizeof pa, "%s/last.safetensors", a);
    snprintf(pb, sizeof pb, "%s/last.safetensors", b);
    CHECK(!files_equal(pa, pb), "the interrupted run stopped early");
    c.stop_after_epochs = 0;
    CHECK(train_run(&c, b, err) == 0, "resume: %s", err);
    const char *files[] = {"last.safetensors", "best.safetensors", "metrics.csv", "config.txt"};
    for (int k = 0; k < 4; k++) {
        snprintf(pa, sizeof pa, "%s/%s", a, files[k]);
        snprintf(pb, sizeof pb, "%s/%s", b, files[k]);
        CHECK(files_equal(pa, pb), "%s differs between the resumed and the uninterrupted run",
              files[k]);
    }
    // resuming a finished run changes nothing; more --epochs extend it
    CHECK(train_run(&c, b, err) == 0, "%s", err);
    snprintf(pb, sizeof pb, "%s/last.safetensors", b);
    snprintf(pa, sizeof pa, "%s/last.safetensors", a);
    CHECK(files_equal(pa, pb), "a finished run is left as it is");
    c.epochs = 4;
    CHECK(train_run(&c, b, err) == 0, "%s", err);
    double loss[8];
    snprintf(pb, sizeof pb, "%s/metrics.csv", b);
    CHECK(csv_column(pb, "loss", loss, 8) == 4, "the run was extended to 4 epochs");
    rm_rf(data); rm_rf(a); rm_rf(b);
}

// Interrupted after a step (SIGINT, here its test hook) and resumed, a run ends
// bit for bit where an uninterrupted one ends: mid-epoch 1 (no metrics.csv yet),
// mid-epoch 2, with --accum 2, with 2 replicas, and after the last step of an
// epoch (its validation runs again on resume); with the loss ce + dice and
// --iou-per-image (their totals in the checkpoint) over 2 micro-batches and over 2
// replicas. Resumed with another replica count it ends with the same totals up to
// their rounding.
TEST(interrupt_resume_bitwise) {
    const char *data = "/tmp/segnet_test_intr_data", *a = "/tmp/segnet_test_intr_a",
               *b = "/tmp/segnet_test_intr_b";
    rm_rf(data);
    write_seg_set(data, 10, 8, 8, 21);
    write_seg_set("/tmp/segnet_test_intr_data/val", 3, 8, 8, 22);
    char val[256], pa[300], pb[300], err[SN_ERR_MAX];
    snprintf(val, sizeof val, "%s/val", data);
    struct {
        const char *what;
        int batch, accum, replicas, resume_replicas;
        int64_t at_step;
        int steps_per_epoch;
        int menu;  // the loss ce + dice over the batch, and --iou-per-image
    } cases[] = {
            {"mid-epoch 1", 2, 1, 1, 1, 2, 5, 0},
            {"mid-epoch 2", 2, 1, 1, 1, 7, 5, 0},
            {"--accum 2", 2, 2, 1, 1, 4, 3, 0},
            {"2 replicas", 4, 1, 2, 2, 4, 3, 0},
            {"end of an epoch's steps", 2, 1, 1, 1, 5, 5, 0},
            {"2 replicas resumed by 1", 4, 1, 2, 1, 3, 3, 0},
            {"ce+dice, --iou-per-image, --accum 2", 2, 2, 1, 1, 4, 3, 1},
            {"ce+dice, --iou-per-image, 2 replicas", 4, 1, 2, 2, 4, 3, 1},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        rm_rf(a); rm_rf(b);
        TrainCfg c = tiny_seg_cfg(data, val);
        c.model.batch = cases[k].batch;
        c.accum = cases[k].accum;
        c.replicas = cases[k].replicas;
        c.epochs = 3;
        c.schedule = SCHEDULE_COSINE;
        c.augment =
                (Augment){.flip = 1, .brightness = 0.1f, .contrast_lo = 0.8f, .contrast_hi = 1.2f};
        c.log_every = 2;  // steps.csv's intervals cross epochs and interruptions
        if (cases[k].menu) {
            c.loss.n = 2;
            c.loss.kind[1] = LOSS_DICE;
            c.loss.weight[1] = 1.0f;
            c.iou_per_image = 1;
        }
        c.out = a;
        CHECK(train_run(&c, NULL, err) == 0, "%s: %s", cases[k].what, err);
        c.out = b;
        c.interrupt_at_step = cases[k].at_step;
        int rc = train_run(&c, NULL, err);
        CHECK(rc == 128 + SIGINT, "%s: interrupted run returned %d (%s)", cases[k].what, rc,
              rc < 0 ? err : "");
        SafetensorsFile f;
        snprintf(pb, sizeof pb, "%s/last.safetensors", b);
        if (safetensors_read(pb, &f, err) == 0) {
            const char *batch = safetensors_meta(&f, "batch"), *step = safetensors_meta(&f, "step");
            // the global batch after the interrupted step: steps × accum micro-batches, at most the
            // epoch's 10 images
            const int in_epoch = (int)(cases[k].at_step % cases[k].steps_per_epoch),
                      n_batches = (10 + cases[k].batch - 1) / cases[k].batch;
            const int after = (in_epoch ? in_epoch : cases[k].steps_per_epoch) * cases[k].accum;
            CHECK(batch && atoi(batch) == (after < n_batches ? after : n_batches),
                  "%s: saved at batch %s", cases[k].what, batch ? batch : "(none)");
            CHECK(step && atoll(step) == cases[k].at_step, "%s: saved after step %s, expected %lld",
                  cases[k].what, step ? step : "(none)", (long long)cases[k].at_step);
            safetensors_free(&f);
        } else {
            CHECK(0, "%s: %s", cases[k].what, err);
        }
        c.interrupt_at_step = 0;
        c.replicas = cases[k].resume_replicas;
        CHECK(train_run(&c, b, err) == 0, "%s: resume: %s", cases[k].what, err);
        const char *files[] = {"last.safetensors", "best.safetensors", "metrics.csv", "steps.csv"};
        const int exact = cases[k].replicas == cases[k].resume_replicas;
        for (int i = 0; i < (exact ? 4 : 0); i++) {
            snprintf(pa, sizeof pa, "%s/%s", a, files[i]);
            snprintf(pb, sizeof pb, "%s/%s", b, files[i]);
            CHECK(files_equal(pa, pb),
                  "%s: %s differs between the resumed and the uninterrupted run", cases[k].what,
                  files[i]);
        }
        // epoch 1, stopped after its steps: the replicas' totals summed by one (the same two terms;
        // metrics.csv's 6 decimals), its validation by one replica
        if (!exact) {
            const char *cols[] = {"loss", "mIoU", "val_loss", "val_mIoU"};
            snprintf(pa, sizeof pa, "%s/metrics.csv", a);
            snprintf(pb, sizeof pb, "%s/metrics.csv", b);
            for (int i = 0; i < 4; i++) {
                double la[4], lb[4];
                CHECK(csv_column(pa, cols[i], la, 4) == 3 && csv_column(pb, cols[i], lb, 4) == 3,
                      "%s: 3 epochs each", cases[k].what);
                CHECK_NEAR(lb[0], la[0], 1.5e-6, cols[i]);
            }
        }
    }
    rm_rf(data); rm_rf(a); rm_rf(b);
}

// `segnet train --resume RUN` takes every setting from RUN/config.txt and
// continues from last.safetensors even when metrics.csv already holds a row
// past it (a crash between the two writes): the result equals, byte for byte,
// an uninterrupted run with those settings (every one off its default).
TEST(resume_cli_after_crash) {
    const char *data = "/tmp/segnet_test_rcli_data", *a = "/tmp/segnet_test_rcli_a",
               *b = "/tmp/segnet_test_rcli_b";
    rm_rf(data); rm_rf(a); rm_rf(b);
    write_seg_set(data, 6, 8, 8, 14);
    write_seg_set("/tmp/segnet_test_rcli_data/val", 3, 8, 8, 15);
    TrainCfg c = tiny_seg_cfg(data, "/tmp/segnet_test_rcli_data/val");
    c.class_weights[0] = 0.0f; c.class_weights[1] = 1.0f; c.class_weights[2] = 2.5f;
    c.epochs = 3; c.lr = 0.003f; c.adam_eps = 1e-4f; c.weight_decay = 0.02f; c.clipnorm = 0.3f;
    c.schedule = SCHEDULE_COSINE; c.warmup = 3; c.patience = 5; c.loss_norm_keras = 1; c.seed = 5;
    c.augment = (Augment){.flip = 1, .brightness = 0.1f, .contrast_lo = 0.8f, .contrast_hi = 1.2f};
    c.out = a;
    char err[SN_ERR_MAX], pa[300], pb[300], ck[300], args[400], msg[4096];
    CHECK(train_run(&c, NULL, err) == 0, "%s", err);
    // metrics.csv's lr is that of the epoch's last step: 2 steps per epoch, 6 in all,
    // warm-up over steps 0..2, then cosine with progress (step - 3)/3
    double lr[4], want[3] = {c.lr * 2.0 / 3.0, c.lr, c.lr * 0.5 * (1 + cos(M_PI * 2.0 / 3.0))};
    snprintf(pa, sizeof pa, "%s/metrics.csv", a);
    CHECK(csv_column(pa, "lr", lr, 4) == 3, "3 rows");
    for (int e = 0; e < 3; e++)
        CHECK(fabs(lr[e] - want[e]) <= 1e-8 * want[e], "epoch %d: lr %.9g, want %.9g", e + 1, lr[e],
              want[e]);
    c.out = b;
    c.stop_after_epochs = 1;
    CHECK(train_run(&c, NULL, err) == 0, "%s", err);
    snprintf(pb, sizeof pb, "%s/last.safetensors", b);
    snprintf(ck, sizeof ck, "%s/epoch1.keep", b);
    CHECK(copy_file(pb, ck), "copy %s", pb);
    c.stop_after_epochs = 2;
    CHECK(train_run(&c, b, err) == 0, "%s", err);
    // metrics.csv: 2 rows
    CHECK(copy_file(ck, pb) && unlink(ck) == 0, "put back the epoch-1 checkpoint");
    snprintf(args, sizeof args, "train --resume %s", b);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "%s", msg);
    const char *files[] = {"last.safetensors", "best.safetensors", "metrics.csv", "config.txt"};
    for (int k = 0; k < 4; k++) {
        snprintf(pa, sizeof pa, "%s/%s", a, files[k]);
        snprintf(pb, sizeof pb, "%s/%s", b, files[k]);
        CHECK(files_equal(pa, pb), "%s differs between the CLI-resumed and the uninterrupted run",
              files[k]);
    }
    rm_rf(data); rm_rf(a); rm_rf(b);
}

typedef struct { TrainCfg *c; const char *resume; char err[SN_ERR_MAX]; } ResumeJob;
static int resume_job(void *arg) { ResumeJob *j = arg; return train_run(j->c, j->resume, j->err); }

// rm DIR/images/NAME.png and DIR/masks/NAME.png
static void remove_sample(const char *dir, const char *name) {
    char path[400];
    snprintf(path, sizeof path, "%s/images/%s.png", dir, name);
    unlink(path);
    snprintf(path, sizeof path, "%s/masks/%s.png", dir, name);
    unlink(path);
}

// Finding 9: inside an interrupted epoch, another batch, accumulation,
// augmentation or training set is refused, naming the change (the epoch's
// place means nothing under them); between epochs they are taken and said.
// What defines the monitored loss (size, class weights, loss normalisation,
// the monitor) never changes within a run.
TEST(resume_checks_data_and_settings) {
    const char *data = "/tmp/segnet_test_fp_data", *run = "/tmp/segnet_test_fp_run",
               *ref = "/tmp/segnet_test_fp_ref";
    rm_rf(data); rm_rf(run); rm_rf(ref);
    write_seg_set(data, 8, 8, 8, 43);
    TrainCfg c = tiny_seg_cfg(data, NULL);
    c.model.batch = 2;  // 4 steps per epoch
    c.epochs = 2;
    c.out = ref;
    char err[SN_ERR_MAX];
    CHECK(train_run(&c, NULL, err) == 0, "%s", err);
    c.out = run;
    c.interrupt_at_step = 2;  // inside epoch 1
    CHECK(train_run(&c, NULL, err) == 128 + SIGINT, "interrupted: %s", err);
    c.interrupt_at_step = 0;
    struct {
        const char *what, *want;
        int batch, accum, size, weight0, keras, monitor, flip;
    } cases[] = {
            {"--batch 4", "--batch 4, but the run was interrupted inside epoch 1 with 2", 4, 1, 8,
             0, 0, 0, 0},
            {"--accum 2", "--accum 2, but the run was interrupted inside epoch 1 with 1", 2, 2, 8,
             0, 0, 0, 0},
            {"--augment flip",
             "--augment flip, but the run was interrupted inside epoch 1 with none", 2, 1, 8, 0, 0,
             0, 1},
            {"--size 16x16", "--size 16x16, but the run was trained with 8x8", 2, 1, 16, 0, 0, 0,
             0},
            {"--class-weights 1,1,1", "--class-weights 1,1,1, but the run was trained with 0,1,1",
             2, 1, 8, 1, 0, 0, 0},
            {"--loss-norm keras", "--loss-norm keras, but the run was trained with weighted", 2, 1,
             8, 0, 1, 0, 0},
            {"--monitor val_mIoU", "--monitor val_mIoU, but the run was trained with val_loss", 2,
             1, 8, 0, 0, 1, 0},
    };
    char path[400], before[400];
    snprintf(path, sizeof path, "%s/last.safetensors", run);
    snprintf(before, sizeof before, "%s/last.safetensors.orig", run);
    keep_copy(path);
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        TrainCfg d = c;
        d.model.batch = cases[k].batch; d.accum = cases[k].accum;
        d.model.height = d.model.width = cases[k].size;
        d.class_weights[0] = (float)cases[k].weight0;
        d.loss_norm_keras = cases[k].keras;
        d.monitor_metric = cases[k].monitor;
        d.augment.flip = cases[k].flip;
        CHECK(train_run(&d, run, err) == -1 && contains(err, cases[k].want), "%s: '%s'",
              cases[k].what, err);
        CHECK(unchanged(path), "%s: the checkpoint changed", cases[k].what);
    }
    // the training set changed: fewer images, or as many but not the same files (names and sizes)
    remove_sample(data, "i07");
    CHECK(train_run(&c, run, err) == -1 && contains(err, data) &&
                  contains(err, "7 samples, the run's had 8") &&
                  contains(err, "interrupted inside epoch 1"),
          "an image fewer: '%s'", err);
    write_seg_set(data, 8, 8, 8, 43);  // the same files again
    uint8_t flat[8 * 8 * 3] = {0};      // compresses to another size
    snprintf(path, sizeof path, "%s/images/i07.png", data);
    CHECK(stbi_write_png(path, 8, 8, 3, flat, 8 * 3) != 0, "write %s", path);
    CHECK(train_run(&c, run, err) == -1 &&
                  contains(err, "8 samples as before, but not the same files"),
          "another image in its place: '%s'", err);
    write_seg_set(data, 8, 8, 8, 43);
    CHECK(train_run(&c, run, err) == 0, "the run's own data and settings: %s", err);
    snprintf(path, sizeof path, "%s/last.safetensors", run);
    snprintf(before, sizeof before, "%s/last.safetensors", ref);
    CHECK(files_equal(path, before), "resumed, the run ends as the uninterrupted one");
    // between epochs: another batch and another training set are taken, and said
    c.epochs = 3;
    c.model.batch = 4;
    c.progress = 1;
    remove_sample(data, "i07");
    ResumeJob job = {&c, run, ""};
    int rc;
    char *said = with_stderr_captured(resume_job, &job, &rc);
    CHECK(rc == 0, "between epochs: %s", job.err);
    CHECK(contains(said, "--batch 4 from epoch 3 on (until now 2)"),
          "the batch's change is said: %s", said);
    CHECK(contains(said, "has changed since the last checkpoint: 7 samples, the run's had 8"),
          "the data's change is said: %s", said);
    free(said);
    rm_rf(data); rm_rf(run); rm_rf(ref);
}

// Finding 14: what --resume, the options and the messages say is what happened.
TEST(resume_and_options_messages) {
    const char *data = "/tmp/segnet_test_msg_data", *run = "/tmp/segnet_test_msg_run";
    rm_rf(data); rm_rf(run);
    write_seg_set(data, 4, 8, 8, 47);
    char args[1400], msg[4096], path[400], err[SN_ERR_MAX];
    const char *base = "train --model unet --depth 1 --width 2 --size 8x8 --batch 2 --classes 3 "
                       "--device cpu --threads 1";
    snprintf(args, sizeof args, "%s --epochs 1 --data %s --out %s", base, data, run);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "%s", msg);
    struct { const char *extra, *want; int rc; } cases[] = {
        {"--seed 5", "--seed 5, but the run was trained with seed 1", 1},
        {"--out /tmp/segnet_test_msg_other", "continues the run in its own folder", 2},
        {"--overwrite", "--overwrite starts a new run", 2},
        {"--head-hidden 16", "--head-hidden: model 'unet' has no classifier head", 2},
        {"--dropout 0.2", "--dropout: model 'unet' has no classifier head", 2},
        {"--unfreeze-last 1", "--unfreeze-last 1 does nothing without --freeze base", 1},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        snprintf(args, sizeof args, "train --resume %s --epochs 2 %s", run, cases[k].extra);
        const int rc = run_segnet(args, msg, sizeof msg);
        CHECK(rc == cases[k].rc && contains(msg, cases[k].want), "`%s`: exit %d, '%s'",
              cases[k].extra, rc, msg);
        CHECK(!contains(msg, "config.txt says") && !contains(msg, "rank 0:"), "`%s`: '%s'",
              cases[k].extra, msg);
    }
    snprintf(args, sizeof args,
             "train --model effv2-t --depth 2 --size 32x32 --classes 3 --data %s --out %s_x", data,
             run);
    CHECK(run_segnet(args, msg, sizeof msg) == 2 &&
                  contains(msg, "--depth: model 'effv2-t' does not use it"),
          "'%s'", msg);
    // a model changed in config.txt: named as that, not as a damaged optimiser state
    snprintf(path, sizeof path, "%s/config.txt", run);
    keep_copy(path);
    char *config = read_text(path), *edited = malloc(strlen(config) + 16);
    char *at = strstr(config, "width = 2");
    CHECK(at != NULL, "config.txt holds width = 2: %s", config);
    if (at) {
        snprintf(edited, strlen(config) + 16, "%.*swidth = 4%s", (int)(at - config), config,
                 at + 9);
        write_file_bytes(path, edited, strlen(edited));
        snprintf(args, sizeof args, "train --resume %s --epochs 2", run);
        CHECK(run_segnet(args, msg, sizeof msg) == 1 && contains(msg, "of the wrong shape") &&
                      contains(msg, "the model of config.txt and the options is not the run's?") &&
                      !contains(msg, "optimiser state"),
              "an edited config.txt: '%s'", msg);
    }
    free(config); free(edited);
    snprintf(args, sizeof args, "%s.orig", path);
    rename(args, path);
    // interrupted inside epoch 2, resumed with --epochs 1: said as that
    TrainCfg c = tiny_seg_cfg(data, NULL);
    c.model.width_base = 2;
    c.model.batch = 2;
    c.epochs = 2;
    c.out = run;
    c.overwrite = 1;
    c.interrupt_at_step = 3;
    CHECK(train_run(&c, NULL, err) == 128 + SIGINT, "%s", err);
    c.overwrite = 0; c.interrupt_at_step = 0; c.epochs = 1; c.progress = 1;
    ResumeJob job = {&c, run, ""};
    int rc;
    char *said = with_stderr_captured(resume_job, &job, &rc);
    CHECK(rc == 0 &&
                  contains(said, "has completed 1 epoch and was interrupted inside epoch 2; "
                                 "--epochs 1 asks for no more") &&
                  !contains(said, "has finished"),
          "--epochs 1: '%s'", said);
    free(said);
    // a relative --data is recorded absolute: --resume works from another folder
    char cwd[PATH_MAX];
    CHECK(getcwd(cwd, sizeof cwd) != NULL, "getcwd");
    CHECK(chdir("/tmp") == 0, "chdir");
    c.data = "segnet_test_msg_data";
    c.epochs = 1; c.overwrite = 1; c.progress = 0;
    rc = train_run(&c, NULL, err);
    CHECK(chdir(cwd) == 0, "chdir back");
    CHECK(rc == 0, "a relative --data: %s", err);
    config = read_text(path);
    CHECK(config && contains(config, "data = /tmp/segnet_test_msg_data\n"), "config.txt: %s",
          config ? config : "");
    free(config);
    snprintf(args, sizeof args, "train --resume %s --epochs 2", run);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "--resume from another folder: '%s'", msg);
    // replicas in one process: a data error names the file, not a rank
    snprintf(path, sizeof path, "%s/masks/i00.png", data);
    write_file_bytes(path, "not a png", 9);
    snprintf(args, sizeof args, "%s --replicas 2 --epochs 1 --data %s --out %s_r", base, data, run);
    CHECK(run_segnet(args, msg, sizeof msg) == 1 &&
                  !strncmp(msg, "segnet train: /tmp/segnet_test_msg_data/masks/i00.png", 53),
          "replicas: '%s'", msg);
    rm_rf(data); rm_rf(run);
}

// A signal while the data are being checked stops the check: nothing is
// written, the folder the run would have made is not left behind, and the
// run ends as interrupted (128 + the signal). An input size beyond the pixel
// limit is refused before any image is read (finding 10: it used to end in an
// internal error when the decode buffers could not be allocated).
TEST(interrupt_before_training) {
    const char *data = "/tmp/segnet_test_early_data", *run = "/tmp/segnet_test_early_run";
    rm_rf(data); rm_rf(run);
    write_seg_set(data, 4, 8, 8, 91);
    TrainCfg c = tiny_seg_cfg(data, NULL);
    c.out = run;
    char err[SN_ERR_MAX];
    interrupt_signal = SIGTERM;
    int rc = train_run(&c, NULL, err);
    interrupt_signal = 0;
    CHECK(rc == 128 + SIGTERM, "interrupted while reading the data: %d (%s)", rc,
          rc < 0 ? err : "");
    CHECK(access(run, F_OK) != 0, "%s was left behind", run);
    c.model.height = c.model.width = 32768;
    rc = train_run(&c, NULL, err);
    CHECK(rc == -1 && contains(err, "--size 32768x32768 is 1073741824 pixels, more than the limit "
                                    "of 100000000"),
          "'%s'", err);
    CHECK(access(run, F_OK) != 0, "%s was left behind", run);
    rm_rf(data);
}

// ./segnet ARGS in the background (exec'd by the shell, so signals reach it),
// stderr into errpath; its process id
static pid_t spawn_segnet(const char *args, const char *errpath) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "exec ./segnet %s >/dev/null 2>'%s'", args, errpath);
    pid_t pid = fork();
    if (pid == 0) { execl("/bin/sh", "sh", "-c", cmd, (char *)NULL); _exit(127); }
    return pid;
}

// Finding 12: SIGINT or SIGTERM during training finishes the step, saves the
// position inside the epoch, says how to continue and exits 130/143; a second
// signal exits at once. Either way --resume ends bit for bit where the
// uninterrupted run ends.
TEST(interrupt_signals_cli) {
    if (access("./segnet", X_OK) != 0) {
        CHECK(0, "./segnet is missing: build it with make");
        return;
    }
    const char *data = "/tmp/segnet_test_sig_data", *ref = "/tmp/segnet_test_sig_ref",
               *run = "/tmp/segnet_test_sig_run";
    const char *errpath = "/tmp/segnet_test_sig_err.txt";
    rm_rf(data); rm_rf(ref);
    write_seg_set(data, 24, 16, 16, 61);
    char base[512], args[1024], msg[4096], path[300], other[300];
    snprintf(base, sizeof base,
             "train --model unet --depth 1 --width 4 --size 16x16 --batch 2 --classes 3 "
             "--class-weights 0,1,1 "
             "--data %s --epochs 10 --augment flip --threads 1",
             data);
    snprintf(args, sizeof args, "%s --out %s", base, ref);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "%s", msg);
    struct { int sig, twice; } cases[] = {{SIGINT, 0}, {SIGTERM, 0}, {SIGHUP, 0}, {SIGINT, 1}};
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        rm_rf(run);
        snprintf(args, sizeof args, "%s --out %s", base, run);
        pid_t pid = spawn_segnet(args, errpath);
        snprintf(path, sizeof path, "%s/metrics.csv", run);
        // after epoch 1,
        for (int waited = 0; waited < 2000 && access(path, F_OK) != 0; waited++) usleep(5000);
        // or inside epoch 2
        usleep(20000 * (useconds_t)(k % 3));
        kill(pid, cases[k].sig);
        if (cases[k].twice) kill(pid, cases[k].sig);
        int status = 0;
        waitpid(pid, &status, 0);
        size_t n;
        char *said = read_file(errpath, &n);
        const int want = 128 + cases[k].sig;
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == want,
              "signal %d%s: exit %d, expected %d; stderr: %s", cases[k].sig,
              cases[k].twice ? " twice" : "", WIFEXITED(status) ? WEXITSTATUS(status) : -1, want,
              said ? said : "");
        if (!cases[k].twice)
            CHECK(said &&
                          (contains(said, "interrupted at epoch") ||
                           contains(said, "interrupted before epoch")) &&
                          contains(said, "continue with: segnet train --resume"),
                  "what it said: %s", said ? said : "");
        free(said);
        snprintf(args, sizeof args, "train --resume %s", run);
        CHECK(run_segnet(args, msg, sizeof msg) == 0, "resume after signal %d: %s", cases[k].sig,
              msg);
        const char *files[] = {"last.safetensors", "best.safetensors", "metrics.csv"};
        for (int i = 0; i < 3; i++) {
            snprintf(path, sizeof path, "%s/%s", run, files[i]);
            snprintf(other, sizeof other, "%s/%s", ref, files[i]);
            CHECK(files_equal(path, other), "signal %d%s: %s differs from the uninterrupted run's",
                  cases[k].sig, cases[k].twice ? " twice" : "", files[i]);
        }
    }
    // SIGPIPE: the reader of its output gone (`| head -n 4`, inside epoch 1): saved as for the
    // others, exit 141; the writes to the broken pipe do not end the run before its checkpoint
    const char *status_path = "/tmp/segnet_test_sig_status.txt";
    rm_rf(run);
    char cmd[1600];
    snprintf(cmd, sizeof cmd, "(./segnet %s --out %s 2>&1; echo $? > %s) | head -n 4 >/dev/null",
             base, run, status_path);
    CHECK(system(cmd) == 0, "%s", cmd);
    // the subshell outlives head
    for (int waited = 0; waited < 2000 && !file_exists(status_path); waited++) usleep(5000);
    usleep(50000);
    char *status = read_text(status_path);
    CHECK(status && atoi(status) == 128 + SIGPIPE, "a broken pipe: exit %s, expected %d",
          status ? status : "(none)", 128 + SIGPIPE);
    free(status);
    unlink(status_path);
    snprintf(path, sizeof path, "%s/last.safetensors", run);
    CHECK(file_exists(path), "a broken pipe: no checkpoint was saved");
    snprintf(args, sizeof args, "train --resume %s", run);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "resume after a broken pipe: %s", msg);
    for (int i = 0; i < 3; i++) {
        const char *files[] = {"last.safetensors", "best.safetensors", "metrics.csv"};
        snprintf(path, sizeof path, "%s/%s", run, files[i]);
        snprintf(other, sizeof other, "%s/%s", ref, files[i]);
        CHECK(files_equal(path, other), "a broken pipe: %s differs from the uninterrupted run's",
              files[i]);
    }
    unlink(errpath);
    rm_rf(data); rm_rf(ref); rm_rf(run);
}

// Findings 2, 5, 6: a run folder is locked for the run's life (a second run is
// refused naming the holder); a folder whose run stopped before its first
// checkpoint starts again, by --resume or by a new run; temporary files of
// dead writers are removed (a live process's are not).
TEST(run_folder_claim) {
    const char *data = "/tmp/segnet_test_claim_data", *ref = "/tmp/segnet_test_claim_ref",
               *run = "/tmp/segnet_test_claim_run";
    rm_rf(data); rm_rf(ref); rm_rf(run);
    write_seg_set(data, 4, 8, 8, 41);
    TrainCfg c = tiny_seg_cfg(data, NULL);
    c.epochs = 2;
    char err[SN_ERR_MAX], path[300], other[300];
    c.out = ref;
    CHECK(train_run(&c, NULL, err) == 0, "%s", err);
    // held by another open file description (as by another process)
    mkdir(run, 0755);
    int held = run_lock(run, "segnet train", err);
    CHECK(held >= 0, "%s", err);
    c.out = run;
    char want[64];
    snprintf(want, sizeof want, "in use by another process (pid %ld, segnet train)",
             (long)getpid());
    CHECK(train_run(&c, NULL, err) == -1 && contains(err, run) && contains(err, want),
          "a second run: '%s'", err);
    snprintf(path, sizeof path, "%s/config.txt", run);
    CHECK(access(path, F_OK) != 0, "the refused run wrote config.txt");
    if (held >= 0) close(held);
    // a run that left only its settings (killed before its first checkpoint), and a dead writer's
    // file
    CHECK(train_run(&c, NULL, err) == 0, "%s", err);
    // killed between metrics.csv and the first checkpoint: metrics.csv holds epoch 1, no checkpoint
    const char *results[] = {"last.safetensors", "best.safetensors", "metrics.csv", "curves.svg"};
    for (int k = 0; k < 4; k++) {
        snprintf(path, sizeof path, "%s/%s", run, results[k]);
        if (k != 2) unlink(path);
    }
    snprintf(path, sizeof path, "%s/metrics.csv", run);
    char *rows = read_text(path), *second = rows ? strchr(strchr(rows, '\n') + 1, '\n') : NULL;
    CHECK(second != NULL, "metrics.csv has two epochs");
    // a checkpoint lost after two epochs (deleted, say): --resume cannot go on and says what is
    // there
    CHECK(train_run(&c, run, err) == -1 && contains(err, "no last.safetensors") &&
                  contains(err, "2 epochs in metrics.csv"),
          "--resume without the checkpoint of 2 epochs: '%s'", err);
    snprintf(other, sizeof other, "%s/best.safetensors", ref);
    snprintf(path, sizeof path, "%s/best.safetensors", run);
    copy_file(other, path);
    CHECK(train_run(&c, run, err) == -1 && contains(err, "best.safetensors and 2 epochs"),
          "with best.safetensors: '%s'", err);
    snprintf(path, sizeof path, "%s/metrics.csv", run);
    // epoch 1's row and best.safetensors, as a kill between it and the first checkpoint leaves them
    if (second) write_file_bytes(path, rows, (size_t)(second + 1 - rows));
    free(rows);
    pid_t dead = fork();
    if (dead == 0) _exit(0);
    waitpid(dead, NULL, 0);
    char stale[300], live[300];
    snprintf(stale, sizeof stale, "%s/last.safetensors.tmp.%ld", run, (long)dead);
    snprintf(live, sizeof live, "%s/notes.txt.tmp.%ld", run, (long)getpid());
    write_file_bytes(stale, "partial", 7);
    write_file_bytes(live, "in progress", 11);
    CHECK(train_run(&c, run, err) == 0, "--resume of a folder without a checkpoint: %s", err);
    CHECK(access(stale, F_OK) != 0, "the dead writer's %s is still there", stale);
    CHECK(access(live, F_OK) == 0, "a live process's temporary file was removed");
    unlink(live);
    snprintf(path, sizeof path, "%s/last.safetensors", run);
    snprintf(other, sizeof other, "%s/last.safetensors", ref);
    CHECK(files_equal(path, other), "started again, the run ends as a fresh one does");
    snprintf(path, sizeof path, "%s/best.safetensors", run);
    snprintf(other, sizeof other, "%s/best.safetensors", ref);
    CHECK(files_equal(path, other), "started again, best.safetensors is the fresh run's");
    snprintf(path, sizeof path, "%s/metrics.csv", run);
    snprintf(other, sizeof other, "%s/metrics.csv", ref);
    CHECK(files_equal(path, other), "metrics.csv is the fresh run's");
    for (int k = 0; k < 4; k++) {
        snprintf(path, sizeof path, "%s/%s", run, results[k]);
        unlink(path);
    }
    // a new run into a folder with an earlier run's files: refused naming them, unless --overwrite
    snprintf(path, sizeof path, "%s/config.txt", run);
    char *config = read_text(path);
    CHECK(train_run(&c, NULL, err) == -1 &&
                  contains(err, "holds an earlier run's files (config.txt)") &&
                  contains(err, "--overwrite"),
          "a new run into a folder without a checkpoint: '%s'", err);
    char *after = read_text(path);
    CHECK(config && after && !strcmp(config, after), "the refused run left config.txt as it was");
    free(config); free(after);
    c.overwrite = 1;
    CHECK(train_run(&c, NULL, err) == 0, "--overwrite: %s", err);
    c.overwrite = 0;
    CHECK(train_run(&c, NULL, err) == -1 && contains(err, "already holds a run (last.safetensors)"),
          "'%s'", err);
    // an earlier run that trained longer is replaced whole: its best epoch goes too
    c.overwrite = 1;
    c.epochs = 1;
    CHECK(train_run(&c, NULL, err) == 0, "--overwrite of a whole run: %s", err);
    snprintf(path, sizeof path, "%s/metrics.csv", run);
    CHECK(metrics_rows(run) == 1, "metrics.csv holds the new run's one epoch, not %d",
          metrics_rows(run));
    c.overwrite = 0;
    c.epochs = 2;
    // a refused new run leaves no folder behind
    c.out = "/tmp/segnet_test_claim_new";
    rm_rf(c.out);
    c.model.classes = 2;  // the masks hold class 2
    CHECK(train_run(&c, NULL, err) == -1 && contains(err, "pixel"), "'%s'", err);
    CHECK(access(c.out, F_OK) != 0, "the refused run left %s", c.out);
    rm_rf(data); rm_rf(ref); rm_rf(run);
}

// Finding 13: the words of a run's config.txt are freed with the arguments.
TEST(run_config_freed) {
    const char *data = "/tmp/segnet_test_cfgfree_data", *run = "/tmp/segnet_test_cfgfree_run";
    rm_rf(data); rm_rf(run);
    write_seg_set(data, 4, 8, 8, 51);
    TrainCfg c = tiny_seg_cfg(data, NULL);
    c.epochs = 1;
    c.out = run;
    char err[SN_ERR_MAX];
    CHECK(train_run(&c, NULL, err) == 0, "%s", err);
    // Freed chunks parked in malloc's caches count as in use, but the same
    // sizes come back every round: after a first round the total is steady.
    // A leak of the kept words grows by at least 16 bytes (malloc's smallest
    // chunk) per word per round.
    const int rounds = 200;
    int words = 0;
    size_t before = 0;
    for (int round = 0; round <= rounds; round++) {
        if (round == 1) before = mallinfo2().uordblks;
        TrainArgs a = {0};
        char *argv[] = {"segnet", "eval", "--run", (char *)run};
        if (parse_train_args(&a, 4, argv, "eval", "") != 0 || a.c.model.depth != 1) {
            CHECK(0, "eval --run RUN: config.txt not read");
            break;
        }
        words = a.n_kept;
        train_args_free(&a);
    }
    const size_t after = mallinfo2().uordblks, leak_floor = (size_t)rounds * words * 16;
    CHECK(words > 20 && after < before + leak_floor / 2,
          "%zu bytes more in use after %d rounds (a leak of %d words: >= %zu)", after - before,
          rounds, words, leak_floor);
    rm_rf(data); rm_rf(run);
}

// Finding 4: a run whose model stops being finite stops at that epoch with
// exit 1, naming the tensor; nothing of the epoch is saved (best and last
// keep what they held); the run never ends with a NaN "best".
TEST(diverged_run_never_saved) {
    const char *data = "/tmp/segnet_test_nan_data", *run = "/tmp/segnet_test_nan_run";
    rm_rf(data); rm_rf(run);
    write_seg_set(data, 8, 8, 8, 23);
    char err[SN_ERR_MAX], path[400];
    const char *kept[3] = {"best.safetensors", "last.safetensors", "metrics.csv"};
    for (int metric = 0; metric < 2; metric++) {
        TrainCfg c = tiny_seg_cfg(data, data);
        c.out = run;
        c.epochs = 1;
        c.monitor_metric = metric;
        rm_rf(run);
        CHECK(train_run(&c, NULL, err) == 0, "%s", err);
        for (int k = 0; k < 3; k++) {
            snprintf(path, sizeof path, "%s/%s", run, kept[k]);
            keep_copy(path);
        }
        c.epochs = 2;
        c.lr = metric ? 1e36f : 1e34f;  // the seed's flat val IoU, taken to the end
        CHECK(train_run(&c, run, err) == -1 &&
                      contains(err, "epoch 2: the model is no longer finite") &&
                      contains(err, "holds NaN or inf") &&
                      contains(err, "best.safetensors keeps epoch 1"),
              "lr %g%s: '%s'", c.lr, metric ? ", --monitor val_mIoU" : "", err);
        for (int k = 0; k < 3; k++) {
            snprintf(path, sizeof path, "%s/%s", run, kept[k]);
            CHECK(unchanged(path), "lr %g: %s changed", c.lr, kept[k]);
        }
    }
    // from the first epoch, on the command line: exit 1, and no best.safetensors is named
    char args[1024], msg[4096];
    snprintf(args, sizeof args,
             "train --model unet --depth 1 --width 4 --size 8x8 --batch 4 --classes 3 "
             "--class-weights 0,1,1 "
             "--data %s --val %s --out %s/first --lr 1e34 --epochs 2 --device cpu --threads 1",
             data, data, run);
    CHECK(run_segnet(args, msg, sizeof msg) == 1 &&
                  contains(msg, "epoch 1: the model is no longer finite") &&
                  !contains(msg, "best epoch 0") && !contains(msg, "keeps epoch"),
          "first epoch: '%s'", msg);
    snprintf(path, sizeof path, "%s/first/best.safetensors", run);
    CHECK(!file_exists(path), "a best.safetensors was written");
    snprintf(path, sizeof path, "%s/first/last.safetensors", run);
    CHECK(!file_exists(path), "a last.safetensors was written");
    rm_rf(data); rm_rf(run);
}

// ----------------------------------------------------------------------------
// segnet predict: every row equals the model's softmax on that image (resized
// where its size differs); bad input names the file and leaves the output alone;
// segmentation models' masks and overlays; segnet export

TEST(predict_classifier) {
    char dir[256], wpath[300], out1[300], out2[300], csv[300], err[SN_ERR_MAX];
    snprintf(dir, sizeof dir, "/tmp/segnet_test_%ld_predict", (long)getpid());
    mkdir(dir, 0755);
    snprintf(wpath, sizeof wpath, "%s/w.safetensors", dir);
    snprintf(out1, sizeof out1, "%s_out1.csv", dir);  // beside the input folder: never inside it
    snprintf(out2, sizeof out2, "%s_out2.csv", dir);
    snprintf(csv, sizeof csv, "%s/list.csv", dir);
    Graph g; Net net;
    ModelCfg c = model_cfg_default();
    c.model = "effv2-t"; c.classes = 3; c.height = 32; c.width = 32; c.batch = 1;
    graph_init(&g);
    int out = model_build(&g, &c);
    CHECK(out >= 0 && net_create(&net, &g, &ops_cpu, DT_F32, 0, err) == 0, "%s", err);
    Rng r; rng_seed(&r, 31);
    random_params(&net, &r);
    CHECK(net_save_weights(&net, wpath, err) == 0, "%s", err);
    write_png(dir, "a.png", 32, 32, &r);
    write_png(dir, "b.png", 32, 32, &r);
    // another size (resized), a comma in the name (quoted)
    write_png(dir, "c,odd.png", 24, 40, &r);
    FILE *f = fopen(csv, "w");
    fprintf(f, "path,label\na.png,0\nb.png,2\n\"c,odd.png\",1\n");
    fclose(f);
    PredictCfg pc = {.model = c, .weights = wpath, .input = dir, .out = out1, .device = DEVICE_CPU};
    pc.model.batch = 2;  // 3 images: the last batch is partly empty
    CHECK(predict_run(&pc, err) == 0, "predict on a folder: %s", err);
    pc.input = csv; pc.out = out2;
    CHECK(predict_run(&pc, err) == 0, "predict on a CSV: %s", err);
    char *t1 = read_text(out1), *t2 = read_text(out2);
    CHECK(t1 && t2 && !strcmp(t1, t2), "folder and CSV give the same rows");
    // each row against the softmax of a direct forward on that image
    const char *names[3] = {"a.png", "b.png", "c,odd.png"};
    const char *line = t1 ? strchr(t1, '\n') : NULL;
    CHECK(t1 && !strncmp(t1, "path,pred,p0,p1,p2\n", 19), "header");
    for (int i = 0; line && i < 3; i++) {
        line++;
        char path[512];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        int h, w;
        float *img = image_load_rgb(path, &h, &w, err);
        Tensor x = net_tensor(&net, g.input);
        if (h == 32 && w == 32) memcpy(x.data, img, sizeof(float) * 32 * 32 * 3);
        else ops_cpu.resize_bilinear_forward(&ops_cpu, x, tensor_f32(img, shape4(1, h, w, 3)));
        free(img);
        net_forward(&net, net_capacity(&net), 0);
        const float *z = net.act[out];
        double zmax = fmax(fmax(z[0], z[1]), z[2]), sum = 0, p[3];
        for (int k = 0; k < 3; k++) sum += exp(z[k] - zmax);
        for (int k = 0; k < 3; k++) p[k] = exp(z[k] - zmax) / sum;
        int best = p[1] > p[0] ? 1 : 0;
        if (p[2] > p[best]) best = 2;
        const char *s = line;
        char field[600];
        csv_field(&s, field, sizeof field, NULL);
        CHECK(!strcmp(field, path), "row %d path '%s', expected '%s'", i, field, path);
        int pred = (int)strtol(s, (char **)&s, 10);
        CHECK(pred == best, "row %d: pred %d, argmax %d", i, pred, best);
        for (int k = 0; k < 3; k++) {
            double v = strtod(s + 1, (char **)&s);
            CHECK(fabs(v - p[k]) < 1e-6, "row %d p%d: %.7g, direct %.7g", i, k, v, p[k]);
        }
        line = strchr(line, '\n');
    }
    CHECK(line && line[1] == 0, "exactly three rows");
    free(t1); free(t2);
    net_free(&net); graph_free(&g);
    unlink(out1); unlink(out2);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0, "cleanup");
}

TEST(predict_bad_input) {
    char dir[256], wpath[300], out[300], csv[300], err[SN_ERR_MAX];
    snprintf(dir, sizeof dir, "/tmp/segnet_test_%ld_predict_bad", (long)getpid());
    mkdir(dir, 0755);
    snprintf(wpath, sizeof wpath, "%s/w.safetensors", dir);
    snprintf(out, sizeof out, "%s/out.csv", dir);
    snprintf(csv, sizeof csv, "%s/list.csv", dir);
    Graph g; Net net;
    tiny_net(&g, &net, 3, 5);
    CHECK(net_save_weights(&net, wpath, err) == 0, "%s", err);
    Rng r; rng_seed(&r, 9);
    write_png(dir, "good.png", 32, 32, &r);
    // an earlier prediction, which --overwrite may replace
    const char *earlier = "path,pred,p0,p1,p2\nkeep\n";
    FILE *f = fopen(out, "w"); fputs(earlier, f); fclose(f);
    char corrupt[300];
    snprintf(corrupt, sizeof corrupt, "%s/corrupt.png", dir);
    f = fopen(corrupt, "wb"); fputs("\x89PNG\r\n\x1a\nnot really a png", f); fclose(f);
    ModelCfg c = model_cfg_default();
    c.model = "effv2-t"; c.classes = 3; c.height = 32; c.width = 32;
    PredictCfg pc = {.model = c,
                     .weights = wpath,
                     .input = csv,
                     .out = out,
                     .device = DEVICE_CPU,
                     .overwrite = 1};
    struct { const char *rows, *want1, *want2; } cases[] = {
        {"good.png\ncorrupt.png\n", "corrupt.png", "cannot decode"},
        {"good.png\nmissing.png\n", "missing.png", "No such file"},
        {"path\n", "list.csv", "no images"},
        {"good.png\n\"unterminated.png\n", "row 2", "unterminated"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        f = fopen(csv, "w"); fputs(cases[k].rows, f); fclose(f);
        CHECK(predict_run(&pc, err) == -1 && contains(err, cases[k].want1) &&
                      contains(err, cases[k].want2),
              "case %zu: '%s'", k, err);
        char *t = read_text(out);
        CHECK(t && !strcmp(t, earlier), "case %zu: the existing output is untouched", k);
        free(t);
    }
    pc.input = dir;
    pc.weights = csv;  // not a safetensors file
    CHECK(predict_run(&pc, err) == -1 && contains(err, "list.csv"), "weights not safetensors: '%s'",
          err);
    pc.weights = wpath;
    pc.model.classes = 5;  // weights of another head
    CHECK(predict_run(&pc, err) == -1 && contains(err, "classifier.1.weight"), "wrong head: '%s'",
          err);
    pc.model.model = "unet";
    CHECK(predict_run(&pc, err) == -1 && contains(err, "segmentation model"), "unet: '%s'", err);
    DIR *d = opendir(dir);
    int leftovers = 0;
    for (struct dirent *e; d && (e = readdir(d));) leftovers += strstr(e->d_name, ".tmp.") != NULL;
    if (d) closedir(d);
    CHECK(leftovers == 0, "no temporary file left behind");
    net_free(&net); graph_free(&g);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0, "cleanup");
}

static void set_param(Net *net, const char *name, size_t index, float v) {
    int id = graph_find_param(net->g, name);
    CHECK(id >= 0, "no parameter %s", name);
    if (id >= 0) net->params[net->g->params[id].offset + index] = v;
}

// A U-Net (depth 1, width 2, 3 classes, 8×8) whose prediction is known by hand.
// With x = R/128 - 1 the rescaled red channel, a = ReLU(x) and b = ReLU(-x)
// pass through the centre taps of every conv (BN is the identity up to
// 1/sqrt(1 + eps), the deeper level is all zeros), and the head gives logits
// (0.5, 2b, 2a): class 2 where R > 192, class 1 where R < 64, else class 0.
static int seg_hand_net(Graph *g, Net *net, ModelCfg *c, int batch) {
    char err[SN_ERR_MAX];
    *c = model_cfg_default();
    c->depth = 1; c->width_base = 2; c->classes = 3; c->height = c->width = 8; c->batch = batch;
    graph_init(g);
    int out = model_build(g, c);
    CHECK(out >= 0 && net_create(net, g, &ops_cpu, DT_F32, 0, err) == 0, "%s", err);
    memset(net->params, 0, sizeof(float) * g->n_param_floats);
    for (int l = 0; l < g->n_layers; l++)
        if (g->layers[l].kind == LAYER_BN)
            for (size_t k = 0; k < g->params[g->layers[l].weight].count; k++)
                net->params[g->params[g->layers[l].weight].offset + k] = 1;
    for (int b = 0; b < g->n_buffers; b++)
        for (size_t k = 0; k < g->buffers[b].count; k++)
            net->buffers[g->buffers[b].offset + k] =
                    contains(g->buffers[b].name, "running_var") ? 1 : 0;
    // conv weights (Cout,3,3,Cin): the centre tap of (co, ci) is element (co·9 + 4)·Cin + ci
    set_param(net, "enc0.conv1.0.weight", (0 * 9 + 4) * 3 + 0, 1);   // a ← R
    set_param(net, "enc0.conv1.0.weight", (1 * 9 + 4) * 3 + 0, -1);  // b ← -R
    set_param(net, "enc0.conv2.0.weight", (0 * 9 + 4) * 2 + 0, 1);
    set_param(net, "enc0.conv2.0.weight", (1 * 9 + 4) * 2 + 1, 1);
    // the skip follows 4 upsampled channels
    set_param(net, "dec0.conv1.0.weight", (0 * 9 + 4) * 6 + 4, 1);
    set_param(net, "dec0.conv1.0.weight", (1 * 9 + 4) * 6 + 5, 1);
    set_param(net, "dec0.conv2.0.weight", (0 * 9 + 4) * 2 + 0, 1);
    set_param(net, "dec0.conv2.0.weight", (1 * 9 + 4) * 2 + 1, 1);
    set_param(net, "head.weight", 1 * 2 + 1, 2);                     // (3,1,1,2): z1 = 2b
    set_param(net, "head.weight", 2 * 2 + 0, 2);                     // z2 = 2a
    set_param(net, "head.bias", 0, 0.5f);
    return out;
}

// an RGB PNG whose red channel is red(x, y), green and blue random
static void write_png_red(const char *path, int w, int h, int (*red)(int x, int y), Rng *r) {
    unsigned char *px = malloc((size_t)h * w * 3);
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++) {
            unsigned char *p = px + 3 * ((size_t)y * w + x);
            p[0] = red ? (unsigned char)red(x, y) : (unsigned char)(rng_next(r) & 255);
            p[1] = (unsigned char)(rng_next(r) & 255);
            p[2] = (unsigned char)(rng_next(r) & 255);
        }
    CHECK(stbi_write_png(path, w, h, 3, px, w * 3) != 0, "writing %s", path);
    free(px);
}
// classes 2 2 2 0 0 0 1 1
static int red_columns(int x, int y) { (void)y; return x < 3 ? 250 : x < 6 ? 128 : 10; }

static const char *SEG_NAMES[3] = {"a.png", "b.v2.png", "c.png"},
                  *SEG_STEMS[3] = {"a", "b.v2", "c"};
static const int SEG_W[3] = {8, 12, 8}, SEG_H[3] = {8, 10, 8};

// Checks predict's outputs in outdir for the images SEG_NAMES in `in`: every
// mask pixel is the argmax of a direct forward pass of net on the (resized)
// image, read at src = floor((dst + ½)·8/size); every overlay value is
// (image + palette colour + 1)/2; a.png has the classes by hand; legend.png
// beside them (test_predict_legend_progress reads it). The other
// images have random red values, so their masks change from pixel to pixel
// and a wrong resize back shows.
static void check_seg_outputs(Net *net, int out, const char *in, const char *outdir) {
    char path[400], err[SN_ERR_MAX];
    for (int i = 0; i < 3; i++) {
        int w = 0, h = 0, comp, mw = 0, mh = 0, mc = 0, ow = 0, oh = 0, oc = 0;
        snprintf(path, sizeof path, "%s/%s", in, SEG_NAMES[i]);
        unsigned char *img = stbi_load(path, &w, &h, &comp, 3);
        float *imgf = image_load_rgb(path, &h, &w, err);
        snprintf(path, sizeof path, "%s/%s.png", outdir, SEG_STEMS[i]);
        unsigned char *mask = stbi_load(path, &mw, &mh, &mc, 0);
        snprintf(path, sizeof path, "%s/%s_overlay.png", outdir, SEG_STEMS[i]);
        unsigned char *ov = stbi_load(path, &ow, &oh, &oc, 0);
        CHECK(img && imgf && mask && ov, "%s: an output is missing", SEG_NAMES[i]);
        int sizes_ok = img && imgf && mask && ov && mw == w && mh == h && mc == 1 && ow == w &&
                       oh == h && oc == 3;
        CHECK(sizes_ok, "%s: mask %dx%d (%d channels), overlay %dx%d (%d channels), image %dx%d",
              SEG_NAMES[i], mw, mh, mc, ow, oh, oc, SEG_W[i], SEG_H[i]);
        if (!sizes_ok) { free(img); free(imgf); free(mask); free(ov); continue; }
        Tensor x = net_tensor(net, net->g->input);
        memset(x.data, 0, tensor_bytes(x));
        if (w == 8 && h == 8) memcpy(x.data, imgf, sizeof(float) * 8 * 8 * 3);
        else
            ops_cpu.resize_bilinear_forward(&ops_cpu, tensor_f32(x.data, shape4(1, 8, 8, 3)),
                                            tensor_f32(imgf, shape4(1, h, w, 3)));
        net_forward(net, net_capacity(net), 0);
        const float *z = net->act[out];  // (B,8,8,3), the image in slot 0
        int bad_mask = 0, bad_overlay = 0, bad_hand = 0, seen[3] = {0, 0, 0};
        for (int y = 0; y < h; y++)
            for (int xx = 0; xx < w; xx++) {
                int sy = (int)floor((y + 0.5) * 8 / h), sx = (int)floor((xx + 0.5) * 8 / w);
                const float *zp = z + ((size_t)sy * 8 + sx) * 3;
                int best = zp[1] > zp[0] ? 1 : 0;
                if (zp[2] > zp[best]) best = 2;
                int m = mask[y * w + xx];
                bad_mask += m != best;
                if (m < 3) seen[m] = 1;
                if (i == 0)
                    bad_hand += m != (red_columns(xx, y) > 192  ? 2
                                      : red_columns(xx, y) < 64 ? 1
                                                                : 0);
                for (int ch = 0; ch < 3; ch++) {
                    int p = 3 * (y * w + xx);
                    bad_overlay +=
                            ov[p + ch] != (img[p + ch] + SEG_PALETTE[m % SEG_COLOURS][ch] + 1) / 2;
                }
            }
        CHECK(bad_mask == 0, "%s: %d mask pixels differ from the direct forward", SEG_NAMES[i],
              bad_mask);
        CHECK(bad_overlay == 0, "%s: %d overlay values differ from the 50/50 blend", SEG_NAMES[i],
              bad_overlay);
        CHECK(bad_hand == 0, "%s: %d mask pixels differ from the classes by hand", SEG_NAMES[i],
              bad_hand);
        CHECK(seen[0] && seen[1] && seen[2], "%s: not every class appears", SEG_NAMES[i]);
        free(img); free(imgf); free(mask); free(ov);
    }
    DIR *d = opendir(outdir);
    int files = 0, leftovers = 0;
    for (struct dirent *e; d && (e = readdir(d));) {
        files += e->d_name[0] != '.';
        leftovers += strstr(e->d_name, ".tmp.") != NULL;
    }
    if (d) closedir(d);
    CHECK(files == 7 && leftovers == 0,
          "the folder holds the 6 PNGs and the legend, nothing else (%d files, %d temporary)",
          files, leftovers);
}

// The predict tests' folder: dir = /tmp/segnet_test_<pid>_<tag> with an empty
// dir/images (in), and the hand-made U-Net (batch images) saved as dir/w.safetensors.
// Returns seg_hand_net's output tensor.
typedef struct { char dir[256], in[300], wpath[300]; } PredictDirs;
static int predict_fixture(const char *tag, int batch, PredictDirs *d, Graph *g, Net *net,
                           ModelCfg *c) {
    char err[SN_ERR_MAX];
    snprintf(d->dir, sizeof d->dir, "/tmp/segnet_test_%ld_%s", (long)getpid(), tag);
    snprintf(d->in, sizeof d->in, "%s/images", d->dir);
    snprintf(d->wpath, sizeof d->wpath, "%s/w.safetensors", d->dir);
    mkdir(d->dir, 0755); mkdir(d->in, 0755);
    const int out = seg_hand_net(g, net, c, batch);
    CHECK(net_save_weights(net, d->wpath, err) == 0, "%s", err);
    return out;
}

// predict with the hand-made U-Net into a new folder, then again into it
TEST(predict_segmentation) {
    PredictDirs d;
    Graph g; Net net; ModelCfg c;
    const int out = predict_fixture("predict_seg", 2, &d, &g, &net, &c);
    char *dir = d.dir, *in = d.in, *wpath = d.wpath, outdir[300], path[400], err[SN_ERR_MAX];
    snprintf(outdir, sizeof outdir, "%s/masks", dir);  // absent: predict creates it
    Rng r; rng_seed(&r, 5);
    int (*reds[3])(int, int) = {red_columns, NULL, NULL};
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/%s", in, SEG_NAMES[i]);
        write_png_red(path, SEG_W[i], SEG_H[i], reds[i], &r);
    }
    // batch 2, 3 images: the last batch is partly empty
    PredictCfg pc = {
            .model = c, .weights = wpath, .input = in, .out = outdir, .device = DEVICE_CPU};
    CHECK(predict_run(&pc, err) == 0, "predict: %s", err);
    check_seg_outputs(&net, out, in, outdir);
    CHECK(predict_run(&pc, err) == -1 && contains(err, "exists") && contains(err, "--overwrite"),
          "predict again, into the existing folder, without --overwrite: '%s'", err);
    pc.overwrite = 1;
    CHECK(predict_run(&pc, err) == 0, "predict again, into the existing folder: %s", err);
    check_seg_outputs(&net, out, in, outdir);
    net_free(&net); graph_free(&g);
    rm_rf(dir);
}

// --scale: the image resized by S, tiled, the probabilities resized back; with
// a pointwise model that is, pixel for pixel, the softmax of the resized
// image resized back (bilinear both ways, the resize op), up to the blend's
// rounding: 2e-6 relative as in predict_tiled_pointwise, carried through the
// resize's convex weights, plus its own few roundings: 4e-6.
TEST(predict_tiled_scaled_pointwise) {
    enum { h = 37, w = 50, K = 3 };
    static const float SCALES[3] = {0.5f, 1.7f, 0.03f};  // the last: a 2x1 image
    Rng r;
    rng_seed(&r, 19);
    float *img = malloc(sizeof(float) * 3 * h * w), *probs = malloc(sizeof(float) * K * h * w);
    uint8_t *img8 = malloc((size_t)3 * h * w);
    for (int i = 0; i < 3 * h * w; i++) img[i] = img8[i] = (uint8_t)(rng_next(&r) % 256);
    for (int k = 0; k < 3; k++) {
        int ctx[2] = {16 * 16, 0};
        const TileModel m = {tiles_pointwise, ctx, 2, 16, 16, K, NULL, 0};
        predict_tiled_scaled(&m, img8, h, w, SCALES[k], 0.5f, 1, probs);
        const int sh = (int)fmax(1, lround(h * (double)SCALES[k])),
                  sw = (int)fmax(1, lround(w * (double)SCALES[k]));
        float *simg = malloc(sizeof(float) * 3 * sh * sw),
              *sp = malloc(sizeof(float) * K * sh * sw), *want = malloc(sizeof(float) * K * h * w);
        ops_cpu.resize_bilinear_forward(&ops_cpu, tensor_f32(simg, shape4(1, sh, sw, 3)),
                                        tensor_f32(img, shape4(1, h, w, 3)));
        int one_pixel[2] = {1, 0};
        for (int p = 0; p < sh * sw; p++) {
            float z[3];
            tiles_pointwise(one_pixel, simg + 3 * p, 1, z);
            const float zmax = fmaxf(z[0], fmaxf(z[1], z[2]));
            const double sum = exp(z[0] - zmax) + exp(z[1] - zmax) + exp(z[2] - zmax);
            for (int c = 0; c < K; c++) sp[K * p + c] = (float)(exp(z[c] - zmax) / sum);
        }
        ops_cpu.resize_bilinear_forward(&ops_cpu, tensor_f32(want, shape4(1, h, w, K)),
                                        tensor_f32(sp, shape4(1, sh, sw, K)));
        double worst = 0;
        for (int i = 0; i < K * h * w; i++) worst = fmax(worst, fabs(probs[i] - want[i]) / want[i]);
        CHECK(worst < 4e-6, "scale %g (%dx%d): relative error %.3g", SCALES[k], sw, sh, worst);
        free(simg);
        free(sp);
        free(want);
    }
    free(img8);
    free(img);
    free(probs);
}

// predict --tile through predict_run with the hand-made U-Net, which is
// pointwise (centre taps, the down path unused): every tile sees each pixel
// whole, so the mask at the image's own size is each pixel's own class, the
// argmax of the net's logits for an image of that colour (ties aside, which
// random colours do not make). Images larger and smaller than the 8x8 tile,
// with --tta flip; a classifier's --tile is refused.
TEST(predict_tiled_masks) {
    PredictDirs d;
    Graph g;
    Net net;
    ModelCfg c;
    const int out = predict_fixture("predict_tiled", 1, &d, &g, &net, &c);
    char outdir[300], path[400], err[SN_ERR_MAX];
    snprintf(outdir, sizeof outdir, "%s/masks", d.dir);
    Rng r;
    rng_seed(&r, 12);
    static const int SIZES[2][2] = {{27, 40}, {5, 7}};  // (h, w)
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/img%d.png", d.in, i);
        write_png_red(path, SIZES[i][1], SIZES[i][0], NULL, &r);
    }
    PredictCfg pc = {.model = c,
                     .weights = d.wpath,
                     .input = d.in,
                     .out = outdir,
                     .device = DEVICE_CPU,
                     .tiled = 1,
                     .overlap = 0.5f,
                     .tta_flip = 1,
                     .probs = 1};
    pc.model.batch = 3;
    CHECK(predict_run(&pc, err) == 0, "predict --tile 8x8 --tta flip --probs: %s", err);
    float x[8 * 8 * 3], z[8 * 8 * 3];
    for (int i = 0; i < 2; i++) {
        int h, w, n, hm, wm, nm;
        snprintf(path, sizeof path, "%s/img%d.png", d.in, i);
        uint8_t *img = stbi_load(path, &w, &h, &n, 3);
        snprintf(path, sizeof path, "%s/img%d.png", outdir, i);
        uint8_t *mask = stbi_load(path, &wm, &hm, &nm, 1);
        CHECK(img && mask && wm == w && hm == h, "img%d: a mask of the image's size", i);
        snprintf(path, sizeof path, "%s/img%d_probs.safetensors", outdir, i);
        SafetensorsFile pf;
        CHECK(safetensors_read(path, &pf, err) == 0, "%s", err);
        const SafetensorsTensor *pt = safetensors_find(&pf, "probs");
        float *probs = NULL;
        if (pt && pt->dtype == DT_F16 && pt->ndim == 3 && pt->dims[0] == h && pt->dims[1] == w &&
            pt->dims[2] == 3) {
            probs = malloc(sizeof(float) * pt->numel);
            safetensors_tensor_f32(pt, probs);
        }
        CHECK(probs != NULL, "%s: tensor probs (%d,%d,3) fp16", path, h, w);
        double worst = 0;
        int wrong = 0;
        for (int p = 0; img && mask && wm == w && hm == h && p < h * w; p++) {
            for (int q = 0; q < 64; q++)
                for (int ch = 0; ch < 3; ch++) x[3 * q + ch] = img[3 * p + ch];
            ops_cpu.upload(&ops_cpu, net.act[g.input], x, sizeof x);
            net_forward(&net, 1, 0);
            ops_cpu.download(&ops_cpu, z, net.act[out], sizeof z);
            uint8_t cls;
            argmax_rows(&cls, z, 1, 3);
            wrong += mask[p] != cls;
            const double zmax = fmax(z[0], fmax(z[1], z[2])),
                         sum = exp(z[0] - zmax) + exp(z[1] - zmax) + exp(z[2] - zmax);
            for (int k = 0; probs && k < 3; k++)
                worst = fmax(worst, fabs(probs[3 * p + k] - exp(z[k] - zmax) / sum));
        }
        CHECK(wrong == 0, "img%d (%dx%d): %d pixels not of their own class", i, w, h, wrong);
        // fp16 keeps 11 bits: |Δp| ≤ 2^-12 for p ≤ 1, plus the blend's 2e-6
        CHECK(worst <= 1.0 / 4096 + 2e-6, "img%d: probabilities off by %g", i, worst);
        free(probs);
        safetensors_free(&pf);
        stbi_image_free(img);
        stbi_image_free(mask);
    }
    pc.model.model = "effv2-t";
    pc.model.height = pc.model.width = 32;
    CHECK(predict_run(&pc, err) == -1 && contains(err, "--tile") &&
                  contains(err, "tiles are for segmentation models"),
          "a classifier's --tile: '%s'", err);
    net_free(&net);
    graph_free(&g);
    rm_rf(d.dir);
}

// segnet predict --tile on the command line: a run's U-Net (trained at 8x8)
// predicts 8x8 tiles of a 21x30 image into a mask of that size, also with
// --scale 0.5; --overlap, --scale, --tta and --probs without --tile, an
// overlap of 1, a scale above 4 and an unknown --tta are refused.
TEST(predict_tile_cli) {
    const char *data = "/tmp/segnet_test_tilecli_data", *run = "/tmp/segnet_test_tilecli_run",
               *out = "/tmp/segnet_test_tilecli_out";
    rm_rf(data);
    rm_rf(run);
    rm_rf(out);
    write_seg_set(data, 4, 8, 8, 3);
    char args[1200], msg[4096], path[400];
    snprintf(args, sizeof args,
             "train --model unet --depth 1 --width 4 --size 8x8 --batch 2 --epochs 1 --classes 3 "
             "--class-weights 0,1,1 --data %s --out %s --device cpu",
             data, run);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "train: %s", msg);
    Rng r;
    rng_seed(&r, 2);
    snprintf(path, sizeof path, "%s/big/wide.png", data);
    mkdir("/tmp/segnet_test_tilecli_data/big", 0755);
    write_png_red(path, 30, 21, NULL, &r);
    snprintf(args, sizeof args,
             "predict --run %s --input %s/big --out %s --tile 8x8 --overlap 0.25 --tta flip "
             "--device cpu",
             run, data, out);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "predict --tile: %s", msg);
    int w, h, n;
    snprintf(path, sizeof path, "%s/wide.png", out);
    uint8_t *m = stbi_load(path, &w, &h, &n, 1);
    int over = 0;
    for (int p = 0; m && p < w * h; p++) over += m[p] > 2;
    CHECK(m && w == 30 && h == 21 && !over, "a 30x21 mask of classes 0..2 (%dx%d, %d over)", w, h,
          over);
    stbi_image_free(m);
    snprintf(args, sizeof args,
             "predict --run %s --input %s/big --out %s --overwrite --tile 8x8 --scale 0.5 "
             "--device cpu",
             run, data, out);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "predict --tile --scale 0.5: %s", msg);
    m = stbi_load(path, &w, &h, &n, 1);
    CHECK(m && w == 30 && h == 21, "--scale 0.5: the mask at the image's size (%dx%d)", w, h);
    stbi_image_free(m);
    static const struct {
        const char *opts, *want;
    } BAD[] = {
            {"--overlap 0.5", "--overlap, --scale, --tta and --probs work on tiles: give --tile"},
            {"--tta flip", "--overlap, --scale, --tta and --probs work on tiles"},
            {"--probs", "--overlap, --scale, --tta and --probs work on tiles"},
            {"--scale 0.5", "--overlap, --scale, --tta and --probs work on tiles"},
            {"--tile 8x8 --scale 5", "--scale 5 must be in (0, 4]"},
            {"--tile 8x8 --overlap 1", "--overlap 1: at most 0.875"},
            {"--tile 8x8 --tta mirror", "--tta 'mirror' must be flip or none"},
            {"--tile 8", "--tile '8' must be HxW"},
    };
    for (size_t k = 0; k < sizeof BAD / sizeof *BAD; k++) {
        snprintf(args, sizeof args, "predict --run %s --input %s/big --out %s --overwrite %s", run,
                 data, out, BAD[k].opts);
        CHECK(run_segnet(args, msg, sizeof msg) == 2 && contains(msg, BAD[k].want), "%s: '%s'",
              BAD[k].opts, msg);
    }
    rm_rf(data);
    rm_rf(run);
    rm_rf(out);
}

// Refused before anything is written: --out an existing file, an image that
// does not decode, two images with the same stem; and a folder that cannot be created.
TEST(predict_segmentation_refused) {
    PredictDirs d;
    Graph g; Net net; ModelCfg c;
    predict_fixture("predict_seg_bad", 1, &d, &g, &net, &c);
    char *dir = d.dir, *in = d.in, *wpath = d.wpath, file[300], outdir[300], path[400],
         err[SN_ERR_MAX];
    snprintf(file, sizeof file, "%s/preds.csv", dir);
    snprintf(outdir, sizeof outdir, "%s/masks", dir);
    Rng r; rng_seed(&r, 6);
    snprintf(path, sizeof path, "%s/good.png", in);
    write_png_red(path, 8, 8, NULL, &r);
    FILE *f = fopen(file, "w"); fputs("keep\n", f); fclose(f);
    struct stat sb;

    PredictCfg pc = {.model = c, .weights = wpath, .input = in, .out = file, .device = DEVICE_CPU};
    CHECK(predict_run(&pc, err) == -1 && contains(err, file) && contains(err, "not a folder"),
          "--out a file: '%s'", err);
    char *t = read_text(file);
    CHECK(t && !strcmp(t, "keep\n"), "the file is untouched");
    free(t);

    pc.out = outdir;
    snprintf(path, sizeof path, "%s/a.jpg", in);  // stb decodes by content: a PNG named .jpg
    write_png_red(path, 8, 8, NULL, &r);
    snprintf(path, sizeof path, "%s/a.png", in);
    write_png_red(path, 8, 8, NULL, &r);
    CHECK(predict_run(&pc, err) == -1 && contains(err, "a.jpg") && contains(err, "a.png") &&
                  contains(err, "both write"),
          "same stem: '%s'", err);
    CHECK(stat(outdir, &sb) != 0, "nothing created for the same stem");
    unlink(path);

    // sorted last: found before any image is predicted
    snprintf(path, sizeof path, "%s/z_corrupt.png", in);
    f = fopen(path, "wb"); fputs("\x89PNG\r\n\x1a\nnot really a png", f); fclose(f);
    CHECK(predict_run(&pc, err) == -1 && contains(err, "z_corrupt.png") &&
                  contains(err, "cannot decode"),
          "corrupt: '%s'", err);
    CHECK(stat(outdir, &sb) != 0, "nothing created for a corrupt image");
    unlink(path);

    snprintf(path, sizeof path, "%s/missing/masks", dir);
    pc.out = path;
    CHECK(predict_run(&pc, err) == -1 && contains(err, path) && contains(err, "No such file"),
          "no parent: '%s'", err);
    net_free(&net); graph_free(&g);
    rm_rf(dir);
}

// predict's colour legend, OUT/legend.png: per class a 24-pixel row with the
// class's colour (the palette by hand) and its number in a 3×5 font drawn 3
// times larger from x = 44 (the glyphs of 0, 1, 2 by hand); the progress as
// lines when stderr is not a terminal; an input that would overwrite the
// legend is refused before anything is written.
typedef struct { PredictCfg *pc; char err[SN_ERR_MAX]; } PredictJob;
static int predict_job(void *arg) { PredictJob *j = arg; return predict_run(j->pc, j->err); }
TEST(predict_legend_progress) {
    PredictDirs d;
    Graph g; Net net; ModelCfg c;
    predict_fixture("predict_legend", 2, &d, &g, &net, &c);
    char *dir = d.dir, *in = d.in, *wpath = d.wpath, outdir[300], path[400], err[SN_ERR_MAX];
    snprintf(outdir, sizeof outdir, "%s/out", dir);
    Rng r; rng_seed(&r, 8);
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/%s", in, SEG_NAMES[i]);
        write_png_red(path, SEG_W[i], SEG_H[i], NULL, &r);
    }
    // batch 2: progress after 2 and 3 images
    PredictCfg pc = {.model = c,
                     .weights = wpath,
                     .input = in,
                     .out = outdir,
                     .progress = 1,
                     .device = DEVICE_CPU};
    PredictJob job = {&pc, ""};
    int rc;
    char *text = with_stderr_captured(predict_job, &job, &rc);
    CHECK(rc == 0, "predict: %s", job.err);
    CHECK(!strcmp(text, "predict: 2/3 images\npredict: 3/3 images\n"), "progress into a file: '%s'",
          text);
    free(text);

    const uint8_t colours[3][3] = {{0, 0, 0}, {230, 25, 75}, {60, 180, 75}};  // black, red, green
    const char *glyphs[3][5] = {{"###", "#.#", "#.#", "#.#", "###"},
                                {".#.", "##.", ".#.", ".#.", "###"},
                                {"###", "..#", "###", "#..", "###"}};
    snprintf(path, sizeof path, "%s/legend.png", outdir);
    int w, h, comp;
    unsigned char *img = stbi_load(path, &w, &h, &comp, 3);
    CHECK(img && h == 3 * 24 && w >= 44 + 3 * 3, "%s: %d×%d", path, w, h);
    for (int k = 0; img && k < 3; k++) {
        const unsigned char *swatch = img + 3 * ((size_t)(k * 24 + 12) * w + 16);
        CHECK(!memcmp(swatch, colours[k], 3), "legend row %d: swatch %d,%d,%d", k, swatch[0],
              swatch[1], swatch[2]);
        for (int gy = 0; gy < 5; gy++)
            for (int gx = 0; gx < 3; gx++) {
                const unsigned char *px =
                        img + 3 * ((size_t)(k * 24 + 4 + 3 * gy + 1) * w + 44 + 3 * gx + 1);
                const int ink = glyphs[k][gy][gx] == '#';
                CHECK(ink ? px[0] == 0 && px[1] == 0 && px[2] == 0
                          : px[0] == 255 && px[1] == 255 && px[2] == 255,
                      "legend row %d: the digit's cell (%d,%d) is %d,%d,%d", k, gx, gy, px[0],
                      px[1], px[2]);
            }
    }
    stbi_image_free(img);

    rm_rf(outdir);
    snprintf(path, sizeof path, "%s/legend.jpg", in);  // its mask would be OUT/legend.png
    write_png_red(path, 8, 8, NULL, &r);
    pc.progress = 0;
    struct stat sb;
    CHECK(predict_run(&pc, err) == -1 && contains(err, "legend.jpg") &&
                  contains(err, "colour legend"),
          "an image named legend: '%s'", err);
    CHECK(stat(outdir, &sb) != 0, "nothing created for an image named legend");
    net_free(&net); graph_free(&g);
    rm_rf(dir);
}

// `segnet predict --run RUN` takes the model options from RUN/config.txt and
// RUN/best.safetensors (--last: last.safetensors): the same masks as predict
// given every option and the weights by hand; a folder that is not a run is
// refused naming its config.txt.
TEST(predict_from_run) {
    const char *data = "/tmp/segnet_test_predict_run_data", *run = "/tmp/segnet_test_predict_run";
    const char *o1 = "/tmp/segnet_test_predict_run_o1", *o2 = "/tmp/segnet_test_predict_run_o2";
    rm_rf(data); rm_rf(run); rm_rf(o1); rm_rf(o2);
    write_seg_set(data, 4, 8, 8, 9);
    char args[2048], msg[4096], a[600], b[600];
    snprintf(args, sizeof args,
             "train --model unet --depth 1 --width 2 --size 8x8 --batch 2 --epochs 2 --classes 3 "
             "--data %s --out %s --device cpu --threads 1",
             data, run);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "train: %s", msg);
    for (int last = 0; last < 2; last++) {
        rm_rf(o1); rm_rf(o2);
        snprintf(args, sizeof args,
                 "predict --run %s%s --input %s/images --out %s --device cpu --threads 1", run,
                 last ? " --last" : "", data, o1);
        CHECK(run_segnet(args, msg, sizeof msg) == 0, "predict --run%s: %s", last ? " --last" : "",
              msg);
        snprintf(args, sizeof args,
                 "predict --model unet --depth 1 --width 2 --size 8x8 --classes 3 --weights "
                 "%s/%s.safetensors "
                 "--input %s/images --out %s --device cpu --threads 1",
                 run, last ? "last" : "best", data, o2);
        CHECK(run_segnet(args, msg, sizeof msg) == 0, "predict by hand: %s", msg);
        for (int i = 0; i < 4; i++) {
            snprintf(a, sizeof a, "%s/i%02d.png", o1, i);
            snprintf(b, sizeof b, "%s/i%02d.png", o2, i);
            CHECK(files_equal(a, b), "%s and %s differ (%s)", a, b, last ? "--last" : "best");
        }
    }
    snprintf(args, sizeof args, "predict --run %s --input %s/images --out %s", data, data, o1);
    CHECK(run_segnet(args, msg, sizeof msg) == 2 && contains(msg, "config.txt"), "not a run: '%s'",
          msg);
    rm_rf(data); rm_rf(run); rm_rf(o1); rm_rf(o2);
}

// segnet export (fine-tuning issue, item 3): a run's weights in torchvision's
// names load with load_state_dict(strict=True) into torchvision's
// EfficientNetV2-S (with and without a hidden head) and into ref/'s U-Net on
// its features, unchanged; timm's names are tf_efficientnetv2_s's; and segnet
// reads every export back to the same validation loss as the run's own file.
SLOW_TEST(parity_live_export) {
    if (access("./segnet", X_OK) != 0) {
        CHECK(0, "./segnet is missing: build it with make");
        return;
    }
    const char *dir = "/tmp/segnet_test_export";
    rm_rf(dir);
    char path[600], args[2048], msg[4096], specs[4096] = "";
    Rng r; rng_seed(&r, 71);
    const char *classes[] = {"cat", "dog"};
    for (int k = 0; k < 2; k++) {
        snprintf(path, sizeof path, "mkdir -p %s/cls/%s %s/seg", dir, classes[k], dir);
        CHECK(system(path) == 0, "%s", path);
        snprintf(path, sizeof path, "%s/cls/%s", dir, classes[k]);
        write_png(path, "0.png", 32, 32, &r);
        write_png(path, "1.png", 32, 32, &r);
    }
    snprintf(path, sizeof path, "%s/seg", dir);
    write_seg_set(path, 2, 32, 32, 72);
    struct { const char *name, *model, *data, *extra, *names; int hidden;
    } runs[] = {
            {"plain", "effv2-s", "cls", "--padding symmetric", "torchvision,timm", 0},
            {"hidden", "effv2-s", "cls", "--head-hidden 16", "torchvision", 16},
            {"unet", "unet-effv2-s", "seg", "--padding symmetric --class-weights 0,1,1",
             "torchvision", 0},
    };
    for (size_t k = 0; k < sizeof runs / sizeof *runs; k++) {
        const int K = strcmp(runs[k].data, "seg") ? 2 : 3;
        snprintf(args, sizeof args,
                 "train --model %s --classes %d --size 32x32 --batch 2 --epochs 1 --freeze base "
                 "--lr 0.01 "
                 "%s --data %s/%s --val %s/%s --out %s/run_%s --threads 2",
                 runs[k].model, K, runs[k].extra, dir, runs[k].data, dir, runs[k].data, dir,
                 runs[k].name);
        if (run_segnet(args, msg, sizeof msg) != 0) {
            CHECK(0, "%s: %s", runs[k].name, msg);
            continue;
        }
        snprintf(args, sizeof args, "eval --run %s/run_%s", dir, runs[k].name);
        CHECK(run_segnet(args, msg, sizeof msg) == 0, "%s", msg);
        size_t n;
        char *want = read_file("/tmp/segnet_test_out.txt", &n);
        const char *names[] = {"torchvision", "timm", "segnet"};
        for (int i = 0; i < 3; i++) {
            if (i < 2 && !strstr(runs[k].names, names[i])) continue;
            snprintf(args, sizeof args,
                     "export --run %s/run_%s --names %s --out %s/%s_%s.safetensors", dir,
                     runs[k].name, names[i], dir, runs[k].name, names[i]);
            CHECK(run_segnet(args, msg, sizeof msg) == 0 && contains(msg, "wrote"), "%s", msg);
            if (i < 2) {
                size_t len = strlen(specs);
                snprintf(specs + len, sizeof specs - len, " %s/%s_%s.safetensors:%s:%d:%s:%d", dir,
                         runs[k].name, names[i], runs[k].model, K, names[i], runs[k].hidden);
            }
            // read back by segnet: the validation of the run's own weights, to the digit
            snprintf(args, sizeof args,
                     "eval --weights %s/%s_%s.safetensors --model %s --classes %d --size 32x32 %s "
                     "--data %s/%s",
                     dir, runs[k].name, names[i], runs[k].model, K, runs[k].extra, dir,
                     runs[k].data);
            CHECK(run_segnet(args, msg, sizeof msg) == 0, "%s", msg);
            char *got = read_file("/tmp/segnet_test_out.txt", &n);
            CHECK(want && got && !strcmp(want, got),
                  "%s, %s names: eval gives\n%s, the run's own weights\n%s", runs[k].name, names[i],
                  got ? got : "", want ? want : "");
            free(got);
        }
        free(want);
    }
    snprintf(args, sizeof args, "export --run %s/run_hidden --names timm --out %s/x.safetensors",
             dir, dir);
    CHECK(run_segnet(args, msg, sizeof msg) == 1 && contains(msg, "has no timm name"), "%s", msg);
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 ref/check_export.py%s", specs);
    CHECK(run_shell(cmd, msg, sizeof msg) == 0, "ref/check_export.py: %s", msg);
    size_t n;
    char *said = read_file("/tmp/segnet_test_out.txt", &n);
    int oks = 0;
    for (const char *p = said; p && (p = strstr(p, "ok ")); p += 3) oks++;
    CHECK(oks == 4, "4 exports checked by PyTorch: %s", said ? said : "");
    free(said);
    rm_rf(dir);
}

// The plain unet back to PyTorch (issue 48): a unet run's export loads with
// load_state_dict(strict=True) into ref/segnet_unet.py's SegnetUNet (written from segnet's
// architecture, not from segnet's code), and its softmax on each image equals segnet
// predict's probabilities (--probs, fp16: within 1e-3) and its argmax segnet predict's mask
// (wherever the top two differ by more than 1e-3). The export's report names the class.
TEST(parity_live_unet_export) {
    const char *dir = "/tmp/segnet_test_unet_export";
    rm_rf(dir);
    char data[300], args[2048], msg[4096];
    snprintf(data, sizeof data, "%s/data", dir);
    write_seg_set(data, 4, 16, 16, 48);
    const char *model = "--model unet --depth 2 --width 4 --classes 3 --size 16x16";
    snprintf(args, sizeof args,
             "train %s --batch 2 --epochs 1 --lr 0.01 --data %s --out %s/run --device cpu "
             "--threads 2",
             model, data, dir);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "train: %s", msg);
    snprintf(args, sizeof args, "export --run %s/run --out %s/unet.safetensors", dir, dir);
    CHECK(run_segnet(args, msg, sizeof msg) == 0 && contains(msg, "SegnetUNet") &&
                  !contains(msg, "torchvision"),
          "export of a unet: '%s' (want its PyTorch class named)", msg);
    snprintf(args, sizeof args,
             "predict --run %s/run --input %s/images --out %s/masks --device cpu --threads 2", dir,
             data, dir);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "predict: %s", msg);
    snprintf(args, sizeof args,
             "predict --run %s/run --input %s/images --out %s/probs --tile 16x16 --probs "
             "--device cpu --threads 2",
             dir, data, dir);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "predict --probs: %s", msg);
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "/usr/bin/python3 ref/segnet_unet.py %s/unet.safetensors 3 2 4 %s/images %s/masks "
             "%s/probs",
             dir, data, dir, dir);
    CHECK(run_shell(cmd, msg, sizeof msg) == 0, "ref/segnet_unet.py: %s", msg);
    size_t n;
    char *said = read_file("/tmp/segnet_test_out.txt", &n);
    CHECK(said && contains(said, "ok 4 images"), "ref/segnet_unet.py said: %s", said ? said : "");
    if (g_verbose && said) printf("    %s", said);
    free(said);
    rm_rf(dir);
}

// A unet-effv2 to segmentation_models_pytorch (issue 48): a unet-effv2-s run with
// --bottleneck stage --padding same exports with --names smp to a file that
// smp.Unet(encoder_name="tu-tf_efficientnetv2_s", encoder_weights=None, classes=K) loads
// with load_state_dict(strict=True) and that predicts as segnet predict does
// (ref/check_smp_export.py: the argmax where the top two differ by more than 1e-3, the
// softmax within 1e-3 of the fp16 --probs); segnet reads the file back to the run's own
// validation. The models smp has no such Unet for are refused with the reason.
TEST(parity_live_smp_export) {
    const char *dir = "/tmp/segnet_test_smp_export";
    rm_rf(dir);
    char data[300], args[2048], msg[4096];
    snprintf(data, sizeof data, "%s/data", dir);
    write_seg_set(data, 2, 32, 32, 49);
    const char *model = "--model unet-effv2-s --classes 3 --size 32x32 --class-weights 1,1,1";
    snprintf(args, sizeof args,
             "train %s --bottleneck stage --batch 2 --epochs 1 --freeze base --lr 0.01 --data %s "
             "--out %s/run_stage --device cpu --threads 2",
             model, data, dir);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "train: %s", msg);
    // the run as if trained with another bottleneck or padding (config.txt decides the model)
    const struct { const char *name, *edit, *refusal; } runs[] = {
            {"stage", "", NULL},
            {"head", "s/^bottleneck = stage/bottleneck = head/", "train with --bottleneck stage"},
            {"symmetric", "s/^padding = same/padding = symmetric/", "train with --padding same"},
    };
    char cmd[2048];
    for (int k = 0; k < 3; k++) {
        if (runs[k].refusal) {
            snprintf(cmd, sizeof cmd,
                     "cp -r %s/run_stage %s/run_%s && sed -i '%s' %s/run_%s/config.txt", dir, dir,
                     runs[k].name, runs[k].edit, dir, runs[k].name);
            CHECK(run_shell(cmd, msg, sizeof msg) == 0, "%s: %s", cmd, msg);
        }
        snprintf(args, sizeof args, "export --run %s/run_%s --names smp --out %s/%s.safetensors",
                 dir, runs[k].name, dir, runs[k].name);
        const int rc = run_segnet(args, msg, sizeof msg);
        if (runs[k].refusal)
            CHECK(rc == 1 && contains(msg, runs[k].refusal), "%s: '%s'", runs[k].name, msg);
        else
            CHECK(rc == 0 && contains(msg, "836 tensors") &&
                          contains(msg, "Unet(encoder_name=\"tu-tf_efficientnetv2_s\""),
                  "export --names smp: '%s' (want smp's 836 tensors and the constructor)", msg);
    }
    snprintf(args, sizeof args, "train --model effv2-t --bottleneck stage --data %s", data);
    CHECK(run_segnet(args, msg, sizeof msg) == 2 && contains(msg, "--bottleneck") &&
                  contains(msg, "unet-effv2-*"),
          "--bottleneck on a classifier: '%s'", msg);
    // segnet reads smp's names back
    snprintf(args, sizeof args, "eval --run %s/run_stage --data %s", dir, data);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "eval: %s", msg);
    size_t n;
    char *want = read_file("/tmp/segnet_test_out.txt", &n);
    snprintf(args, sizeof args,
             "eval --weights %s/stage.safetensors %s --bottleneck stage --batch 2 --data %s", dir,
             model, data);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "%s", msg);
    char *got = read_file("/tmp/segnet_test_out.txt", &n);
    CHECK(want && got && !strcmp(want, got), "eval of the smp export:\n%s, the run's own:\n%s",
          got ? got : "", want ? want : "");
    free(want);
    free(got);
    char python[600];
    if (smp_python(python, sizeof python)) {
        rm_rf(dir);
        SKIP(SKIP_NO_SMP);
    }
    snprintf(args, sizeof args,
             "predict --run %s/run_stage --input %s/images --out %s/masks --device cpu --threads 2",
             dir, data, dir);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "predict: %s", msg);
    snprintf(args, sizeof args,
             "predict --run %s/run_stage --input %s/images --out %s/probs --tile 32x32 --probs "
             "--device cpu --threads 2",
             dir, data, dir);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "predict --probs: %s", msg);
    snprintf(cmd, sizeof cmd,
             "%s ref/check_smp_export.py %s/stage.safetensors s 3 %s/images %s/masks %s/probs",
             python, dir, data, dir, dir);
    CHECK(run_shell(cmd, msg, sizeof msg) == 0, "ref/check_smp_export.py: %s", msg);
    char *said = read_file("/tmp/segnet_test_out.txt", &n);
    CHECK(said && contains(said, "ok 2 images"), "ref/check_smp_export.py said: %s",
          said ? said : "");
    if (g_verbose && said) printf("    %s", said);
    free(said);
    rm_rf(dir);
}

// ----------------------------------------------------------------------------
// what README says, against the code (issue 48: what a practitioner reads is true)

// The section of the Markdown file at path under the heading line `title` ("## X", "### X"), up
// to the next heading of its level or above; a copy, or NULL if the file has no such heading
static char *md_section(const char *path, const char *title) {
    size_t n;
    char *readme = read_file(path, &n), *out = NULL;
    char line[300];
    snprintf(line, sizeof line, "\n%s\n", title);
    const char *start = readme ? strstr(readme, line) : NULL;
    if (start) {
        const int level = (int)strspn(title, "#");
        const char *end = start + strlen(line);
        for (; (end = strstr(end, "\n#")); end++) {
            const int l = (int)strspn(end + 1, "#");
            if (l <= level && end[1 + l] == ' ') break;
        }
        out = strndup(start, end ? (size_t)(end - start) : strlen(start));
    }
    free(readme);
    return out;
}

// README's section under the heading line `title`
static char *readme_section(const char *title) { return md_section("README.md", title); }

// `./segnet CMD --help`'s text (stdout), or "" where it cannot run
static char *segnet_help(const char *cmd) {
    char args[100], msg[4096];
    snprintf(args, sizeof args, "%s --help", cmd);
    size_t n;
    char *text = run_segnet(args, msg, sizeof msg) == 0 ? read_file("/tmp/segnet_test_out.txt", &n)
                                                         : NULL;
    return text ? text : strdup("");
}

// the build's packages as the Makefile installs them, and make install honouring DESTDIR
// and PREFIX (a copy of ./segnet, nothing else)
TEST(readme_build_and_install) {
    char *two = readme_section("## Two commands");
    size_t n;
    char *mk = read_file("Makefile", &n);
    CHECK(two && mk, "README.md's \"## Two commands\" or the Makefile is missing");
    if (!two || !mk) { free(two); free(mk); return; }
    const char *deb = strstr(mk, "\nDEB_PACKAGES");
    char packages[600] = "";
    if (deb) snprintf(packages, sizeof packages, "%.*s", (int)strcspn(deb + 1, "\n"), deb + 1);
    CHECK(contains(packages, "libopenblas-openmp-dev") &&
                  contains(two, "`libopenblas-openmp-dev`") && !contains(two, "libopenblas-dev"),
          "README's build packages should be the Makefile's DEB_PACKAGES (libopenblas-openmp-dev)");
    CHECK(contains(two, "`./segnet`") && contains(two, "make install PREFIX=") &&
                  contains(two, "DESTDIR") && contains(two, "PREFIX=/usr/local"),
          "README should say the program is ./segnet and how make install puts it on PATH");
    const char *dir = "/tmp/segnet_test_install";
    rm_rf(dir);
    char cmd[600], msg[4096];
    snprintf(cmd, sizeof cmd,
             "env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make -s install DESTDIR=%s PREFIX=/opt/sn",
             dir);
    CHECK(run_shell(cmd, msg, sizeof msg) == 0, "make install: %s", msg);
    CHECK(files_equal("./segnet", "/tmp/segnet_test_install/opt/sn/bin/segnet"),
          "make install DESTDIR=%s PREFIX=/opt/sn: no copy of ./segnet in %s/opt/sn/bin", dir,
          dir);
    rm_rf(dir);
    free(two);
    free(mk);
}

// the source files of folder dir ("." or a folder of it) that README's Files table does not
// name (as `name` at the top, `dir/name` in a folder): each a failed check; returns how many
// source files dir holds
static int files_table_covers(const char *files, const char *dir) {
    static const char *const EXTS[] = {".c", ".h", ".cu", ".cuh", ".cpp", ".awk", ".sh"};
    DIR *d = opendir(dir);
    struct dirent *e;
    int seen = 0;
    while (d && (e = readdir(d))) {
        const char *dot = strrchr(e->d_name, '.');
        int source = 0;
        for (size_t k = 0; dot && k < sizeof EXTS / sizeof *EXTS; k++)
            source |= !strcmp(dot, EXTS[k]);
        if (!source) continue;
        char quoted[600];
        if (!strcmp(dir, ".")) snprintf(quoted, sizeof quoted, "`%s`", e->d_name);
        else snprintf(quoted, sizeof quoted, "`%s/%s`", dir, e->d_name);
        CHECK(contains(files, quoted), "README's Files table does not name %s", quoted);
        seen++;
    }
    if (d) closedir(d);
    return seen;
}

// every "<N> compute entries" of the file at path: a failed check unless N is n; returns how
// many there are
static int compute_entry_counts(const char *path, int n) {
    size_t size;
    char *text = read_file(path, &size);
    CHECK(text != NULL, "%s: cannot read it (the tests run in the repository)", path);
    int found = 0;
    for (const char *p = text ? strstr(text, "compute entries") : NULL; p;
         p = strstr(p + 1, "compute entries")) {
        const char *q = p;
        while (q > text && isspace((unsigned char)q[-1])) q--;
        const char *digits = q;
        while (digits > text && isdigit((unsigned char)digits[-1])) digits--;
        if (digits == q) continue;  // no number before it
        found++;
        const int said = atoi(digits);
        CHECK(said == n, "%s says %d compute entries; SN_COMPUTE_OPS lists %d", path, said, n);
    }
    free(text);
    return found;
}

// The contract's list in text (after "lists, in its order:", up to "; and the optional"): each
// `name` against ops[0..n), in order; a failed check for the first that differs, or a count
// that does not agree
static void contract_list_agrees(const char *text, const char *const *ops, int n) {
    const char *p = text ? strstr(text, "lists, in its order:") : NULL;
    const char *end = p ? strstr(p, "; and the optional") : NULL;
    CHECK(p && end, "doc/porting.md's contract lists no compute entries (\"lists, in its "
          "order: `fill`, ...; and the optional\")");
    if (!p || !end) return;
    int k = 0;
    for (p = strchr(p, '`'); p && p < end; p = strchr(p, '`')) {
        const char *q = strchr(p + 1, '`');
        if (!q || q > end) break;
        const int len = (int)(q - p - 1);
        if (k < n) {
            const int same = (int)strlen(ops[k]) == len && !strncmp(p + 1, ops[k], (size_t)len);
            CHECK(same, "doc/porting.md's contract lists `%.*s` where SN_COMPUTE_OPS has %s "
                  "(entry %d)", len, p + 1, ops[k], k + 1);
            if (!same) return;
        }
        k++;
        p = q + 1;
    }
    CHECK(k == n, "doc/porting.md's contract lists %d compute entries, SN_COMPUTE_OPS %d", k, n);
}

// the Files table names every source file here and in the folders; the porting guide's count
// and list of the compute entries are SN_COMPUTE_OPS's, and its order names every entry (by
// name, or a group as `prefix_*`)
TEST(readme_files_and_ops) {
    char *files = readme_section("## Files"),
         *port = md_section("doc/porting.md", "## Port in this order");
    CHECK(files && port, "no \"## Files\" in README.md or \"## Port in this order\" in "
          "doc/porting.md");
    if (!files || !port) { free(files); free(port); return; }
    int seen = files_table_covers(files, ".");
    DIR *d = opendir(".");
    struct dirent *e;
    struct stat sb;
    while (d && (e = readdir(d)))
        if (e->d_name[0] != '.' && stat(e->d_name, &sb) == 0 && S_ISDIR(sb.st_mode))
            seen += files_table_covers(files, e->d_name);
    if (d) closedir(d);
    CHECK(seen >= 20, "only %d source files found in the working directory", seen);
#define OP_NAME(name) #name,
    static const char *const OPS[] = {SN_COMPUTE_OPS(OP_NAME)};
#undef OP_NAME
    const int n_ops = (int)(sizeof OPS / sizeof *OPS);
    int counts = 0;
    static const char *const DOCS[] = {"doc/porting.md", "doc/design.md", "README.md"};
    for (size_t k = 0; k < sizeof DOCS / sizeof *DOCS; k++)
        counts += compute_entry_counts(DOCS[k], n_ops);
    CHECK(counts >= 2, "doc/porting.md should say how many compute entries there are (the "
          "contract and a minimum port); %d places do", counts);
    char *contract = md_section("doc/porting.md", "## The contract: one ops table and its backend");
    CHECK(contract, "doc/porting.md: no \"## The contract: one ops table and its backend\"");
    contract_list_agrees(contract, OPS, n_ops);
    free(contract);
    for (size_t k = 0; k < sizeof OPS / sizeof *OPS; k++) {
        char quoted[128];
        snprintf(quoted, sizeof quoted, "`%s`", OPS[k]);
        int named = contains(port, quoted);
        for (const char *u = strchr(OPS[k], '_'); u && !named; u = strchr(u + 1, '_')) {
            snprintf(quoted, sizeof quoted, "`%.*s*`", (int)(u + 1 - OPS[k]), OPS[k]);
            named = contains(port, quoted);
        }
        CHECK(named, "doc/porting.md's \"Port in this order\" does not name the op %s", OPS[k]);
    }
    free(files);
    free(port);
}

// The region terms keep an absent class's weight in the denominator (as README and --help
// say, smp's convention): K = 3, weights 1, 2, 5, class 2 absent from the masks (G = 0),
// dice with s = 0.5 by hand: L = (1·(1 - S_0) + 2·(1 - S_1) + 0) / 8.
// A class absent from both masks and predictions is left out of the mean IoU and Dice.
TEST(readme_region_and_metric_claims) {
    const float w[3] = {1, 2, 5};
    // I, P, G per class
    const float sums[9] = {3.0f, 1.5f, 0.0f, 4.0f, 2.5f, 1.5f, 5.0f, 2.0f, 0.0f};
    RegionArgs r = {0};
    r.a = 2.0f; r.alpha = 1.0f; r.beta = 1.0f; r.gamma = 1.0f; r.smooth = 0.5f; r.scale = 1.0f;
    float coef[6];
    const double got = region_coefs(&r, w, 3, sums, coef);
    const double s0 = (2 * 3.0 + 0.5) / (4.0 + 5.0 + 0.5), s1 = (2 * 1.5 + 0.5) / (2.5 + 2.0 + 0.5);
    CHECK_NEAR(got, (1 * (1 - s0) + 2 * (1 - s1)) / 8.0, 1e-6, "dice with class 2 absent");
    char *menu = readme_section("### The loss menu");
    CHECK(menu && contains(menu, "keeps its w_c in the denominator") &&
                  contains(menu, "segmentation_models_pytorch 0.6") && contains(menu, "0.3.x"),
          "README's loss menu: the denominator over every class and smp's version");
    char *train = segnet_help("train");
    CHECK(contains(train, "keeps its w_c") && !contains(train, "(an absent class"),
          "segnet train --help: the region terms' denominator");
    free(train);
    CHECK(menu && contains(menu, "pixel count under `--loss-norm keras`"),
          "README: how the epoch weighs the region terms under --loss-norm keras");
    CHECK(menu && contains(menu, "`sm.metrics.FScore()` | `val_dice`") &&
                  contains(menu, "left out of `val_dice` and `val_mIoU`"),
          "README: val_dice against FScore() with an absent class");
    // class 1 absent everywhere: mean over classes 0 and 2, IoU 3/4 and 2/3 by hand
    const int64_t cm[9] = {3, 0, 1, 0, 0, 0, 0, 0, 2};
    double iou[3], dice[3];
    Metrics m = {.iou = iou, .dice = dice};
    metrics_compute(cm, 3, (const float[3]){1, 1, 1}, &m);
    CHECK_NEAR(m.mean_iou, (3.0 / 4 + 2.0 / 3) / 2, 1e-12, "mean IoU without the absent class");
    CHECK_NEAR(m.mean_dice, (6.0 / 7 + 4.0 / 5) / 2, 1e-12, "mean Dice without the absent class");
    free(menu);
}

// eval's --batch with --run, the seed-000 example's --sync-bn, the tiles' multiples
TEST(readme_usage_claims) {
    char *eval = segnet_help("eval"), *predict = segnet_help("predict");
    CHECK(contains(eval, "with --run the run's batch") && contains(eval, "val_loss depends on B"),
          "segnet eval --help: --batch's default with --run and what depends on it");
    char *ft = readme_section("## Fine-tune from ImageNet weights");
    const char *seed0 = ft ? strstr(ft, "--replicas 2") : NULL;
    CHECK(seed0 && !strncmp(seed0, "--replicas 2 --sync-bn", 22),
          "README's seed-000 example on two GPUs should have --sync-bn");
    char *pr = readme_section("## Predict");
    CHECK(pr && contains(pr, "2^depth for `unet`") && contains(predict, "2^depth for unet"),
          "README and predict --help: the tiles' multiple for the plain unet");
    // the claim itself: a depth-3 unet takes sides that are multiples of 8
    for (int side = 4; side <= 16; side += 4) {
        ModelCfg c = model_cfg_default();
        c.depth = 3;
        c.width_base = 2;
        c.height = c.width = side;
        Graph g;
        graph_init(&g);
        const int built = model_build(&g, &c) >= 0;
        CHECK(built == (side % 8 == 0), "unet depth 3 at %dx%d: built %d", side, side, built);
        graph_free(&g);
    }
    // gap 4: the default unet's parameters, and the quickstart's, as README states them
    char *own = readme_section("## Train on your own data");
    int64_t counts[2];
    for (int k = 0; k < 2; k++) {
        ModelCfg c = model_cfg_default();
        c.model = "unet";
        c.classes = 4;
        c.height = c.width = 64;
        if (k) { c.depth = 3; c.width_base = 16; }
        Graph g;
        graph_init(&g);
        CHECK(model_build(&g, &c) >= 0, "%s", g.err);
        counts[k] = 0;
        for (int i = 0; i < g.n_params; i++) counts[k] += (int64_t)g.params[i].count;
        graph_free(&g);
    }
    char said[200];
    snprintf(said, sizeof said,
             "is depth 4, width 32: %d,%03d,%03d parameters with 4 classes, %d×",
             (int)(counts[0] / 1000000), (int)(counts[0] / 1000 % 1000), (int)(counts[0] % 1000),
             (int)(counts[0] / counts[1]));
    for (char *p = own; p && *p; p++) *p = *p == '\n' ? ' ' : *p;
    CHECK(own && contains(own, said) && contains(own, "(488,052;") && counts[1] == 488052,
          "README's default unet: '%s' (the quickstart's %lld)", said, (long long)counts[1]);
    free(own);
    // item 9: the tiled prediction's host bytes a pixel are the plan's (images.c)
    char mem[120];
    snprintf(mem, sizeof mem, "7 + 4K bytes a pixel, %d with 4 classes", TILED_HOST_BYTES(4));
    for (char *p = pr; p && *p; p++) *p = *p == '\n' ? ' ' : *p;
    CHECK(pr && contains(pr, mem) && TILED_HOST_BYTES(0) == 7 && TILED_HOST_BYTES(1) == 11,
          "README's --tile memory, '%s', against TILED_HOST_BYTES: %d + %d·K", mem,
          TILED_HOST_BYTES(0), TILED_HOST_BYTES(1) - TILED_HOST_BYTES(0));
    free(ft);
    free(pr);
    free(eval);
    free(predict);
}

// README's "Back to PyTorch", as a user would copy it: its sh block (the venv,
// with HOME in a fresh folder) and its python block, run as they are in a
// folder holding a link to ref/, the two exports it names (the seed's
// classifier, a unet-effv2-s, each trained an epoch at 32x32) and a 32x32
// image. Its classifier probabilities must be segnet predict's (1e-4: fp32
// on both sides, no resize).
static char *readme_block(const char *text, const char *section, const char *lang) {
    const char *at = strstr(text, section);
    char fence[32];
    snprintf(fence, sizeof fence, "\n```%s\n", lang);
    const char *start = at ? strstr(at, fence) : NULL,
               *end = start ? strstr(start + strlen(fence), "\n```\n") : NULL;
    return end ? strndup(start + strlen(fence), (size_t)(end - start - strlen(fence)) + 1) : NULL;
}

TEST(heavy_readme_pytorch_story) {
    const char *dir = "/tmp/segnet_test_readme", *section = "\n### Back to PyTorch\n";
    char path[700], cmd[4096], msg[4096], cwd[512];
    size_t n;
    char *readme = read_file("README.md", &n),
         *sh = readme ? readme_block(readme, section, "sh") : NULL,
         *py = readme ? readme_block(readme, section, "python") : NULL;
    CHECK(sh && py, "README.md: no sh and python blocks under \"### Back to PyTorch\"");
    CHECK(getcwd(cwd, sizeof cwd) != NULL, "getcwd");
    rm_rf(dir);
    snprintf(path, sizeof path, "%s/home", dir);
    CHECK(mkdir(dir, 0755) == 0 && mkdir(path, 0755) == 0, "mkdir %s", path);
    snprintf(path, sizeof path, "%s/setup.sh", dir);
    if (sh) write_file_bytes(path, sh, strlen(sh));
    // Debian's python3
    snprintf(cmd, sizeof cmd, "cd %s && HOME=%s/home PATH=/usr/bin:/bin sh -e setup.sh", dir, dir);
    if (sh && py && run_shell(cmd, msg, sizeof msg) != 0) {
        printf("    not run: README's venv set-up failed here: %.300s\n", msg);
        g_skip = "a package from PyPI could not be installed (see above)";
    }
    snprintf(path, sizeof path, "%s/story.py", dir);
    if (py) write_file_bytes(path, py, strlen(py));
    // the data, the two runs and their exports
    char data[600], csv[700], runs[2][700];
    snprintf(data, sizeof data, "%s/data", dir);
    write_seg_set(data, 4, 32, 32, 61);
    snprintf(csv, sizeof csv, "%s/list.csv", data);
    const char *rows = "images/i00.png,0\nimages/i01.png,5\nimages/i02.png,3\n";
    write_file_bytes(csv, rows, strlen(rows));
    const char *train[2] = {
            "--model effv2-l --classes 6 --head-hidden 128 --dropout 0.2 --padding symmetric",
            "--model unet-effv2-s --classes 4 --padding symmetric"};
    const char *export[2] = {"model.safetensors", "unet.safetensors"};
    for (int k = 0; k < 2 && !g_skip; k++) {
        snprintf(runs[k], sizeof runs[k], "%s/run%d", dir, k);
        snprintf(cmd, sizeof cmd,
                 "train %s --size 32x32 --batch 2 --epochs 1 --data %s --out %s --device cpu "
                 "--threads 2",
                 train[k], k ? data : csv, runs[k]);
        CHECK(run_segnet(cmd, msg, sizeof msg) == 0, "%s: %s", cmd, msg);
        snprintf(cmd, sizeof cmd, "export --run %s --out %s/%s", runs[k], dir, export[k]);
        CHECK(run_segnet(cmd, msg, sizeof msg) == 0, "%s: %s", cmd, msg);
    }
    snprintf(cmd, sizeof cmd,
             "cp %s/images/i03.png %s/image.png && ln -s %s/ref %s/ref && mkdir %s/in && cp "
             "%s/image.png %s/in/",
             data, dir, cwd, dir, dir, dir, dir);
    CHECK(system(cmd) == 0, "%s", cmd);
    if (!g_skip && !g_failures) {
        snprintf(cmd, sizeof cmd, "cd %s && %s/home/segnet-venv/bin/python story.py >story.txt",
                 dir, dir);
        CHECK(run_shell(cmd, msg, sizeof msg) == 0, "README's python block: %s", msg);
        snprintf(cmd, sizeof cmd, "predict --run %s --input %s/in --out %s/ours.csv --device cpu",
                 runs[0], dir, dir);
        CHECK(run_segnet(cmd, msg, sizeof msg) == 0, "%s: %s", cmd, msg);
        snprintf(path, sizeof path, "%s/story.txt", dir);
        char *story = read_file(path, &n), *ours = NULL;
        snprintf(path, sizeof path, "%s/ours.csv", dir);
        ours = read_file(path, &n);
        const char *theirs = story ? strstr(story, "probabilities: [") : NULL,
                   *row = ours ? strstr(ours, "image.png,") : NULL;
        CHECK(theirs && row && story && contains(story, "mask: (1, 32, 32)"),
              "story: '%s', segnet: '%s'", story ? story : "", ours ? ours : "");
        double worst = 0;
        if (theirs && row) {
            const char *p = strchr(row, ',') + 1, *q = theirs + strlen("probabilities: [");
            p = strchr(p, ',');  // past pred
            for (int k = 0; k < 6 && p && q; k++) {
                char *e;
                double a = strtod(p + 1, NULL), b = strtod(q, &e);
                worst = fmax(worst, fabs(a - b));
                p = strchr(p + 1, ',');
                q = *e == ',' ? e + 1 : NULL;
                CHECK(k == 5 || (p && q), "probability %d: a row or the list ends early", k);
            }
            CHECK(worst <= 1e-4, "README's classifier and segnet predict differ by %.3g (max |dp|)",
                  worst);
            printf("    README's PyTorch story: max |dp| %.3g against segnet predict\n", worst);
        }
        free(story); free(ours);
    }
    free(readme); free(sh); free(py);
    if (!g_failures) rm_rf(dir);
}

// ----------------------------------------------------------------------------
// outputs never replace what the user owns (issue 31)

// Finding 1: predict writes nothing into its input folder (given by any path
// to it), never replaces an input image or list (even with --overwrite, even
// under a name it wrote before), and replaces an existing file only with
// --overwrite and only one it wrote itself.
TEST(predict_outputs_protected) {
    PredictDirs d;
    Graph g; Net net; ModelCfg c;
    predict_fixture("predict_own", 1, &d, &g, &net, &c);
    char *dir = d.dir, *in = d.in, path[600], out[400], err[SN_ERR_MAX];
    Rng r; rng_seed(&r, 8);
    const char *names[2] = {"a.png", "b.png"};
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/%s", in, names[i]);
        write_png_red(path, 8, 8, NULL, &r);
        keep_copy(path);  // in/x.png.orig: not an image name, so not an input
    }
    PredictCfg pc = {.model = c,
                     .weights = d.wpath,
                     .input = in,
                     .out = in,
                     .device = DEVICE_CPU,
                     .overwrite = 1};
    // the input folder itself, a folder inside it, and both through a link to it
    snprintf(out, sizeof out, "%s/pred", in);
    char to_in[400], via_link[400];
    snprintf(to_in, sizeof to_in, "%s/link", dir);
    snprintf(via_link, sizeof via_link, "%s/link/pred", dir);
    CHECK(symlink("images", to_in) == 0, "symlink: %s", strerror(errno));
    const char *inside[4] = {in, out, to_in, via_link};
    for (int k = 0; k < 4; k++) {
        pc.out = inside[k];
        CHECK(predict_run(&pc, err) == -1 && contains(err, "is, or is inside, the input folder"),
              "--out %s: '%s'", inside[k], err);
    }
    struct stat sb;
    CHECK(stat(out, &sb) != 0, "%s was created", out);
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/%s", in, names[i]);
        CHECK(unchanged(path), "%s changed", path);
    }
    // a list of the images: the masks would land on them (in is not the input folder now)
    char csv[400];
    snprintf(csv, sizeof csv, "%s/list.csv", dir);
    write_file_bytes(csv, "images/a.png\nimages/b.png\n", 26);
    pc.input = csv;
    pc.out = in;
    CHECK(predict_run(&pc, err) == -1 && contains(err, "would replace the input image") &&
                  contains(err, "a.png"),
          "masks over their images: '%s'", err);
    // an existing file that predict did not write: refused, with --overwrite too
    snprintf(out, sizeof out, "%s/out", dir);
    mkdir(out, 0755);
    snprintf(path, sizeof path, "%s/b.png", out);
    write_file_bytes(path, "mine", 4);
    pc.input = in;
    pc.out = out;
    pc.overwrite = 0;
    CHECK(predict_run(&pc, err) == -1 && contains(err, "b.png: exists") &&
                  contains(err, "--overwrite"),
          "'%s'", err);
    pc.overwrite = 1;
    CHECK(predict_run(&pc, err) == -1 && contains(err, "not an output of segnet predict"),
          "--overwrite: '%s'", err);
    char *t = read_text(path);
    CHECK(t && !strcmp(t, "mine"), "the user's file is untouched");
    free(t);
    unlink(path);
    pc.overwrite = 0;
    CHECK(predict_run(&pc, err) == 0, "into a folder without those names: %s", err);
    pc.overwrite = 1;
    CHECK(predict_run(&pc, err) == 0, "again, --overwrite: %s", err);
    // a name predict wrote, now a hard link to an input image: the image is never replaced
    unlink(path);
    char image_b[600];
    snprintf(image_b, sizeof image_b, "%s/b.png", in);
    CHECK(link(image_b, path) == 0, "link: %s", strerror(errno));
    CHECK(predict_run(&pc, err) == -1 && contains(err, "would replace the input image") &&
                  contains(err, image_b),
          "hard link: '%s'", err);
    CHECK(unchanged(image_b), "%s changed", image_b);
    unlink(path);

    // a classifier's CSV: never its input list or an image, never inside the input folder
    Graph cg; Net cnet;
    tiny_net(&cg, &cnet, 3, 5);
    char cw[400], cdir[300], clist[500], cimage[500];
    snprintf(cw, sizeof cw, "%s/c.safetensors", dir);
    CHECK(net_save_weights(&cnet, cw, err) == 0, "%s", err);
    snprintf(cdir, sizeof cdir, "%s/cls", dir);
    mkdir(cdir, 0755);
    write_png(cdir, "x.png", 32, 32, &r);
    snprintf(cimage, sizeof cimage, "%s/x.png", cdir);
    snprintf(clist, sizeof clist, "%s/list.csv", dir);
    write_file_bytes(clist, "path,label\ncls/x.png,1\n", 23);
    keep_copy(clist); keep_copy(cimage);
    ModelCfg cc = model_cfg_default();
    cc.model = "effv2-t"; cc.classes = 3; cc.height = 32; cc.width = 32;
    PredictCfg pcc = {.model = cc,
                      .weights = cw,
                      .input = clist,
                      .out = clist,
                      .device = DEVICE_CPU,
                      .overwrite = 1};
    CHECK(predict_run(&pcc, err) == -1 && contains(err, "would replace the input list"),
          "--out the list: '%s'", err);
    pcc.out = cimage;
    CHECK(predict_run(&pcc, err) == -1 && contains(err, "would replace the input image"),
          "--out an image: '%s'", err);
    CHECK(unchanged(clist) && unchanged(cimage), "the list and the image are untouched");
    pcc.input = cdir;
    snprintf(out, sizeof out, "%s/p.csv", cdir);
    pcc.out = out;
    CHECK(predict_run(&pcc, err) == -1 && contains(err, "is, or is inside, the input folder"),
          "inside: '%s'", err);
    snprintf(out, sizeof out, "%s/p.csv", dir);
    pcc.overwrite = 0;
    CHECK(predict_run(&pcc, err) == 0, "%s", err);
    CHECK(predict_run(&pcc, err) == -1 && contains(err, "exists"), "a second time: '%s'", err);
    pcc.overwrite = 1;
    CHECK(predict_run(&pcc, err) == 0, "a second time, --overwrite: %s", err);
    snprintf(out, sizeof out, "%s/notes.csv", dir);  // a CSV of the user's
    write_file_bytes(out, "notes\n", 6);
    CHECK(predict_run(&pcc, err) == -1 && contains(err, "not an output of segnet predict"),
          "--overwrite notes.csv: '%s'", err);
    t = read_text(out);
    CHECK(t && !strcmp(t, "notes\n"), "notes.csv is untouched");
    free(t);
    net_free(&cnet); graph_free(&cg);
    net_free(&net); graph_free(&g);
    rm_rf(dir);
}

// Finding 12: a legal name whose outputs' names are legal too is predicted
// (its temporary files' names are cut to fit); one whose overlay's name would
// not fit is refused before anything is written.
TEST(predict_long_names) {
    PredictDirs d;
    Graph g; Net net; ModelCfg c;
    predict_fixture("predict_long", 1, &d, &g, &net, &c);
    char name[300], path[900], out[400], err[SN_ERR_MAX];
    Rng r; rng_seed(&r, 12);
    memset(name, 'n', 240);
    snprintf(name + 240, sizeof name - 240, ".png");  // 244 bytes: the overlay's name has 252
    snprintf(path, sizeof path, "%s/%s", d.in, name);
    write_png_red(path, 8, 8, NULL, &r);
    snprintf(out, sizeof out, "%s/out", d.dir);
    PredictCfg pc = {
            .model = c, .weights = d.wpath, .input = d.in, .out = out, .device = DEVICE_CPU};
    CHECK(predict_run(&pc, err) == 0, "a 244-byte name: %s", err);
    snprintf(path, sizeof path, "%s/%.240s_overlay.png", out, name);
    CHECK(file_exists(path), "its overlay was written");
    rm_rf(out);
    memset(name, 'n', 246);
    snprintf(name + 246, sizeof name - 246, ".png");  // 250 bytes: the overlay's would have 258
    snprintf(path, sizeof path, "%s/%s", d.in, name);
    write_png_red(path, 8, 8, NULL, &r);
    CHECK(predict_run(&pc, err) == -1 && contains(err, "the file name is 258 bytes"),
          "a 250-byte name: '%s'", err);
    CHECK(!file_exists(out), "nothing was written for the 250-byte name");
    net_free(&net); graph_free(&g);
    rm_rf(d.dir);
}

// Finding 10: a link planted at the temporary file's name is never followed
// (nor is any file there reused); a name that fills NAME_MAX gets a temporary
// name cut to fit, and nothing is left behind.
TEST(atomic_write_no_links) {
    char dir[300], path[600], victim[400], tmp[OUT_PATH_MAX], err[SN_ERR_MAX];
    ds_fixture(dir, sizeof dir, "atomic_links", NULL, 0);
    snprintf(victim, sizeof victim, "%s/victim.txt", dir);
    write_file_bytes(victim, "victim", 6);
    snprintf(path, sizeof path, "%s/out.txt", dir);
    atomic_tmp_name(path, tmp);
    CHECK(symlink(victim, tmp) == 0, "symlink: %s", strerror(errno));
    CHECK(write_text_atomic(path, "new", err) == -1 && contains(err, "temporary file") &&
                  contains(err, "already there"),
          "a link at the temporary name: '%s'", err);
    char *t = read_text(victim);
    CHECK(t && !strcmp(t, "victim"), "the link's target is untouched");
    free(t);
    struct stat sb;
    CHECK(lstat(path, &sb) != 0, "out.txt was created");
    unlink(tmp);
    char name[NAME_MAX + 1];
    memset(name, 'x', NAME_MAX);
    name[NAME_MAX] = 0;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    CHECK(write_text_atomic(path, "long", err) == 0, "a %d-byte name: %s", NAME_MAX, err);
    t = read_text(path);
    CHECK(t && !strcmp(t, "long"), "the %d-byte name holds its text", NAME_MAX);
    free(t);
    atomic_tmp_name(path, tmp);
    CHECK(strlen(path_base(tmp)) == NAME_MAX && contains(tmp, TMP_MARK),
          "temporary name '%s' (%zu bytes)", path_base(tmp), strlen(path_base(tmp)));
    snprintf(path, sizeof path, "%s/%sx", dir, name);
    CHECK(write_text_atomic(path, "longer", err) == -1 && contains(err, "more than the 255"),
          "a 256-byte name: '%s'", err);
    DIR *dd = opendir(dir);
    int files = 0;
    for (struct dirent *e; dd && (e = readdir(dd));) files += e->d_name[0] != '.';
    if (dd) closedir(dd);
    CHECK(files == 2, "the folder holds victim.txt and the long name, not %d files", files);
    ds_remove(dir);
}

// Finding 2: export never writes a run's own file (with --overwrite neither),
// writes a new file in the run folder, replaces an earlier export only with
// --overwrite and anything else never; it reads a run that no train holds.
TEST(export_outputs_protected) {
    const char *data = "/tmp/segnet_test_export_data", *run = "/tmp/segnet_test_export_run";
    rm_rf(data); rm_rf(run);
    write_seg_set(data, 4, 8, 8, 17);
    TrainCfg c = tiny_seg_cfg(data, NULL);
    c.epochs = 1;
    c.out = run;
    char err[SN_ERR_MAX], report[SN_ERR_MAX], path[400], out[400];
    CHECK(train_run(&c, NULL, err) == 0, "%s", err);
    const char *own[2] = {"last.safetensors", "best.safetensors"};
    for (int k = 0; k < 2; k++) {
        snprintf(path, sizeof path, "%s/%s", run, own[k]);
        keep_copy(path);
        for (int ow = 0; ow < 2; ow++)
            CHECK(export_run(&c.model, run, 0, EXPORT_TORCHVISION, path, ow, report, err) == -1 &&
                          contains(err, "a file of the run"),
                  "--out %s%s: '%s'", own[k], ow ? " --overwrite" : "", err);
        CHECK(unchanged(path), "%s changed", path);
    }
    snprintf(out, sizeof out, "%s/metrics.csv", run);  // any file a run writes, present or not
    CHECK(export_run(&c.model, run, 0, EXPORT_TORCHVISION, out, 1, report, err) == -1,
          "--out metrics.csv");
    snprintf(out, sizeof out, "%s/steps.csv", run);
    CHECK(export_run(&c.model, run, 0, EXPORT_TORCHVISION, out, 1, report, err) == -1,
          "--out steps.csv (absent)");
    snprintf(out, sizeof out, "%s/model.safetensors", run);  // a new file of its own
    CHECK(export_run(&c.model, run, 0, EXPORT_TORCHVISION, out, 0, report, err) == 0, "%s", err);
    CHECK(export_run(&c.model, run, 0, EXPORT_TORCHVISION, out, 0, report, err) == -1 &&
                  contains(err, "exists"),
          "again: '%s'", err);
    CHECK(export_run(&c.model, run, 1, EXPORT_TORCHVISION, out, 1, report, err) == 0,
          "again, --overwrite: %s", err);
    // a copy of a checkpoint: not an export
    snprintf(path, sizeof path, "%s/best.safetensors.orig", run);
    CHECK(export_run(&c.model, run, 0, EXPORT_TORCHVISION, path, 1, report, err) == -1 &&
          contains(err, "not an earlier export"), "--overwrite a checkpoint's copy: '%s'", err);
    const int held = run_lock(run, "segnet train", err);
    CHECK(held >= 0, "%s", err);
    CHECK(export_run(&c.model, run, 0, EXPORT_TORCHVISION, out, 1, report, err) == -1 &&
                  contains(err, "in use") && contains(err, "segnet train"),
          "while a train holds the run: '%s'", err);
    if (held >= 0) close(held);
    // the command line: refused, exit 1, and the run goes on from its checkpoint
    char args[1024], msg[4096];
    snprintf(args, sizeof args, "export --run %s --out %s/last.safetensors --overwrite", run, run);
    CHECK(run_segnet(args, msg, sizeof msg) == 1 && contains(msg, "a file of the run"),
          "segnet export: '%s'", msg);
    c.epochs = 2;
    CHECK(train_run(&c, run, err) == 0, "--resume after the refused exports: %s", err);
    rm_rf(data); rm_rf(run);
}

// ----------------------------------------------------------------------------
// the first hour: what a newcomer sees is true (issue 32, its small untruths)

// stdout is line-buffered: a log shows the `weights:` line while the run goes
// on (here: still there after kill -9 during the run); the lock file goes when
// a run or an export ends; config.txt records only the options the model uses;
// predict --run names where its padding came from.
TEST(first_hour_untruths) {
    const char *data = "/tmp/segnet_test_fh_data", *run = "/tmp/segnet_test_fh_run";
    char args[1400], msg[4096], path[400], out[400], err[SN_ERR_MAX];
    rm_rf(data); rm_rf(run);
    write_seg_set(data, 8, 8, 8, 53);
    snprintf(args, sizeof args,
             "train --model unet --depth 1 --width 2 --size 8x8 --batch 2 --classes 3 --epochs 1 "
             "--data %s "
             "--out %s --device cpu --threads 1",
             data, run);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "%s", msg);
    snprintf(path, sizeof path, "%s/" RUN_LOCK_FILE, run);
    CHECK(!file_exists(path), "the lock file stays after the run");
    snprintf(path, sizeof path, "%s/best.safetensors", run);
    snprintf(out, sizeof out, "%s_w.safetensors", run);
    snprintf(args, sizeof args,
             "train --model unet --depth 1 --width 2 --size 8x8 --batch 2 --classes 3 --epochs 200 "
             "--data %s "
             "--weights %s --out %s_k --device cpu --threads 1",
             data, path, run);
    char cmd[2000], log[300];
    snprintf(log, sizeof log, "%s_stdout.txt", run);
    snprintf(cmd, sizeof cmd, "exec ./segnet %s >%s 2>/dev/null", args, log);
    pid_t pid = fork();
    if (pid == 0) { execl("/bin/sh", "sh", "-c", cmd, (char *)NULL); _exit(127); }
    char metrics[400];
    snprintf(metrics, sizeof metrics, "%s_k/metrics.csv", run);
    for (int waited = 0; waited < 2000 && !file_exists(metrics); waited++) usleep(5000);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    char *said = read_text(log);
    CHECK(said && contains(said, "weights: ") && contains(said, "loaded from"),
          "stdout after kill -9: '%s'", said ? said : "");
    free(said);
    unlink(log);
    snprintf(path, sizeof path, "%s_k", run);
    rm_rf(path);
    // export: its lock file goes too
    TrainCfg c = tiny_seg_cfg(data, NULL);
    c.model.width_base = 2;
    char report[SN_ERR_MAX];
    CHECK(export_run(&c.model, run, 0, EXPORT_TORCHVISION, out, 0, report, err) == 0, "%s", err);
    snprintf(path, sizeof path, "%s/" RUN_LOCK_FILE, run);
    CHECK(!file_exists(path), "the lock file stays after an export");
    unlink(out);
    // config.txt: the plain unet's levels and channels, no classifier head; a unet-effv2's neither
    snprintf(path, sizeof path, "%s/config.txt", run);
    char *config = read_text(path);
    CHECK(config && contains(config, "depth = 1\n") && contains(config, "width = 2\n") &&
                  !contains(config, "head-hidden"),
          "unet config.txt: %s", config ? config : "");
    free(config);
    TrainCfg u = c;
    u.model = model_cfg_default();
    SfBuf b = {0};
    u.model.model = "unet-effv2-t"; u.model.classes = 3;
    config_text(&u, &b);
    sb_put(&b, "", 1);
    CHECK(!contains(b.p, "depth =") && !contains(b.p, "width =") && !contains(b.p, "head-hidden ="),
          "unet-effv2-t config: %s", b.p);
    free(b.p);
    // predict --run of a classifier says its padding came from the run, not from --padding
    char csv[400], crun[400];
    snprintf(csv, sizeof csv, "%s/list.csv", data);
    write_file_bytes(csv, "images/i00.png,0\nimages/i01.png,1\nimages/i02.png,2\n", 51);
    snprintf(crun, sizeof crun, "%s_cls", run);
    rm_rf(crun);
    snprintf(args, sizeof args,
             "train --model effv2-t --size 32x32 --batch 2 --classes 3 --epochs 1 --data %s --out "
             "%s "
             "--device cpu --threads 1",
             csv, crun);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "%s", msg);
    snprintf(args, sizeof args,
             "predict --run %s --input %s/images --out %s_p.csv --device cpu --threads 1", crun,
             data, run);
    CHECK(run_segnet(args, msg, sizeof msg) == 0 && contains(msg, "(the run's config.txt)") &&
                  !contains(msg, "(--padding)"),
          "predict --run: '%s'", msg);
    snprintf(path, sizeof path, "%s_p.csv", run);
    unlink(path);
    // exporting a 'same'-padded run in torchvision's names says that torchvision pads otherwise
    for (int timm = 0; timm < 2; timm++) {
        snprintf(args, sizeof args, "export --run %s --out %s_x.safetensors%s", crun, run,
                 timm ? " --names timm --overwrite" : "");
        CHECK(run_segnet(args, msg, sizeof msg) == 0 &&
                      count_substr(msg, "torchvision's EfficientNetV2 (and UNetEff) "
                                        "symmetrically") == !timm,
              "%s: '%s'", args, msg);
    }
    snprintf(path, sizeof path, "%s_x.safetensors", run);
    unlink(path);
    rm_rf(crun); rm_rf(data); rm_rf(run);
}

// ----------------------------------------------------------------------------
// safetensors: round trip, a hand-built file, exact writer bytes, malformed
// files (each refused with a message naming the file, problem and tensor),
// atomic replacement

static void sf_test_path(char *out, size_t cap, const char *tag) {
    snprintf(out, cap, "/tmp/segnet_test_%ld_%s.safetensors", (long)getpid(), tag);
}

// 8-byte little-endian header_len, the header text, data_len bytes of data
static int write_st_raw(const char *path, uint64_t header_len, const char *header, const void *data,
                        size_t data_len) {
    size_t h = strlen(header), n = 8 + h + data_len;
    uint8_t *p = calloc(n, 1);
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(header_len >> (8 * i));
    memcpy(p + 8, header, h);
    if (data) memcpy(p + 8 + h, data, data_len);
    int rc = write_file_bytes(path, p, n);
    free(p);
    return rc;
}

static void put_u16le(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static void put_f32le(uint8_t *p, float v) {
    uint32_t u = f32_bits(v);
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(u >> (8 * i));
}
static float get_f32le(const void *q) {
    const uint8_t *p = q;
    return bits_f32((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                    (uint32_t)p[3] << 24);
}
static uint16_t get_u16le(const void *q) {
    const uint8_t *p = q;
    return (uint16_t)(p[0] | p[1] << 8);
}

TEST(safetensors_round_trip) {
    char path[256], err[SN_ERR_MAX] = "";
    sf_test_path(path, sizeof path, "round_trip");
    Rng r; rng_seed(&r, 11);
    float scalar = 3.25f, w[3 * 2 * 2 * 4];
    uint16_t h[5], b[2 * 3];
    const int64_t tracked = -((int64_t)1 << 40) - 3;
    for (int i = 0; i < 48; i++) w[i] = rng_normal(&r);
    for (int i = 0; i < 5; i++) h[i] = f32_to_f16(rng_normal(&r));
    for (int i = 0; i < 6; i++) b[i] = f32_to_bf16(rng_normal(&r));
    const int64_t dw[] = {3, 2, 2, 4}, dh[] = {5}, db[] = {2, 3}, de[] = {0, 7};
    SafetensorsTensor ts[] = {
        sf_tensor("scalar", DT_F32, 0, NULL, &scalar),
        sf_tensor("enc1.conv.weight", DT_F32, 4, dw, w),
        sf_tensor("half", DT_F16, 1, dh, h),
        sf_tensor("brain \"quoted\" \\ \xc3\xa9", DT_BF16, 2, db, b),
        sf_tensor("empty", DT_F32, 2, de, NULL),
        sf_tensor("bn.num_batches_tracked", DT_I64, 0, NULL, &tracked),  // PyTorch's BN counter
    };
    const int n = (int)(sizeof ts / sizeof ts[0]);
    // metadata of any length: third-party files carry keys over 95 bytes and values over 255
    static char long_key[300], long_value[100001];
    memset(long_key, 'k', sizeof long_key - 1);
    for (size_t i = 0; i + 1 < sizeof long_value; i++) long_value[i] = (char)('a' + i % 26);
    const char *mk[] = {"format", "note\ttab", long_key},
               *mv[] = {"pt", "line\nbreak, \"quote\", back\\slash, caf\xc3\xa9", long_value};
    const int n_mk = (int)(sizeof mk / sizeof mk[0]);
    CHECK(safetensors_write(path, ts, n, mk, mv, n_mk, err) == 0, "safetensors_write: %s", err);
    SafetensorsFile f;
    if (safetensors_read(path, &f, err)) {
        CHECK(0, "safetensors_read: %s", err);
        unlink(path);
        return;
    }
    CHECK(f.n_tensors == n, "%d tensors read back, wrote %d", f.n_tensors, n);
    for (int i = 0; i < n && i < f.n_tensors; i++) {
        const SafetensorsTensor *a = &ts[i], *g = &f.tensors[i];
        int same_dims = g->ndim == a->ndim;
        for (int d = 0; same_dims && d < a->ndim; d++) same_dims = g->dims[d] == a->dims[d];
        size_t bytes = a->numel * dtype_size(a->dtype);
        CHECK(!strcmp(g->name, a->name), "tensor %d: name '%s', wrote '%s'", i, g->name, a->name);
        CHECK(g->dtype == a->dtype && same_dims && g->numel == a->numel,
              "tensor '%s': dtype/shape/numel differ", a->name);
        CHECK(g->numel == a->numel && (!bytes || !memcmp(g->data, a->data, bytes)),
              "tensor '%s': bytes differ", a->name);
        CHECK(safetensors_find(&f, a->name) == g, "safetensors_find('%s')", a->name);
    }
    CHECK(safetensors_find(&f, "absent") == NULL, "safetensors_find of an absent name is NULL");
    CHECK(f.n_meta == n_mk, "%d metadata entries", f.n_meta);
    for (int i = 0; i < n_mk && i < f.n_meta; i++)
        CHECK(!strcmp(f.meta_keys[i], mk[i]) && !strcmp(f.meta_values[i], mv[i]),
              "metadata %d: '%.40s' = '%.40s' (%zu, %zu bytes)", i, f.meta_keys[i],
              f.meta_values[i], strlen(f.meta_keys[i]), strlen(f.meta_values[i]));
    // layout: header padded so the data starts 8-aligned, "__metadata__" first,
    // tensors contiguous in the order given
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | f.bytes[i];
    CHECK((8 + hlen) % 8 == 0, "8 + header length %llu is a multiple of 8",
          (unsigned long long)hlen);
    CHECK(!memcmp(f.bytes + 8, "{\"__metadata__\":", 16), "\"__metadata__\" comes first");
    size_t off = 8 + hlen;
    for (int i = 0; i < f.n_tensors; i++) {
        CHECK((const uint8_t *)f.tensors[i].data == f.bytes + off, "tensor %d starts at byte %zu",
              i, off);
        off += f.tensors[i].numel * dtype_size(f.tensors[i].dtype);
    }
    CHECK(off == f.n_bytes, "no bytes after the last tensor (%zu of %zu)", off, f.n_bytes);
    safetensors_free(&f);
    CHECK(f.tensors == NULL && f.bytes == NULL && f.n_tensors == 0,
          "safetensors_free empties the SafetensorsFile");
    // no tensors, no metadata
    CHECK(safetensors_write(path, NULL, 0, NULL, NULL, 0, err) == 0, "empty file: %s", err);
    CHECK(safetensors_read(path, &f, err) == 0 && f.n_tensors == 0 && f.n_meta == 0 &&
                  f.n_bytes == 16,
          "empty file reads back: %s", err);
    safetensors_free(&f);
    unlink(path);
}

// A file built by hand as another implementation would write it (Python's
// json.dumps spacing, fields in another order, \u escapes, a 0-d tensor,
// a hole between tensors and unused bytes at the end).
TEST(safetensors_hand_built) {
    char path[256], err[SN_ERR_MAX] = "";
    sf_test_path(path, sizeof path, "hand_built");
    const char *header =
            "{\"__metadata__\": {\"format\": \"pt\", \"note\": \"caf\\u00e9 \\ud83d\\ude00 "
            "\\\"q\\\" \\\\ \\/ \\n\"}, "
            "\"x.weight\": {\"dtype\": \"F16\", \"shape\": [2, 1], \"data_offsets\": [0, 4]},\n"
            "\t\"y\": {\"data_offsets\": [8, 16], \"shape\": [2], \"dtype\": \"F32\"},\r\n"
            "\"\\u0073\": {\"dtype\":\"BF16\",\"shape\":[],\"data_offsets\":[16,18]}}    ";
    uint8_t data[20] = {0};
    put_u16le(data + 0, 0x3C00);   // F16 1.0
    put_u16le(data + 2, 0xC000);   // F16 -2.0
    memset(data + 4, 0xEE, 4);     // a hole
    put_f32le(data + 8, 0.5f);
    put_f32le(data + 12, 3.0f);
    put_u16le(data + 16, 0xBFC0);  // BF16 -1.5
    CHECK(write_st_raw(path, strlen(header), header, data, sizeof data) == 0, "writing %s", path);
    SafetensorsFile f;
    CHECK(safetensors_read(path, &f, err) == 0, "safetensors_read: %s", err);
    CHECK(f.n_tensors == 3 && f.n_meta == 2, "%d tensors, %d metadata entries", f.n_tensors,
          f.n_meta);
    const SafetensorsTensor *x = safetensors_find(&f, "x.weight"), *y = safetensors_find(&f, "y"),
                            *s = safetensors_find(&f, "s");
    CHECK(x && x->dtype == DT_F16 && x->ndim == 2 && x->dims[0] == 2 && x->dims[1] == 1 &&
                  x->numel == 2,
          "x.weight header");
    CHECK(x && f16_to_f32(get_u16le(x->data)) == 1.0f &&
                  f16_to_f32(get_u16le((const uint8_t *)x->data + 2)) == -2.0f,
          "x.weight values");
    CHECK(y && y->dtype == DT_F32 && y->ndim == 1 && y->dims[0] == 2 && y->numel == 2, "y header");
    CHECK(y && get_f32le(y->data) == 0.5f && get_f32le((const uint8_t *)y->data + 4) == 3.0f,
          "y values");
    CHECK(s && s->dtype == DT_BF16 && s->ndim == 0 && s->numel == 1,
          "s: a 0-d BF16 scalar named by a \\u escape");
    CHECK(s && bf16_to_f32(get_u16le(s->data)) == -1.5f, "s value");
    CHECK(f.n_meta == 2 && !strcmp(f.meta_keys[0], "format") && !strcmp(f.meta_values[0], "pt"),
          "metadata format");
    CHECK(f.n_meta == 2 && !strcmp(f.meta_values[1], "caf\xc3\xa9 \xf0\x9f\x98\x80 \"q\" \\ / \n"),
          "escapes decoded to UTF-8: '%s'", f.n_meta == 2 ? f.meta_values[1] : "");
    safetensors_free(&f);
    unlink(path);
}

// The writer's bytes for a small file, spelled out: the compact header the
// reference implementation writes, space-padded to 8 + N ≡ 0 (mod 8).
TEST(safetensors_writer_bytes) {
    char path[256], err[SN_ERR_MAX] = "";
    sf_test_path(path, sizeof path, "writer_bytes");
    float a[2] = {1.0f, -2.0f};
    uint16_t b[2] = {f32_to_bf16(0.5f), f32_to_bf16(-1.5f)};
    const int64_t da[] = {2}, db[] = {1, 2};
    SafetensorsTensor ts[] = {sf_tensor("a", DT_F32, 1, da, a), sf_tensor("b", DT_BF16, 2, db, b)};
    const char *mk[] = {"format"}, *mv[] = {"pt"};
    CHECK(safetensors_write(path, ts, 2, mk, mv, 1, err) == 0, "safetensors_write: %s", err);
    const char *hdr = "{\"__metadata__\":{\"format\":\"pt\"},"
                      "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                      "\"b\":{\"dtype\":\"BF16\",\"shape\":[1,2],\"data_offsets\":[8,12]}}";
    size_t hl = strlen(hdr), pad = (8 - (8 + hl) % 8) % 8, n = 8 + hl + pad + 12, got_n = 0;
    uint8_t *want = calloc(n, 1);
    for (int i = 0; i < 8; i++) want[i] = (uint8_t)((hl + pad) >> (8 * i));
    memcpy(want + 8, hdr, hl);
    memset(want + 8 + hl, ' ', pad);
    uint8_t *d = want + 8 + hl + pad;
    put_f32le(d, 1.0f);
    put_f32le(d + 4, -2.0f);
    put_u16le(d + 8, 0x3F00);
    put_u16le(d + 10, 0xBFC0);
    uint8_t *got = read_file_bytes(path, &got_n);
    CHECK(got && got_n == n && !memcmp(got, want, n),
          "file bytes differ from the spelled-out file (%zu vs %zu bytes)%s%.*s", got_n, n,
          got ? ": header " : "", got && got_n > 8 ? (int)(got_n - 8) : 0,
          got ? (const char *)got + 8 : "");
    free(got);
    free(want);
    unlink(path);
}

TEST(safetensors_malformed) {
    char path[256], err[SN_ERR_MAX];
    sf_test_path(path, sizeof path, "malformed");
    static char long_name[256], deep[20100], deep_top[10100];
    snprintf(long_name, sizeof long_name,
             "{\"%0120d\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 0);
    int k = snprintf(deep, sizeof deep, "{\"w\":{\"dtype\":");
    for (int i = 0; i < 10000; i++) deep[k++] = '[';
    deep[k] = 0;
    k = snprintf(deep_top, sizeof deep_top, "{\"w\":");
    for (int i = 0; i < 10000; i++) deep_top[k++] = '{';
    deep_top[k] = 0;
#define TW(fields) "{\"w\":{" fields "}}"
    struct { const char *header; size_t data_len; const char *want1, *want2;
    } cases[] = {
            {"not json at all", 0, "not a JSON object", "byte 0"},
            {"[1, 2]", 0, "not a JSON object", "byte 0"},
            {"", 0, "not a JSON object", "byte 0"},
            {"{} {}", 0, "not valid JSON", "after the header"},
            {"{\"w\": {\"dtype\": \"F3", 0, "not valid JSON", "unterminated"},
            {"{\"w\": {\"dtype\" \"F32\"}}", 0, "not valid JSON", "expected ':'"},
            {"{\"w\\q\": {}}", 0, "not valid JSON", "escape"},
            {"{\"w\\ud800\": {}}", 0, "not valid JSON", "surrogate"},
            {"{\"w\\u0000\": {}}", 0, "not valid JSON", "\\u0000"},
            {"{\"w\xff\": {}}", 0, "not valid UTF-8", "byte 3"},
            {"{\"w\": 5}", 0, "'w'", "must be an object"},
            {TW("\"dtype\":\"F32\",\"shape\":[1]"), 4, "'w'", "missing \"data_offsets\""},
            {TW("\"shape\":[1],\"data_offsets\":[0,4]"), 4, "'w'", "missing \"dtype\""},
            {TW("\"dtype\":\"F32\",\"shape\":\"1\",\"data_offsets\":[0,4]"), 4, "'w'",
             "\"shape\" must be an array"},
            {TW("\"dtype\":32,\"shape\":[1],\"data_offsets\":[0,4]"), 4, "'w'",
             "\"dtype\" must be a string"},
            {TW("\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]"), 4,
             "'w'", "\"dtype\" appears twice"},
            {TW("\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"foo\":1"), 4, "'w'",
             "unknown field \"foo\""},
            {TW("\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]"), 8, "'w'",
             "dtype \"F64\" is not supported"},
            {TW("\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[0,8]"), 8, "'w'",
             "dtype \"I32\" is not supported"},
            {TW("\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]"), 8, "'w'",
             "shape entry -2 is negative"},
            {TW("\"dtype\":\"F32\",\"shape\":[2.5],\"data_offsets\":[0,8]"), 8, "'w'",
             "shape entry 2.5 is not an integer"},
            {TW("\"dtype\":\"F32\",\"shape\":[1e3],\"data_offsets\":[0,8]"), 8, "'w'",
             "1e3 is not an integer"},
            {TW("\"dtype\":\"F32\",\"shape\":[01],\"data_offsets\":[0,4]"), 4, "not valid JSON",
             "leading zero"},
            {TW("\"dtype\":\"F32\",\"shape\":[99999999999999999999],\"data_offsets\":[0,4]"), 4,
             "'w'", "too large"},
            {TW("\"dtype\":\"F32\",\"shape\":[[1]],\"data_offsets\":[0,4]"), 4, "'w'",
             "shape entry must be an integer"},
            {TW("\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]"), 4, "'w'",
             "more than 8 dimensions"},
            {TW("\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,16],\"data_offsets\":[0,4]"), 4,
             "'w'", "overflows"},
            {TW("\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]"), 4, "'w'",
             "data_offsets entry -4 is negative"},
            {TW("\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]"), 8, "'w'",
             "more than 2 entries"},
            {TW("\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,4]"), 8, "'w'", "begin > end"},
            {TW("\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]"), 8, "'w'",
             "past the end of the data section (8 bytes)"},
            {TW("\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]"), 8, "'w'",
             "hold 8 bytes, but shape [3] of F32 needs 12"},
            {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
             "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
             12, "tensors 'a' and 'b' overlap", "[0, 8) and [4, 12)"},
            {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]},"
             "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
             12, "tensors 'a' and 'b' overlap", "[0, 12) and [4, 8)"},
            {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
             "\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
             8, "tensor 'w' appears twice", "duplicate"},
            {long_name, 4, "tensor name '00000000", "longer than the 95 allowed"},
            {"{\"__metadata__\":{\"k\":1}}", 0, "\"__metadata__\" 'k'", "must be a string"},
            {"{\"__metadata__\":[]}", 0, "\"__metadata__\"", "must be an object"},
            {"{\"__metadata__\":{},\"__metadata__\":{}}", 0, "\"__metadata__\"", "appears twice"},
            {deep, 0, "'w'", "\"dtype\" must be a string"},
            {deep_top, 0, "'w'", "not valid JSON"},
    };
#undef TW
    uint8_t zeros[64] = {0};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        SafetensorsFile f;
        write_st_raw(path, strlen(cases[c].header), cases[c].header, zeros, cases[c].data_len);
        int rc = safetensors_read(path, &f, err);
        if (g_verbose) printf("      %s\n", err);
        CHECK(rc == -1 && contains(err, path) && contains(err, cases[c].want1) &&
                      contains(err, cases[c].want2) && !strchr(err, '\n') && f.bytes == NULL &&
                      f.tensors == NULL,
              "case %zu (%.40s): rc %d, message '%s' should name the file, '%s' and '%s'", c,
              cases[c].header, rc, rc ? err : "", cases[c].want1, cases[c].want2);
        if (rc == 0) safetensors_free(&f);
    }
    // file-level damage: too short, header length past the end, data cut short
    struct { const char *what; const char *want1, *want2; } files[] = {
        {"short", "3 bytes", "too short"},
        {"length", "header length 1000", "past the end of the file"},
        {"huge_length", "header length 18446744073709551615", "past the end of the file"},
        {"cut_data", "tensor 't'", "past the end of the data section"},
        {"missing", "cannot open", "No such file"},
    };
    for (size_t c = 0; c < sizeof files / sizeof files[0]; c++) {
        const char *w = files[c].what;
        char err2[SN_ERR_MAX] = "";
        if (!strcmp(w, "short")) write_file_bytes(path, "abc", 3);
        if (!strcmp(w, "length")) write_st_raw(path, 1000, "{}", NULL, 0);
        if (!strcmp(w, "huge_length")) write_st_raw(path, UINT64_MAX, "{}", NULL, 0);
        if (!strcmp(w, "cut_data")) {
            float v[64] = {0};
            const int64_t d[] = {64};
            SafetensorsTensor t = sf_tensor("t", DT_F32, 1, d, v);
            size_t n = 0;
            CHECK(safetensors_write(path, &t, 1, NULL, NULL, 0, err2) == 0, "safetensors_write: %s",
                  err2);
            uint8_t *all = read_file_bytes(path, &n);
            CHECK(all && n > 128, "read back %zu bytes", n);
            if (all) write_file_bytes(path, all, n - 128);  // half the data section is gone
            free(all);
        }
        if (!strcmp(w, "missing")) unlink(path);
        SafetensorsFile f;
        int rc = safetensors_read(path, &f, err);
        if (g_verbose) printf("      %s\n", err);
        CHECK(rc == -1 && contains(err, path) && contains(err, files[c].want1) &&
                      contains(err, files[c].want2) && f.bytes == NULL,
              "%s: rc %d, message '%s' should name the file, '%s' and '%s'", w, rc, rc ? err : "",
              files[c].want1, files[c].want2);
        if (rc == 0) safetensors_free(&f);
    }
    unlink(path);
}

TEST(safetensors_write_atomic) {
    char path[256], tmp[300], err[SN_ERR_MAX] = "";
    sf_test_path(path, sizeof path, "atomic");
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    float big[100], small = 7.0f;
    for (int i = 0; i < 100; i++) big[i] = (float)i;
    const int64_t d100[] = {10, 10};
    SafetensorsTensor tb[] = {sf_tensor("big", DT_F32, 2, d100, big),
                              sf_tensor("big2", DT_F32, 2, d100, big)};
    SafetensorsTensor ts = sf_tensor("small", DT_F32, 0, NULL, &small);

    // a directory that does not exist: refused, nothing created
    char nodir[256], nofile[300];
    snprintf(nodir, sizeof nodir, "/tmp/segnet_test_%ld_nodir", (long)getpid());
    snprintf(nofile, sizeof nofile, "%s/x.safetensors", nodir);
    CHECK(safetensors_write(nofile, &ts, 1, NULL, NULL, 0, err) == -1 && contains(err, nofile) &&
                  contains(err, "No such file"),
          "writing into a missing directory: '%s'", err);
    CHECK(!file_exists(nodir), "nothing created");

    // a larger file replaced whole by a smaller one, no temporary left behind
    CHECK(safetensors_write(path, tb, 2, NULL, NULL, 0, err) == 0, "first write: %s", err);
    CHECK(safetensors_write(path, &ts, 1, NULL, NULL, 0, err) == 0, "overwrite: %s", err);
    SafetensorsFile f;
    CHECK(safetensors_read(path, &f, err) == 0, "read after overwrite: %s", err);
    size_t hl = strlen("{\"small\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]}}");
    size_t want_n = 8 + hl + (8 - (8 + hl) % 8) % 8 + 4;
    CHECK(f.n_tensors == 1 && !strcmp(f.tensors[0].name, "small") &&
                  get_f32le(f.tensors[0].data) == 7.0f && f.n_bytes == want_n,
          "the new file alone (%d tensors, %zu bytes, want %zu)", f.n_tensors, f.n_bytes, want_n);
    safetensors_free(&f);
    CHECK(!file_exists(tmp), "no temporary left after success");
    size_t n0 = 0, n1 = 0;
    uint8_t *before = read_file_bytes(path, &n0);

    // refused arguments leave the existing file alone
    SafetensorsTensor bad[2] = {ts, ts};
    CHECK(safetensors_write(path, bad, 2, NULL, NULL, 0, err) == -1 && contains(err, "'small'") &&
                  contains(err, "twice"),
          "duplicate names refused: '%s'", err);
    SafetensorsTensor wrong = ts;
    wrong.numel = 3;
    CHECK(safetensors_write(path, &wrong, 1, NULL, NULL, 0, err) == -1 && contains(err, "numel 3"),
          "numel mismatch: '%s'", err);
    wrong = ts;
    wrong.dtype = (DType)7;
    CHECK(safetensors_write(path, &wrong, 1, NULL, NULL, 0, err) == -1 && contains(err, "dtype 7"),
          "bad dtype: '%s'", err);
    const char *mk[] = {"k", "k"}, *mv[] = {"1", "2"};
    CHECK(safetensors_write(path, &ts, 1, mk, mv, 2, err) == -1 &&
                  contains(err, "'k' appears twice"),
          "duplicate key: '%s'", err);
    uint8_t *after = read_file_bytes(path, &n1);
    CHECK(before && after && n0 == n1 && !memcmp(before, after, n0),
          "the existing file is untouched");
    free(before);
    free(after);

    // a failure after the temporary exists (renaming a file over a directory):
    // the temporary is removed and the directory untouched
    char dir[256], dtmp[300];
    snprintf(dir, sizeof dir, "/tmp/segnet_test_%ld_isdir", (long)getpid());
    snprintf(dtmp, sizeof dtmp, "%s.tmp.%ld", dir, (long)getpid());
    mkdir(dir, 0755);
    struct stat sb;
    CHECK(safetensors_write(dir, &ts, 1, NULL, NULL, 0, err) == -1 && contains(err, "renaming"),
          "rename over a directory: '%s'", err);
    CHECK(!file_exists(dtmp), "temporary removed after a failed rename");
    CHECK(stat(dir, &sb) == 0 && S_ISDIR(sb.st_mode), "the directory is still there");
    rmdir(dir);
    unlink(path);
}

// ---- robustness (3), part B (issue 49, items 1, 2, 4, 5, 6, 7, 9, 13 and 14's manifest)

// Item 1: segnet augment --out inside the data set (however spelled) is refused, nothing written.
TEST(augment_out_inside_data) {
    const char *data = "/tmp/segnet_test_augin_data";
    rm_rf(data);
    write_seg_set(data, 2, 8, 8, 5);
    char args[1200], msg[4096];
    const char *outs[] = {"images", "masks/new", "../segnet_test_augin_data/images/x"};
    for (int k = 0; k < 3; k++) {
        snprintf(args, sizeof args,
                 "augment --data %s --model unet --depth 1 --width 4 --size 8x8 --classes 3 "
                 "--augment flip -n 2 --out %s/%s",
                 data, data, outs[k]);
        CHECK(run_segnet(args, msg, sizeof msg) == 1 &&
                      contains(msg, "is, or is inside, the data set") &&
                      contains(msg, "segnet augment never writes among the samples it reads"),
              "--out DATA/%s: '%s'", outs[k], msg);
    }
    char cmd[600];
    snprintf(cmd, sizeof cmd, "test -z \"$(find %s -name 'aug*')\" && test ! -e %s/masks/new",
             data, data);
    CHECK(system(cmd) == 0, "nothing written into %s", data);
    rm_rf(data);
}

// Item 2: --iou-per-image stays for the run: switched off or on by --resume, refused naming it.
TEST(resume_iou_per_image_kept) {
    const char *data = "/tmp/segnet_test_ioukeep_data", *run = "/tmp/segnet_test_ioukeep_run";
    rm_rf(data); rm_rf(run);
    write_seg_set(data, 4, 8, 8, 7);
    char err[SN_ERR_MAX];
    for (int on = 0; on < 2; on++) {
        TrainCfg c = tiny_seg_cfg(data, NULL);
        c.out = run;
        c.overwrite = 1;
        c.iou_per_image = on;
        CHECK(train_run(&c, NULL, err) == 0, "%s", err);
        c.overwrite = 0;
        c.epochs = 2;
        c.iou_per_image = !on;
        CHECK(train_run(&c, run, err) == -1 &&
                      contains(err, on ? "--iou-per-image off, but the run was trained with on"
                                       : "--iou-per-image on, but the run was trained with off"),
              "trained %s, resumed %s: '%s'", on ? "on" : "off", on ? "off" : "on", err);
    }
    rm_rf(data); rm_rf(run);
}

// Item 4: --class-weights auto where every pixel is ignored: a message, not a read of
// sorted[-1] (that read is seen by ASan/UBSan, as make fuzz builds; here the message).
TEST(class_weights_auto_all_ignored) {
    const char *data = "/tmp/segnet_test_cwauto_data";
    rm_rf(data);
    write_seg_set(data, 2, 8, 8, 9);
    MaskRules rules = {.n_ignore = 3, .ignore = {0, 1, 2}};
    float w[3];
    char err[SN_ERR_MAX];
    CHECK(class_weights_median_frequency(data, 1, 3, 8, 8, &rules, w, err) == -1 &&
                  contains(err, "every pixel of its masks is ignored") &&
                  contains(err, "--class-weights auto"),
          "'%s'", err);
    rm_rf(data);
}

// the process id of a child that has exited: no process has it (until one is given it again)
static long dead_pid(void) {
    pid_t p = fork();
    if (p == 0) _exit(0);
    waitpid(p, NULL, 0);
    return (long)p;
}

// ./segnet args stopped (SIGSTOP, SEGNET_TEST_STOP_AT_WRITE) once its nth temporary file
// exists, then sent sig: its exit status (-1: it was killed by a signal, or never stopped);
// *tmp_seen: whether the temporary file `name`.tmp.<pid> in dir existed at the stop
static int signal_in_write(const char *args, int n, int sig, const char *dir, const char *name,
                           int *tmp_seen) {
    char stop[16], path[600];
    snprintf(stop, sizeof stop, "%d", n);
    setenv("SEGNET_TEST_STOP_AT_WRITE", stop, 1);
    const pid_t pid = spawn_segnet(args, "/tmp/segnet_test_sigw_err.txt");
    unsetenv("SEGNET_TEST_STOP_AT_WRITE");
    int status = 0;
    waitpid(pid, &status, WUNTRACED);
    snprintf(path, sizeof path, "%s/%s.tmp.%ld", dir, name, (long)pid);
    *tmp_seen = WIFSTOPPED(status) && file_exists(path);
    if (WIFSTOPPED(status)) {
        kill(pid, sig);
        kill(pid, SIGCONT);
        waitpid(pid, &status, 0);
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// the names a predict manifest lists, one line each ('\n' for its NULs)
static char *manifest_names(const char *out) {
    char path[400];
    snprintf(path, sizeof path, "%s/.segnet-predict", out);
    size_t n = 0;
    char *b = read_file(path, &n);
    for (size_t i = 0; b && i < n; i++) if (!b[i]) b[i] = '\n';
    return b;
}

// Items 5 and 14: SIGTERM, SIGINT or SIGHUP while export or a tiled predict has a temporary
// file: the file is removed and the exit is 128 + the signal; the manifest lists only what
// was written. A killed writer's temporary file of an output (its pid gone) is removed at
// the next write of that output; a live process's, and a name that is not an output's, stay.
TEST(signal_removes_temporary_files) {
    const char *data = "/tmp/segnet_test_sigw_data", *run = "/tmp/segnet_test_sigw_run",
               *out = "/tmp/segnet_test_sigw_out", *exp = "/tmp/segnet_test_sigw_export";
    rm_rf(data); rm_rf(run); rm_rf(out); rm_rf(exp);
    write_seg_set(data, 2, 8, 8, 11);
    char args[1200], msg[4096], path[600];
    snprintf(args, sizeof args,
             "train --model unet --depth 1 --width 4 --size 8x8 --batch 2 --epochs 1 --classes 3 "
             "--data %s --out %s --device cpu --threads 1",
             data, run);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "train: %s", msg);
    CHECK(mkdir(exp, 0755) == 0, "mkdir %s", exp);
    int seen;
    snprintf(args, sizeof args, "export --run %s --out %s/w.safetensors", run, exp);
    int rc = signal_in_write(args, 1, SIGTERM, exp, "w.safetensors", &seen);
    snprintf(path, sizeof path, "test -z \"$(ls -A %s)\"", exp);
    CHECK(seen && rc == 128 + SIGTERM && system(path) == 0,
          "export, SIGTERM in its write: temporary file seen %d, exit %d, %s left empty", seen, rc,
          exp);
    // predict's writes: the manifest (1), legend.png (2), then i00.png (3)
    snprintf(args, sizeof args,
             "predict --run %s --input %s/images --out %s --tile 8x8 --device cpu --threads 1", run,
             data, out);
    for (int k = 0; k < 2; k++) {
        const int sig = k ? SIGHUP : SIGINT;
        rc = signal_in_write(args, 3, sig, out, "i00.png", &seen);
        char *listed = manifest_names(out);
        snprintf(path, sizeof path, "test -z \"$(ls %s | grep tmp)\" && test ! -e %s/i00.png", out,
                 out);
        CHECK(seen && rc == 128 + sig && system(path) == 0, "predict, signal %d: seen %d, exit %d",
              sig, seen, rc);
        CHECK(listed && contains(listed, "\nlegend.png\n") && !contains(listed, "i00"),
              "signal %d: the manifest lists what was written, no more: '%s'", sig,
              listed ? listed : "(none)");
        free(listed);
        snprintf(args + strlen(args), sizeof args - strlen(args), " --overwrite");
    }
    // stale temporary files: the dead writer's of outputs go, the others stay
    const long dead = dead_pid();
    const char *stale[] = {"i00.png", "i01_overlay.png", "notes.txt"};
    for (int k = 0; k < 3; k++) {
        snprintf(path, sizeof path, "%s/%s.tmp.%ld", out, stale[k], dead);
        write_file_bytes(path, "x", 1);
    }
    snprintf(path, sizeof path, "%s/i01.png.tmp.%ld", out, (long)getpid());
    write_file_bytes(path, "x", 1);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "predict again: %s", msg);
    for (int k = 0; k < 4; k++) {
        if (k < 3) snprintf(path, sizeof path, "%s/%s.tmp.%ld", out, stale[k], dead);
        else snprintf(path, sizeof path, "%s/i01.png.tmp.%ld", out, (long)getpid());
        CHECK(file_exists(path) == (k >= 2), "%s: %s", path,
              k >= 2 ? "not an output's, or its writer lives: kept" : "stale: removed");
    }
    char *listed = manifest_names(out);
    CHECK(listed && contains(listed, "\ni00.png\n") && contains(listed, "\ni01_overlay.png\n"),
          "finished: all listed: '%s'", listed ? listed : "");
    free(listed);
    unlink("/tmp/segnet_test_sigw_err.txt");
    rm_rf(data); rm_rf(run); rm_rf(out); rm_rf(exp);
}

// Item 6: --overlap near 1 refused with its cost; a tile larger than every image shrinks to the
// largest image (rounded up to the model's multiple) and a pass to the tiles an image has.
TEST(predict_tile_fits_images) {
    char dir[300], msg[4096];
    const char *const subs[] = {"in", "big"};
    ds_fixture(dir, sizeof dir, "tilefit", subs, 2);
    uint8_t px[10 * 13 * 3] = {0};
    ds_png(dir, "in/a.png", 13, 10, 3, px);
    ds_png(dir, "in/b.png", 5, 6, 3, px);
    char input[400];
    snprintf(input, sizeof input, "%s/in", dir);
    PredictCfg pc = {.model = model_cfg_default(), .input = input, .tiled = 1, .overlap = 0.5f};
    pc.model.model = "unet";
    pc.model.depth = 3;
    pc.model.height = pc.model.width = 4096;
    pc.model.batch = 4;
    char err[SN_ERR_MAX];
    CHECK(tile_model_fit(&pc, err) == 0 && pc.model.height == 16 && pc.model.width == 16 &&
                  pc.model.batch == 1,
          "4096x4096 tiles on 13x10 and 5x6 images: %dx%d, batch %d (%s)", pc.model.height,
          pc.model.width, pc.model.batch, err);
    pc.model.height = pc.model.width = 8;
    pc.model.batch = 4;
    pc.tta_flip = 1;
    pc.scale = 2.0f;  // 26x20: 4 tiles of 8 down, 6 across at overlap 0.5, twice
    CHECK(tile_model_fit(&pc, err) == 0 && pc.model.height == 8 && pc.model.width == 8 &&
                  pc.model.batch == 4,
          "8x8 tiles on 26x20: kept (%dx%d, batch %d)", pc.model.height, pc.model.width,
          pc.model.batch);
    char args[1400];
    snprintf(args, sizeof args,
             "predict --model unet --depth 1 --width 4 --classes 3 --weights %s/w.safetensors "
             "--input %s --out %s/out --tile 8x8 --overlap 0.9",
             dir, input, dir);
    CHECK(run_segnet(args, msg, sizeof msg) == 2 &&
                  contains(msg, "--overlap 0.9: at most 0.875") && contains(msg, "1/(1 - F)²"),
          "'%s'", msg);
    // out of memory for the tiles (1.5 GB of address space: 64x64 tiles fit, 1024x1024 do
    // not): the advice is predict's, not training's
    write_seg_set(dir, 2, 8, 8, 19);
    snprintf(args, sizeof args,
             "train --model unet --depth 1 --width 4 --size 8x8 --batch 2 --epochs 1 --classes 3 "
             "--data %s --out %s/run --device cpu --threads 1",
             dir, dir);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "train: %s", msg);
    uint8_t *big = calloc((size_t)1024 * 1024 * 3, 1);
    ds_png(dir, "big/a.png", 1024, 1024, 3, big);
    free(big);
    for (int k = 0; k < 2; k++) {
        snprintf(args, sizeof args,
                 "ulimit -v 1500000; ./segnet predict --run %s/run --input %s/big --out %s/o%d "
                 "--tile %s --device cpu --threads 1",
                 dir, dir, dir, k, k ? "1024x1024" : "64x64");
        const int rc = run_shell(args, msg, sizeof msg);
        if (!k && rc) break;  // the limit leaves no room here even for small tiles: no test
        CHECK(k ? rc == 1 && contains(msg, "out of cpu memory for the network on 1 tiles of "
                                           "1024x1024 a pass: a smaller --tile needs less")
                : rc == 0,
              "--tile %s under 1.5 GB: exit %d, '%s'", k ? "1024x1024" : "64x64", rc, msg);
    }
    ds_remove(dir);
}

// Gap 3: predict says what it does. Without --tile, the first image of more than 4 times the
// model's pixels is named once (resized; --tile predicts at its own size), one of the model's
// size is not. With --tile, an image of more than a pass of tiles shows its tile rows: in a
// log a line per tenth of them, rising to the last; on a terminal (script's pty) one line
// rewritten with \r.
TEST(predict_says_what_it_does) {
    char dir[300], msg[8192], args[1400];
    const char *const subs[] = {"small", "big", "tall"};
    ds_fixture(dir, sizeof dir, "predsay", subs, 3);
    write_seg_set(dir, 2, 8, 8, 23);
    snprintf(args, sizeof args,
             "train --model unet --depth 1 --width 4 --size 8x8 --batch 2 --epochs 1 --classes 3 "
             "--data %s --out %s/run --device cpu --threads 1",
             dir, dir);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "train: %s", msg);
    uint8_t *px = calloc((size_t)80 * 24 * 3, 1);
    ds_png(dir, "small/a.png", 8, 8, 3, px);
    ds_png(dir, "big/a.png", 17, 16, 3, px);  // 272 pixels: more than 4 × 64
    ds_png(dir, "big/b.png", 24, 20, 3, px);
    ds_png(dir, "tall/a.png", 16, 80, 3, px);  // 8x8 tiles: 19 rows of 3 at overlap 0.5
    free(px);
    for (int k = 0; k < 2; k++) {
        snprintf(args, sizeof args,
                 "predict --run %s/run --input %s/%s --out %s/out%d --device cpu --threads 1", dir,
                 dir, k ? "big" : "small", dir, k);
        CHECK(run_segnet(args, msg, sizeof msg) == 0, "predict: %s", msg);
        char want[700];
        snprintf(want, sizeof want,
                 "predict: %s/big/a.png is 16x17 (HxW), resized to the model's 8x8 and its mask "
                 "back (detail is lost); --tile 8x8 predicts at the image's own size\n",
                 dir);
        CHECK(k ? count_substr(msg, "resized to the model's") == 1 && contains(msg, want)
                : !contains(msg, "resized"),
              "%s: '%s'", k ? "two images of 272 and 480 pixels: the first named, once"
                            : "an image of the model's size: nothing said",
              msg);
    }
    snprintf(args, sizeof args,
             "predict --run %s/run --input %s/tall --out %s/out2 --tile 8x8 --device cpu "
             "--threads 1",
             dir, dir, dir);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "predict --tile: %s", msg);
    char head[400];
    snprintf(head, sizeof head, "predict: %s/tall/a.png: tile row ", dir);
    int lines = 0, last = 0, rising = 1;
    for (const char *p = msg; (p = strstr(p, head)); p++) {
        int r = 0, n = 0;
        rising &= sscanf(p + strlen(head), "%d/%d\n", &r, &n) == 2 && n == 19 && r > last;
        last = r;
        lines++;
    }
    CHECK(lines >= 5 && lines <= 10 && last == 19 && rising &&
                  contains(msg, "predict: 1/1 images\n"),
          "a log: a line per tenth of 19 tile rows, rising to 19/19: %d lines, '%s'", lines, msg);
    if (system("command -v script >/dev/null 2>&1") == 0) {
        snprintf(args, sizeof args,
                 "script -qec './segnet predict --run %s/run --input %s/tall --out %s/out3 "
                 "--tile 8x8 --device cpu --threads 1' /dev/null",
                 dir, dir, dir);
        CHECK(run_shell(args, msg, sizeof msg) == 0, "script: %s", msg);
        char *out = read_text("/tmp/segnet_test_out.txt");
        snprintf(args, sizeof args, "\r%s19/19\033[K\rpredict: 1/1 images\033[K", head);
        CHECK(out && count_substr(out, head) >= 10 && contains(out, args) &&
                      !contains(out, "tile row 19/19\n"),
              "a terminal: the tile rows rewritten on one line: '%s'", out ? out : "");
        free(out);
    }
    ds_remove(dir);
}

// Item 7: inside an epoch --resume refuses another --lr, --schedule, --warmup (and --epochs
// for a decaying schedule); between epochs it takes them, saying the lr of the next step
// (a finished poly run extended goes on above 0); plateau takes a new --lr.
TEST(resume_lr_settings) {
    const char *data = "/tmp/segnet_test_lrset_data", *run = "/tmp/segnet_test_lrset_run";
    rm_rf(data); rm_rf(run);
    write_seg_set(data, 8, 8, 8, 13);
    TrainCfg c = tiny_seg_cfg(data, NULL);
    c.model.batch = 2;  // 4 steps an epoch
    c.epochs = 1;
    c.schedule = SCHEDULE_POLY;
    c.lr = 0.001f;
    c.out = run;
    c.interrupt_at_step = 2;
    char err[SN_ERR_MAX];
    CHECK(train_run(&c, NULL, err) == 128 + SIGINT, "interrupted: %s", err);
    c.interrupt_at_step = 0;
    struct { const char *want; float lr; Schedule s; int warmup, epochs; } cases[] = {
        {"--lr 0.002, but the run was interrupted inside epoch 1 with 0.001", 0.002f,
         SCHEDULE_POLY, 0, 1},
        {"--schedule cosine, but the run was interrupted inside epoch 1 with poly", 0.001f,
         SCHEDULE_COSINE, 0, 1},
        {"--warmup 2, but the run was interrupted inside epoch 1 with 0", 0.001f, SCHEDULE_POLY,
         2, 1},
        {"--epochs 3, but the run was interrupted inside epoch 1 with 1", 0.001f, SCHEDULE_POLY,
         0, 3},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        TrainCfg d = c;
        d.lr = cases[k].lr; d.schedule = cases[k].s; d.warmup = cases[k].warmup;
        d.epochs = cases[k].epochs;
        CHECK(train_run(&d, run, err) == -1 && contains(err, cases[k].want), "case %zu: '%s'", k,
              err);
    }
    CHECK(train_run(&c, run, err) == 0, "finished as it began: %s", err);
    // the finished poly run (its lr down to 0) extended: said, with the lr it goes on from
    c.epochs = 2;
    c.progress = 1;
    ResumeJob job = {&c, run, ""};
    int rc;
    char *said = with_stderr_captured(resume_job, &job, &rc);
    CHECK(rc == 0 && contains(said, "--epochs 2 from epoch 2 on (until now 1)") &&
                  contains(said, "the lr of step 5 is 0.0005359 (the run's settings until now "
                                 "give 0)"),
          "extended: '%s' (%s)", said, job.err);
    free(said);
    // plateau: a new --lr between epochs is the lr from there on (metrics.csv's lr column)
    c.schedule = SCHEDULE_PLATEAU;
    c.epochs = 1; c.overwrite = 1; c.progress = 0;
    CHECK(train_run(&c, NULL, err) == 0, "plateau: %s", err);
    c.overwrite = 0; c.epochs = 2; c.lr = 0.004f;
    CHECK(train_run(&c, run, err) == 0, "plateau, --lr 0.004: %s", err);
    char path[400];
    snprintf(path, sizeof path, "%s/metrics.csv", run);
    char *csv = read_text(path);
    CHECK(csv && contains(csv, "\n2,0.004"), "epoch 2 at lr 0.004: %s", csv ? csv : "");
    free(csv);
    rm_rf(data); rm_rf(run);
}

// Item 9: a --data or --label-map path with a line break is refused before anything is
// written (config.txt, a setting per line, could not give it back to --resume).
TEST(config_path_line_break) {
    const char *data = "/tmp/segnet_test_nl\ndata", *run = "/tmp/segnet_test_nl_run";
    char cmd[200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", data);
    CHECK(system(cmd) == 0, "%s", cmd);
    rm_rf(run);
    write_seg_set(data, 2, 8, 8, 17);
    TrainCfg c = tiny_seg_cfg(data, NULL);
    c.out = run;
    char err[SN_ERR_MAX];
    CHECK(train_run(&c, NULL, err) == -1 && contains(err, "--data ") &&
                  contains(err, "the path holds a line break"),
          "'%s'", err);
    CHECK(!file_exists(run), "nothing written");
    c.data = "/tmp";
    c.masks.label_map = "/tmp/segnet_test_nl\rmap.csv";
    CHECK(train_run(&c, NULL, err) == -1 && contains(err, "--label-map ") &&
                  contains(err, "line break"),
          "'%s'", err);
    CHECK(system(cmd) == 0, "%s", cmd);
}

// a PNG of IHDR (w, h, depth, colour) and the chunks after it, as given; no CRCs (stb_image
// reads none)
static void png_of_chunks(const char *path, uint32_t w, uint32_t h, int depth, int colour,
                          const uint8_t *rest, size_t n) {
    uint8_t b[256] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n', 0, 0, 0, 13, 'I', 'H', 'D', 'R'};
    for (int i = 0; i < 4; i++) {
        b[16 + i] = (uint8_t)(w >> (24 - 8 * i));
        b[20 + i] = (uint8_t)(h >> (24 - 8 * i));
    }
    b[24] = (uint8_t)depth; b[25] = (uint8_t)colour;
    memcpy(b + 33, rest, n);
    write_file_bytes(path, b, 33 + n);
}

// Item 13: what is wrong is said: a PNG's size beyond --max-pixels (also where stb_image
// refuses it as too large), a width of 0, a bit depth PNG has not, a palette PNG without its
// palette, a chunk longer than the file (stb_image: "no reason given"); a NUL in a label map
// or CSV; an image given to predict --input.
TEST(png_and_text_messages) {
    char dir[300], path[400], err[SN_ERR_MAX];
    ds_fixture(dir, sizeof dir, "pngmsg", NULL, 0);
    static const uint8_t IDAT_IEND[24] = {0, 0, 0, 0, 'I', 'D', 'A', 'T', 0, 0, 0, 0,
                                          0, 0, 0, 0, 'I', 'E', 'N', 'D', 0, 0, 0, 0};
    // PLTE of one colour (15 bytes from byte 33), then tRNS at 48 with 5 of its bytes
    static const uint8_t PLTE_TRNS[28] = {0, 0, 0, 3, 'P', 'L', 'T', 'E', 0, 0, 0, 0, 0, 0, 0,
                                          0x7f, 0xff, 0xff, 0xff, 't', 'R', 'N', 'S'};
    struct { uint32_t w, h; int depth, colour; const uint8_t *rest; size_t n; const char *want; }
    cases[] = {
        {100000, 100000, 8, 0, IDAT_IEND, 24,
         "100000x100000 is 10000000000 pixels, more than the limit of 100000000 (--max-pixels)"},
        {0, 5, 8, 0, IDAT_IEND, 24, "the header declares a width of 0 pixels"},
        {4, 4, 3, 0, IDAT_IEND, 24, "bit depth 3 with colour type 0 (a PNG has 1, 2, 4, 8 or 16)"},
        {4, 4, 8, 3, IDAT_IEND, 24, "a palette PNG (colour type 3) without its palette (PLTE)"},
        {4, 4, 8, 3, PLTE_TRNS, sizeof PLTE_TRNS,
         "chunk tRNS at byte 48 declares 2147483647 bytes, more than the 1 left"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        snprintf(path, sizeof path, "%s/m%zu.png", dir, k);
        png_of_chunks(path, cases[k].w, cases[k].h, cases[k].depth, cases[k].colour,
                      cases[k].rest, cases[k].n);
        uint8_t *m = mask_load_k(path, 4, 4, 3, NULL, err);
        CHECK(!m && contains(err, path) && contains(err, cases[k].want), "mask %zu: '%s'", k, err);
        free(m);
        int h, w;
        float *img = image_load_rgb(path, &h, &w, err);
        CHECK(!img && contains(err, cases[k].want), "image %zu: '%s'", k, err);
        free(img);
    }
    // a NUL in a label map and in a classifier's CSV
    snprintf(path, sizeof path, "%s/map.csv", dir);
    write_file_bytes(path, "0,0\n1\0,1\n", 9);
    MaskRules rules = {.label_map = path};
    uint8_t *m = mask_load_k(path, 4, 4, 3, &rules, err);
    CHECK(!m && contains(err, "map.csv: row 2: a NUL byte: not a text file"), "'%s'", err);
    free(m);
    snprintf(path, sizeof path, "%s/list.csv", dir);
    write_file_bytes(path, "a\0.png,1\n", 9);
    Dataset d;
    CHECK(dataset_open(&d, path, 0, 3, 4, 4, 0, 1, err) == -1 &&
                  contains(err, "list.csv: row 1: a NUL byte"),
          "'%s'", err);
    // predict --input an image
    uint8_t px[12] = {0};
    ds_png(dir, "one.png", 2, 2, 3, px);
    snprintf(path, sizeof path, "%s/one.png", dir);
    PathList l;
    CHECK(list_images(path, &l, err) == -1 &&
                  contains(err, "one.png: an image, but --input takes a folder of images or a CSV"),
          "'%s'", err);
    ds_remove(dir);
}

// ---- robustness (3), part A

// Finding 3, 8, 10, 12, 14: a number is checked as the float it becomes (inf, a nonzero value
// that becomes 0 or subnormal, outside its option's domain: refused, naming the option and
// the problem); --lr-factor ≥ 1 (Keras refuses it), empty --loss terms, specs longer than
// their parser's buffer, the masks' options for a classifier and the constants that zero a
// term's gradient are refused too. Each: exit 2, one line, no run folder.
TEST(number_options_refused) {
    const char *run = "/tmp/segnet_test_numbers_run";
    rm_rf(run);
    char long_aug[320] = "flip", aug_case[400];
    while (strlen(long_aug) < 290) strcat(long_aug, ",flip");
    snprintf(aug_case, sizeof aug_case, "--augment %s", long_aug);
    const struct { const char *extra, *want; } cases[] = {
        {"--loss 1e-50*ce+dice", "the weight of '1e-50*ce' is too small for a float"},
        {"--loss 1e39*ce", "the weight of '1e39*ce' is beyond a float"},
        {"--clipnorm 1e39", "--clipnorm '1e39' is beyond a float"},
        {"--adam-eps 1e39", "--adam-eps '1e39' is beyond a float"},
        {"--adam-eps 1e-50", "--adam-eps '1e-50' is too small for a float"},
        {"--adam-eps 0", "--adam-eps '0' is not a number > 0"},
        {"--min-lr 1e39", "--min-lr '1e39' is beyond a float"},
        {"--lr-min-delta 1e39", "--lr-min-delta '1e39' is beyond a float"},
        {"--lr 3.5e38", "--lr '3.5e38' is beyond a float"},
        {"--lr 1e-40", "--lr '1e-40' is too small for a float"},
        {"--weight-decay 1e39", "--weight-decay '1e39' is beyond a float"},
        {"--min-delta 1e39", "--min-delta '1e39' is beyond a float"},
        {"--loss focal --focal-gamma 1e39", "--focal-gamma '1e39' is beyond a float"},
        {"--loss dice --loss-smooth 1e39", "--loss-smooth '1e39' is beyond a float"},
        {"--loss tversky --tversky-beta 1e39", "--tversky-beta '1e39' is beyond a float"},
        {"--class-weights 1e-50,1,1", "--class-weights '1e-50,1,1': item 1 is too small"},
        {"--class-weights 1,1e39,1", "item 2 is beyond a float"},
        {"--lr-factor 1e39", "--lr-factor '1e39' is beyond a float"},
        {"--lr-factor 1", "--lr-factor '1' is not a number in [0, 1) (as Keras"},
        {"--lr-factor 1.5", "--lr-factor '1.5' is not a number in [0, 1)"},
        {"--lr-factor 0.99999999", "is not a number in [0, 1)"},  // 1 as a float
        {"--loss ce+", "--loss 'ce+': an empty term"},
        {"--loss +ce", "--loss '+ce': an empty term"},
        {"--loss ce++dice", "--loss 'ce++dice': an empty term"},
        {"--loss ce++2*dice", "--loss 'ce++2*dice': an empty term"},
        {aug_case, "characters long, longer than 255"},
        {"--loss tversky --tversky-gamma 0", "--tversky-gamma '0' is not a number > 0"},
        {"--loss tversky --tversky-alpha 0 --tversky-beta 0",
         "--tversky-alpha 0 with --tversky-beta 0: the tversky score is then 1"},
        {"--loss focal --focal-alpha 0", "--focal-alpha '0' is not a number > 0 (at 0 the focal"},
        {"--model effv2-t --ignore-index 255",
         "--ignore-index: model 'effv2-t' is a classifier"},
        {"--model effv2-t --label-map /tmp/segnet_test_numbers_map.csv",
         "--label-map: model 'effv2-t' is a classifier"},
    };
    char args[1200], msg[4096];
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        snprintf(args, sizeof args,
                 "train --size 32x32 --classes 3 --device cpu --data /tmp/segnet_test_numbers_none "
                 "--out %s %s",
                 run, cases[k].extra);
        const int rc = run_segnet(args, msg, sizeof msg);
        CHECK(rc == 2 && contains(msg, cases[k].want) && strchr(msg, '\n') == strrchr(msg, '\n'),
              "`%.80s`: exit %d, '%s'", cases[k].extra, rc, msg);
        CHECK(!file_exists(run), "`%.80s`: %s was made", cases[k].extra, run);
    }
    rm_rf(run);
}

// Finding 3: what config.txt records reads back as the same floats, for the extreme values
// each option takes (the largest and smallest floats, the float below 1); finding 10: the
// loss's terms in any order are one loss.
TEST(config_extremes_read_back) {
    const char *dir = "/tmp/segnet_test_extremes";
    rm_rf(dir);
    CHECK(mkdir(dir, 0755) == 0, "mkdir %s", dir);
    char *argv[] = {"segnet", "train", "--model", "unet", "--classes", "3", "--dropout",
                    "0.99999994", "--lr", "3.40282347e38", "--adam-eps", "1.17549435e-38",
                    "--weight-decay", "1.2e-38", "--clipnorm", "3.4e38", "--min-delta",
                    "1.17549435e-38", "--schedule", "plateau", "--lr-factor", "0.99999994",
                    "--min-lr", "3.4e38", "--lr-min-delta", "3.4e38", "--loss",
                    "3.4e38*tversky+1.17549435e-38*ce+0.1*focal+lovasz", "--focal-gamma",
                    "3.4e38", "--focal-alpha", "1.2e-38", "--loss-smooth", "3.4e38",
                    "--tversky-alpha", "0", "--tversky-beta", "1.2e-38", "--tversky-gamma",
                    "3.4e38", "--class-weights", "0,1.17549435e-38,3.40282347e38"};
    TrainArgs a = {0}, b = {0};
    CHECK(parse_train_args(&a, (int)(sizeof argv / sizeof *argv), argv, "train", "") == 0,
          "the extreme values are refused");
    char err[SN_ERR_MAX];
    CHECK(write_config(&a.c, dir, err) == 0, "%s", err);
    char *again[] = {"segnet", "train", "--run", (char *)dir};
    CHECK(parse_train_args(&b, 4, again, "train", "") == 0, "config.txt does not read back");
    const TrainCfg *x = &a.c, *y = &b.c;
    const struct { const char *name; const float *was, *now; int n; } floats[] = {
        {"dropout", &x->model.dropout, &y->model.dropout, 1},
        {"lr", &x->lr, &y->lr, 1},
        {"adam-eps", &x->adam_eps, &y->adam_eps, 1},
        {"weight-decay", &x->weight_decay, &y->weight_decay, 1},
        {"clipnorm", &x->clipnorm, &y->clipnorm, 1},
        {"min-delta", &x->min_delta, &y->min_delta, 1},
        {"lr-factor", &x->plateau.factor, &y->plateau.factor, 1},
        {"min-lr", &x->plateau.min_lr, &y->plateau.min_lr, 1},
        {"lr-min-delta", &x->plateau.min_delta, &y->plateau.min_delta, 1},
        {"loss weights", x->loss.weight, y->loss.weight, 4},
        {"loss-smooth", &x->loss.smooth, &y->loss.smooth, 1},
        {"focal-gamma", &x->loss.focal_gamma, &y->loss.focal_gamma, 1},
        {"focal-alpha", &x->loss.focal_alpha, &y->loss.focal_alpha, 1},
        {"tversky-alpha", &x->loss.tversky_alpha, &y->loss.tversky_alpha, 1},
        {"tversky-beta", &x->loss.tversky_beta, &y->loss.tversky_beta, 1},
        {"tversky-gamma", &x->loss.tversky_gamma, &y->loss.tversky_gamma, 1},
        {"class-weights", x->class_weights, y->class_weights, 3},
    };
    for (size_t k = 0; k < sizeof floats / sizeof *floats; k++)
        for (int i = 0; i < floats[k].n; i++)
            CHECK(isfinite(floats[k].was[i]) &&
                          !memcmp(&floats[k].was[i], &floats[k].now[i], sizeof(float)),
                  "%s[%d]: %.9g written, %.9g read back", floats[k].name, i, floats[k].was[i],
                  floats[k].now[i]);
    CHECK(x->lr == FLT_MAX && x->adam_eps == FLT_MIN && x->plateau.factor == nextafterf(1, 0) &&
                  x->loss.weight[0] == FLT_MIN && x->loss.weight[2] == 3.4e38f,
          "the values parsed: lr %.9g, adam-eps %.9g, lr-factor %.9g, loss weights %.9g %.9g",
          x->lr, x->adam_eps, x->plateau.factor, x->loss.weight[0], x->loss.weight[2]);
    CHECK(y->loss.n == 4 && !memcmp(x->loss.kind, y->loss.kind, sizeof x->loss.kind),
          "the loss's terms read back");
    train_args_free(&a);
    train_args_free(&b);
    // one order, the menu's, whatever the order given; a spec of any length, whose weights
    // may hold a + (1e+06, as config.txt writes it)
    LossCfg l1 = loss_cfg_default(), l2 = loss_cfg_default();
    char spec[300] = "0.5";
    while (strlen(spec) < 251) strcat(spec, "0");
    strcat(spec, "*ce+dice");  // 255 characters, then +dice: a buffer of 256 lost dice
    CHECK(parse_loss(spec, &l1) == 0 && l1.n == 2 && l1.kind[1] == LOSS_DICE &&
                  l1.weight[0] == 0.5f,
          "a long --loss: %d terms", l1.n);
    CHECK(parse_loss("1e+06*ce+2.5E+1*dice", &l1) == 0 && l1.n == 2 && l1.weight[0] == 1e6f &&
                  l1.weight[1] == 25.0f,
          "weights written with exponents: %d terms", l1.n);
    CHECK(parse_loss("lovasz+0.5*jaccard+dice+2*ce", &l1) == 0 &&
                  parse_loss("2*ce+dice+0.5*jaccard+lovasz", &l2) == 0 &&
                  !memcmp(&l1, &l2, sizeof l1) && l1.kind[0] == LOSS_CE &&
                  l1.kind[1] == LOSS_DICE && l1.kind[2] == LOSS_JACCARD &&
                  l1.kind[3] == LOSS_LOVASZ && l1.weight[2] == 0.5f,
          "--loss in two orders: %d terms", l1.n);
    rm_rf(dir);
}

// Findings 10 and 11: a resumed run may give its loss's terms in another order; a changed
// constant of the loss, or --ignore-index, is named with both values (they used to print as
// two identical loss strings, and the run's --ignore-index merged into the one given).
TEST(resume_names_loss_change) {
    const char *data = "/tmp/segnet_test_losschange_data", *run = "/tmp/segnet_test_losschange";
    rm_rf(data); rm_rf(run);
    write_seg_set(data, 2, 8, 8, 5);
    char args[1200], msg[4096];
    snprintf(args, sizeof args,
             "train --model unet --depth 1 --width 2 --size 8x8 --batch 2 --classes 3 "
             "--class-weights 0,1,1 --device cpu --threads 1 --epochs 1 --ignore-index 255 "
             "--loss tversky+dice+focal+ce --data %s --out %s",
             data, run);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "%s", msg);
    const struct { const char *extra, *want; int rc; } cases[] = {
        {"--loss-smooth 0.5", "--loss-smooth 0.5, but the run was trained with 1e-05", 1},
        {"--focal-gamma 1", "--focal-gamma 1, but the run was trained with 2", 1},
        {"--tversky-alpha 0.3", "--tversky-alpha 0.3, but the run was trained with 0.5", 1},
        {"--loss-per-image", "--loss-per-image on, but the run was trained with off", 1},
        {"--loss ce+dice", "--loss ce+dice, but the run was trained with ce+focal+dice+tversky",
         1},
        {"--ignore-index 254", "--ignore-index 254, but the run was trained with 255", 2},
        {"--ignore-index 255", "", 0},  // the run's own: no change
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        snprintf(args, sizeof args, "train --resume %s --epochs 2 %s", run, cases[k].extra);
        const int rc = run_segnet(args, msg, sizeof msg);
        CHECK(rc == cases[k].rc && contains(msg, cases[k].want), "`%s`: exit %d, '%s'",
              cases[k].extra, rc, msg);
    }
    snprintf(args, sizeof args, "train --resume %s --epochs 3 --loss dice+ce+tversky+focal", run);
    CHECK(run_segnet(args, msg, sizeof msg) == 0, "the terms in another order: '%s'", msg);
    rm_rf(data); rm_rf(run);
}
