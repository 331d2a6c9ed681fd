// images.h -- images, masks and prediction
// Declarations of images.c (plumbing: segnet.c includes the file at its end).
#pragma once
#include "../segnet.h"


// ----------------------------------------------------------------------------
// images and classifier prediction

typedef struct { char **paths; int n, cap; } PathList;
// a folder's *.png/*.jpg/*.jpeg (sorted), or the first column of a CSV
int list_images(const char *input, PathList *out, char err[SN_ERR_MAX]);
void path_list_free(PathList *l);
// (h,w,3) RGB values 0..255, malloc'd, as stored or, with --exif apply, as a
// JPEG's EXIF orientation displays it; NULL with err naming the file
float *image_load_rgb(const char *path, int *h, int *w, char err[SN_ERR_MAX]);

// PNG output, atomic (<path>.tmp.<pid> in the same folder, fsync, rename): comp
// 1 (grey) or 3 (RGB). On failure the temporary is removed and a file already
// at path is untouched.
int png_write_atomic(const char *path, int w, int h, int comp, const uint8_t *pixels,
                     char err[SN_ERR_MAX]);

typedef struct {
    ModelCfg model;        // any model; its batch is the prediction batch
    const char *weights;   // safetensors, PyTorch layout, every tensor present
    const char *input;     // folder of images, or CSV with the paths in its first column
    // Classifier (1×1 output): CSV `path,pred,p0,...`, replaced atomically,
    // untouched on failure. Segmentation: a folder (created if missing) that
    // receives per image <stem>.png, the mask (grey = class, K ≤ 256), and
    // <stem>_overlay.png (image and class colour 50/50), at the image's size;
    // each PNG atomic, nothing written unless every image decodes. Never the
    // input folder or inside it; an existing file only with overwrite, and
    // only one an earlier predict wrote (OUT/.segnet-predict lists those).
    const char *out;
    int progress;          // report progress on stderr
    Device device;         // where the forward passes run
    // classifier: a `pred_name` column with class k's name (n_class_names, 0: none)
    char **class_names;
    int n_class_names;
    // replace existing outputs that an earlier predict wrote (never anything else)
    int overwrite;
    // segmentation at the image's own resolution: model.height × width tiles
    // overlapping by this fraction of a tile (images.c, "tiled prediction")
    int tiled;
    float overlap;
    int tta_flip;          // with tiled: each tile also mirrored left-right
    // with tiled: also <stem>_probs.safetensors, the blended probabilities (h,w,K) fp16
    int probs;
    // with tiled: tiles of the image resized by this factor (bilinear), the
    // probabilities resized back to the image's size (0 or 1: its own size)
    float scale;
} PredictCfg;
int predict_run(const PredictCfg *cfg, char err[SN_ERR_MAX]);
// Whether path, or when it does not exist yet the folder it would be made in, is the folder
// `folder` or lies inside it (0 when folder is not one); links and spellings make no difference
int path_within_folder(const char *path, const char *folder);
