// datasets.h -- data sets: listing, decoding, augmentation, batching, prefetch
// Declarations of datasets.c (plumbing: segnet.c includes the file at its end).
#pragma once
#include "../segnet.h"
#include "images.h"


// ----------------------------------------------------------------------------
// data sets: listing, decoding, resizing, augmentation, batching, prefetch
//
// Segmentation: DIR/images/*.{png,jpg,jpeg} and DIR/masks/*.png with the same
// stem; a mask pixel's value is its class index 0..K-1, K ≤ 255 (a PNG of grey
// of 1 to 16 bits, grey stored as colour, or a palette PNG, whose indices are
// the values), unless MaskRules map or ignore it. Classification: a CSV `path,label` (paths
// relative to the CSV's folder, an optional header whose first field is `path`)
// or DIR/<class>/*.{png,jpg,jpeg}, the sub-folders sorted by name giving
// classes 0, 1, ... (more sub-folders than K are refused).
//
// dataset_open checks everything before training starts (every file decodes,
// every image has its mask and the reverse, mask sizes equal image sizes, mask
// values and labels lie in 0..K-1), decoding on `threads` threads. Of several
// bad files the first in sample order is reported, whatever the threads.
// Samples are in stem order (segmentation), row order (CSV) or class then name
// order (folders). The resized samples stay in memory as bytes when
// n·H·W·3 (+ n·H·W for masks) ≤ cache_bytes; else dataset_batch decodes them
// again. Images are resized to the model's size with bilinear interpolation
// (half-pixel centres, the resize op's, rounded to bytes), masks with nearest
// neighbour (half-pixel centres: src = ⌊(dst + ½)·in/out⌋).

typedef struct {
    int flip;                        // random horizontal flip of image and mask together, p = 1/2
    // tf.image.random_brightness: + δ ~ U[-D, D] on 0..1 values (0: off)
    float brightness;
    // tf.image.random_contrast: (x - mean_c)·f + mean_c, f ~ U[lo, hi] (0,0: off)
    float contrast_lo, contrast_hi;
    // segmentation's geometry, image and mask together (see sample_augment):
    float scale_lo, scale_hi;        // zoom by s ~ U[lo, hi], then a random crop (0,0: off)
    float rotate;                    // rotation by θ ~ U[-D, D] degrees (0: off)
    int vflip;                       // random vertical flip, p = 1/2
    // colour, tf.image.adjust_hue / adjust_saturation on 0..1 values
    float hue;                       // hue + δ ~ U[-D, D] of the colour circle (0: off)
    float saturation_lo, saturation_hi;  // saturation × f ~ U[lo, hi], clipped to 1 (0,0: off)
} Augment;

// What a mask's values mean: value v (0..65535) is first mapped by the label
// map, if any (a value it does not list is an error), then ignored if it is
// one of `ignore`, else it must be a class 0..K-1. An ignored pixel reaches the
// model as SN_LABEL_IGNORED: it adds nothing to the loss, its normaliser, the
// metrics or the gradients.
#define MASK_VALUES 65536   // the values a mask pixel can hold (8- or 16-bit PNG)
#define SN_MAX_IGNORE 16    // --ignore-index values
typedef struct {
    int n_ignore;
    int32_t ignore[SN_MAX_IGNORE];  // (n_ignore) values after the label map
    // CSV `value,class` (an optional header row `value,class`), or NULL: class = value
    const char *label_map;
} MaskRules;

typedef struct {
    int segmentation;       // 1: images + masks; 0: classification
    int n;                  // samples
    int classes;            // K
    int height, width;      // every sample is resized to this
    char **images;          // (n) image paths
    char **masks;           // (n) mask paths (segmentation), else NULL
    int32_t *labels;        // (n) class per sample (classification), else NULL
    uint8_t *image_cache;   // (n,H,W,3) resized RGB, or NULL when not cached
    uint8_t *mask_cache;    // (n,H,W) resized class indices or MASK_IGNORED, or NULL
    // (MASK_VALUES) the class of each mask value, SN_LABEL_IGNORED, or MASK_UNMAPPED
    // (segmentation), else NULL
    int32_t *value_class;
    char *label_map;        // MaskRules.label_map (for messages), or NULL
    // (n_names) class k's name: class folders, or a CSV's text labels; else NULL
    char **names;
    int n_names;
    int64_t *class_counts;  // (classes) the pixels (of the resized masks) or samples of each class
    int64_t ignored;        // the resized masks' ignored pixels
} Dataset;
#define MASK_IGNORED 255    // a resized mask's byte for an ignored pixel (so K ≤ 255)
#define MASK_UNMAPPED (-2)  // Dataset.value_class of a value the label map lacks

