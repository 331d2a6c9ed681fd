// run.h -- the training run and evaluation
// Declarations of run.c (plumbing: segnet.c includes the file at its end).
#pragma once
#include "../segnet.h"
#include "datasets.h"
#include "curves.h"


// ----------------------------------------------------------------------------
// the training run and evaluation

typedef struct {
    ModelCfg model;                 // model.batch is the training batch
    const char *data, *val;         // training and (optional) validation data
    const char *out;                // run folder (NULL: runs/<timestamp>)
    const char *weights;            // initial weights (safetensors), or NULL
    // more prefixes (comma-separated) of tensors the weights may lack, or NULL
    const char *allow_missing;
    // appended to the `weights:` line (the padding decided), or NULL
    const char *weights_note;
    int class_weights_given;
    float class_weights[SN_MAX_CLASSES];  // default all 1
    MaskRules masks;                // --ignore-index, --label-map
    int epochs;
    float lr, adam_eps, weight_decay, clipnorm;
    Schedule schedule;
    PlateauCfg plateau;             // --schedule plateau: --lr-factor, --min-lr, ...
    int warmup;                     // steps
    int patience;                   // early stopping on the monitored value; 0: off
    // 0: monitor val_loss (lower is better); 1: val_mIoU / val_accuracy (higher);
    // 2: val_dice (segmentation; higher)
    int monitor_metric;
    float min_delta;                // an epoch improves by more than this (Keras' min_delta)
    Augment augment;
    uint64_t seed;
    int threads;                    // 0: OpenMP's default
    int loss_norm_keras;            // divide the loss by the pixel count, not Σ w
    LossCfg loss;                   // --loss and its constants (n 0: ce alone)
    int iou_per_image;              // mIoU: the mean of each image's (segmentation_models')
    int workers;                    // data loader threads
    size_t cache_bytes;             // decoded data kept in memory up to this
    int progress;                   // 0 quiet, 1 progress on stderr
    int stop_after_epochs;          // leave after this many epochs, as if interrupted (0: never)
    // tests: act as if SIGINT came during this optimiser step (0: never)
    int64_t interrupt_at_step;
    DType precision;                // activation storage: fp32, fp16 (with loss scaling) or bf16
    int accum;                      // micro-batches per optimiser step (gradient accumulation)
    int freeze_base;                // freeze the backbone (graph_freeze_base) ...
    int unfreeze_last;              // ... except its last N blocks
    int loss_scale_interval;        // fp16: finite steps before the loss scale doubles
    // recompute each block's activations in backward (--checkpoint blocks)
    int checkpoint;
    // train_cfg_default: DEVICE_CPU; the command line's default is DEVICE_AUTO
    Device device;
    // local replicas in this process (--replicas N); model.batch is the global batch
    int replicas;
    // batch norm over the global batch (--sync-bn), else over each replica's shard
    int sync_bn;
    // steps.csv: the step diagnostics every this many optimiser steps (0: none)
    int log_every;
    // train metrics from an inference-mode pass over the training set at each epoch's end
    int train_eval;
    // tests: this optimiser step's gradients get an inf (fp16 overflow) (0: never)
    int64_t overflow_at_step;
    // a new run may replace the files of an earlier one in its folder (--overwrite)
    int overwrite;
} TrainCfg;

void train_cfg_default(TrainCfg *c);
// --schedule's names, indexed by Schedule
static const char *const SCHEDULE_NAMES[] = {"constant", "cosine", "poly", "plateau"};
// Trains and writes the run folder. resume: a run folder to continue, whose
// config.txt the caller has already parsed into c. Returns 0, -1 with one
// line in err, or 128 + the signal when SIGINT/SIGTERM (interrupt_handlers)
// stopped it after a step, saved for --resume; nothing in an existing run folder is
// changed before every input has been checked. With c->replicas > 1, or when started by mpirun
// with several processes, the global batch model.batch is split over the
// replicas (train_run_comm for a communicator of one's own); only rank 0
// writes the run folder.
int train_run(const TrainCfg *c, const char *resume, char err[SN_ERR_MAX]);
int train_run_comm(const TrainCfg *c, const char *resume, Comm *comm, char err[SN_ERR_MAX]);

// segnet augment: what epoch `epoch` (1-based) of a run with c's settings feeds
// the network for samples 0..n-1 of c->data, as PNGs in the folder out (see run.c)
int augment_write(const TrainCfg *c, const char *out, int n, int epoch, char err[SN_ERR_MAX]);

// Evaluates weights on a data set: loss (the weighted mean, or Keras' pixel
// mean) and the metrics. iou: (K) caller's memory.
typedef struct { double loss; Metrics m; } EvalResult;
int eval_run(const TrainCfg *c, const char *weights, const char *data, EvalResult *r,
             char err[SN_ERR_MAX]);
