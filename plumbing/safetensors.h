// safetensors.h -- safetensors files: the reader and the writer
// Declarations of safetensors.c (plumbing: segnet.c includes the file at its end).
#pragma once
#include "../segnet.h"


// ----------------------------------------------------------------------------
// safetensors files: u64 little-endian N, N bytes of JSON header
//   {"__metadata__": {"k": "v", ...}, "name": {"dtype": "F32", "shape": [d0, ...],
//    "data_offsets": [begin, end]}, ...}
// then the data section; offsets are relative to its start (byte 8 + N).
// Tensors are row-major and little-endian. segnet reads and writes F32, F16, BF16.

#define SF_MAX_DIMS 8

typedef struct {
    char name[SN_NAME_MAX];
    DType dtype;
    int ndim;                    // 0 for a scalar (shape [])
    int64_t dims[SF_MAX_DIMS];
    size_t numel;                // Π dims (1 for a scalar)
    // safetensors_read: points into SafetensorsFile.bytes, with NO alignment guarantee (the data
    // section starts wherever the header ends, and offsets are arbitrary):
    // memcpy out of it, never cast it to float*. safetensors_write: the caller's memory.
    const void *data;
} SafetensorsTensor;

typedef struct {
    SafetensorsTensor *tensors; int n_tensors;            // in header order
    char **meta_keys, **meta_values;             // "__metadata__", in header order, each malloc'd
    int n_meta;
    uint8_t *bytes; size_t n_bytes;              // the whole file, owned
} SafetensorsFile;

// Reads a whole file. Returns 0, or -1 with one line in err naming the file,
// the problem and the tensor at fault (f is then empty; safetensors_free is harmless).
// Never reads outside the file. Accepts holes (unused bytes) in the data section.
int safetensors_read(const char *path, SafetensorsFile *f, char err[SN_ERR_MAX]);
void safetensors_free(SafetensorsFile *f);
// NULL if absent
const SafetensorsTensor *safetensors_find(const SafetensorsFile *f, const char *name);

// Writes tensors (laid out in order, contiguous) and optional string metadata.
// Atomic: writes "<path>.tmp.<pid>", fsyncs it, renames it over path, fsyncs
// the directory. Returns 0, or -1 with err set; on failure before the rename
// the temporary is removed and a file already at path is untouched.
int safetensors_write(const char *path, const SafetensorsTensor *tensors, int n,
                      const char *const *meta_keys, const char *const *meta_values, int n_meta,
                      char err[SN_ERR_MAX]);

// Writes the n_parts buffers one after another to path, atomically: to
// "<path>.tmp.<pid>", fsynced, renamed over path, directory fsynced. On
// failure the temporary is removed and a file already at path is untouched.
int file_write_atomic(const char *path, const void *const *parts, const size_t *sizes, int n_parts,
                      char err[SN_ERR_MAX]);

// Weights by name (segnet's = torchvision's, or timm's), files in PyTorch layout
// (conv weights OIHW). Loading checks
// everything before changing anything: tensors missing from the file, of the
// wrong shape, or (unless allow_unexpected) unknown to the model refuse the
// load with their names in err. Names starting with allow_missing (e.g.
// "classifier.") may be absent or of another shape (a new head): they keep
// their current values.
int net_load_weights(Net *net, const SafetensorsFile *f, const char *path,
                     const char *allow_missing, int allow_unexpected, char err[SN_ERR_MAX]);
// The same with a report: `init` and `ignore` are comma-separated name
// prefixes; model tensors under `init` may be absent or of another shape
// (they keep their initial values), file tensors under `ignore` ("*": any)
// may go unused. On success `report` (SN_ERR_MAX bytes, if not NULL) holds
// "weights: N tensors loaded from FILE (S names), M initialised (...), K
// ignored (...)" with S the naming found: timm, or torchvision (segnet's own
// names are torchvision's). check_only: every check, nothing copied.
typedef struct { const char *init, *ignore; int check_only; } LoadRules;
// The padding EfficientNetV2 weights were trained with: the file's
// "padding" metadata (segnet's checkpoints, ref/'s files), else timm's
// tf_efficientnetv2 names (TensorFlow's SAME) or torchvision's names
// (symmetric). 1 with *pad and `why` set, 0 when the file does not say
// (segnet checkpoints from before the metadata, other names).
int weights_padding(const SafetensorsFile *f, PadMode *pad, const char **why);
// For a run with --weights on an EfficientNetV2 (or unet-effv2-*) model: with
// no --padding, the weights' padding becomes m->pad; a --padding that
// contradicts them gets a warning on stderr (`cmd` names the command). `note`
// (SN_ERR_MAX bytes) receives "padding P (why)" for the report. -1 on an
// unreadable file.
int padding_follow_weights(ModelCfg *m, const char *weights, const char *cmd, char *note,
                           char err[SN_ERR_MAX]);
int net_load_weights_rules(Net *net, const SafetensorsFile *f, const char *path,
                           const LoadRules *rules, char *report, char err[SN_ERR_MAX]);
int net_save_weights(const Net *net, const char *path, char err[SN_ERR_MAX]);
// Training checkpoints: the weights as above plus `extra` tensors (named
// TRAIN_STATE_PREFIX..., which loading weights ignores) and string metadata.
#define TRAIN_STATE_PREFIX "train_state."
int net_save_checkpoint(const Net *net, const char *path, const SafetensorsTensor *extra,
                        int n_extra, const char *const *meta_keys, const char *const *meta_values,
                        int n_meta, char err[SN_ERR_MAX]);
// timm's name (tf_efficientnetv2_*) for an EfficientNetV2 tensor of g; 0 if none.
// Loading finds a tensor by its segnet/torchvision name, else by this one.
int effnet_timm_name(const Graph *g, const char *name, char out[SN_NAME_MAX]);
// segmentation_models_pytorch's name for a unet-effv2-* tensor (--bottleneck stage): the
// encoder's (features.*) under smp's encoder.model. in timm's names, the decoder's as they
// are. Loading tries it after the timm name.
int unet_smp_name(const Graph *g, const char *name, char out[SN_NAME_MAX]);
// values as fp32, whatever the dtype
void safetensors_tensor_f32(const SafetensorsTensor *t, float *dst);
