// curves.h -- training curves (curves.svg)
// Declarations of curves.c (plumbing: segnet.c includes the file at its end).
#pragma once
#include "../segnet.h"


// ----------------------------------------------------------------------------
// training curves: one record per epoch; NaN where a value does not exist
// (no validation set)

typedef struct {
    int epoch;                // 1-based
    double lr;                // learning rate at the end of the epoch
    double loss, val_loss;
    double metric, val_metric;  // mean IoU (segmentation) or accuracy (classification)
    // the optimisation diagnostics (metrics.csv's last columns; see "optimisation diagnostics" in
    // segnet.c)
    double grad_norm_mean, grad_norm_max, clip_fraction, loss_scale, skipped_steps, update_ratio,
            step_ms;
    double dice, val_dice;    // mean Dice (segmentation), else NaN
} EpochRecord;

// What curves.svg marks besides the records: the best epoch (0: none) and the
// clipping threshold (0: none).
typedef struct { int best_epoch; double clipnorm; } CurveMarks;

// curves.svg: four panels with axis labels against the epoch: loss (train and
// val), the metric (train and val), the gradient norm (mean and max over the
// epoch's steps, the clipping threshold as a line, epochs with skipped steps
// marked, the loss scale on a second axis), and the learning rate with the
// update ratio on a second axis; the best epoch marked in each. Written atomically.
int write_curves_svg(const char *path, const EpochRecord *rows, int n, const char *metric_name,
                     const CurveMarks *marks, char err[SN_ERR_MAX]);