// Returns 0, or -1 with one line in err naming the file (row, pixel) and the problem.
int dataset_open(Dataset *d, const char *path, int segmentation, int classes, int height, int width,
                 size_t cache_bytes, int threads, char err[SN_ERR_MAX]);
// The same for a set whose class names must be those of `names_from` (a
// validation set takes the training set's: a folder or label absent from the
// validation set shifts nothing; one the training set lacks is an error).
// Named classes: the sorted folder names, or the sorted distinct text labels
// of a CSV (a CSV's labels are all integers 0..K-1 or all names). masks: how
// to read the mask values (NULL: each value is its class).
int dataset_open_named(Dataset *d, const char *path, int segmentation, int classes, int height,
                       int width, size_t cache_bytes, int threads, const Dataset *names_from,
                       const MaskRules *masks, char err[SN_ERR_MAX]);
void dataset_free(Dataset *d);

// Assembles one batch of samples idx[0..n-1]: images (n,H,W,3) fp32 0..255 after
// augmentation; labels (n·H·W) classes or SN_LABEL_IGNORED (segmentation), or
// (n) classes.
// Augmentation in this order: the geometry (flips, zoom and crop, rotation),
// hue, saturation, brightness, contrast (on values/255, then ×255). Sample j's
// random choices depend only on (seed, idx[j]) (counter-based), so a batch is
// the same whichever thread builds it; pass a new seed per epoch for new draws.
// aug NULL (or all zero): the resized bytes as floats, exactly.
// Returns 0, or -1 with err (a file that changed on disk since dataset_open,
// with the message dataset_open would give).
int dataset_batch(const Dataset *d, const int *idx, int n, const Augment *aug, uint64_t seed,
                  float *images, int32_t *labels, char err[SN_ERR_MAX]);

// Prefetch: `workers` threads (pthreads) build the batches of `order` (n_order
// sample indices, copied; taken `batch` at a time, the last batch possibly
// smaller) up to `depth` batches ahead, each batch as dataset_batch(seed) would;
// loader_next hands them out in order. Batches are identical for any workers
// and depth. d must outlive the loader.
// K > 0: a worker also sums its batch's label weights, label_weight_sum(labels,
// K, weights) (weights NULL: a label in 0..K-1 counts 1), the loss normaliser,
// so that the trainer does not (a serial pass over every label of the step).
// wire non-NULL: a worker also makes the images ready to travel to wire's
// backend: as bytes when the augmentation keeps them whole (none, or flips
// alone: augment_keeps_bytes), else in the storage type; that copy and the
// labels lie in wire's host_alloc memory (pinned on CUDA), which the device
// copies from without staging (MicroBatch.wire).
typedef struct {
    int n;             // images in this batch (≤ batch)
    float *images;     // (n,H,W,3)
    int32_t *labels;   // (n·H·W) or (n)
    int index;         // batch number within the order, 0-based
    double weight_sum; // Σ of the labels' weights (K > 0), else 0
    void *wire;        // (n,H,W,3) the images as bytes (wire_bytes) or in the storage type, or NULL
    int wire_bytes;
} LoaderBatch;
typedef struct Loader Loader;
Loader *loader_start(const Dataset *d, const int *order, int n_order, int batch, const Augment *aug,
                     uint64_t seed, int workers, int depth, int K, const float *weights, Ops *wire,
                     DType storage);
// The next batch (valid until the next call or loader_stop), or NULL after the
// last one or on an error (then loader_error gives it, and every later call
// returns NULL). Blocks only while that batch is still being built.
const LoaderBatch *loader_next(Loader *l);
// The batch loader_next returns next, when it is built already, else NULL; it stays valid
// (and unchanged) until the loader_next call after that one returns. Does not wait.
const LoaderBatch *loader_peek(Loader *l);
const char *loader_error(const Loader *l);  // "" if none
void loader_stop(Loader *l);                // at any time: joins the workers, frees everything

// --class-weights auto: w (K) by median-frequency balancing over the training
// set at path, its masks resized to (H,W) (see datasets.c); -1 with err.
int class_weights_median_frequency(const char *path, int segmentation, int K, int H, int W,
                                   const MaskRules *rules, float *w, char err[SN_ERR_MAX]);
