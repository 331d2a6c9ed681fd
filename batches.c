// batches.c -- a batch in the trainer (part III; segnet.c includes it before
// step_work): the host staging of a micro-batch and its upload, the loss menu's
// terms and the metrics of the batch in the net (score_batch), an evaluation
// batch, and what the region terms exchange between replicas and micro-batches.

// A micro-batch into the host staging buffers (written while the device is
// idle: after the last step's download, or a synchronize).
static void stage_batch(Trainer *t, const MicroBatch *mb) {
    // an empty shard (a last batch smaller than the replicas): its arrays are NULL
    if (mb->n == 0) return;
    const Shape in = t->g.tensors[t->g.input].shape;
    memcpy(t->host_images, mb->images, sizeof(float) * (size_t)mb->n * in.h * in.w * 3);
    memcpy(t->host_labels, mb->labels, sizeof(int32_t) * (size_t)mb->n * t->per_image);
}

// Queues the staged micro-batch's upload into the net's input (cast to the
// storage type) and the labels buffer.
static void upload_staged(Trainer *t, int n) {
    Ops *o = t->o;
    Net *net = &t->net;
    const Shape in = t->g.tensors[t->g.input].shape;
    const size_t floats = (size_t)n * in.h * in.w * 3;
    if (net->dtype == DT_F32) {
        o->upload_async(o, net->act[t->g.input], t->host_images, sizeof(float) * floats);
    } else {
        const Shape images = shape4(n, in.h, in.w, 3);
        o->upload_async(o, t->stage, t->host_images, sizeof(float) * floats);
        o->copy(o, tensor(net->act[t->g.input], images, net->dtype), tensor_f32(t->stage, images),
                0);
    }
    o->upload_async(o, t->labels, t->host_labels, sizeof(int32_t) * (size_t)n * t->per_image);
}

// Region terms with replicas exchange values every batch, a collective every
// replica joins, an empty shard too: over the global batch, the sums before the
// gradient (score_batch); per image, the value after it (region_value).
static int region_exchanges(const Trainer *t) {
    return t->comm->size > 1 && loss_group_name(&t->loss);
}

// The loss and metrics of the n images in the net: the terms of the loss menu
// (their gradient into dlogits when that has data, the per-pixel ones scaled by
// state->xent_scale, the region ones by the loss scale) added into state->loss
// and state->region_loss, and the confusion matrix. Per image, a region term
// is the mean over the step's `step_images` (all micro-batches and replicas).
// Returns -1 if a collective failed.
static int score_batch(Trainer *t, Tensor dlogits, int n, int step_images) {
    Ops *o = t->o;
    const LossCfg *l = &t->loss;
    const int K = t->K, groups = l->per_image ? n : 1;
    const float *scale = dlogits.data ? &t->state->xent_scale : NULL;
    Tensor z = net_tensor(&t->net, t->logits);
    int summed = t->region_presummed;  // the region sums are in t->region_sums
    for (int j = 0; j < l->n && n > 0; j++) {
        const float *w = t->class_weights + (size_t)j * K;
        if (j == 0 && l->kind[0] != LOSS_CE && dlogits.data) o->fill(o, dlogits, 0.0f);
        if (l->kind[j] == LOSS_CE) {  // first when there (parse_loss): it overwrites dlogits
            o->softmax_xent(o, z, t->labels, w, t->c->loss_norm_keras ? KERAS_EPSILON : 0.0f, scale,
                            t->state->loss, dlogits);
        } else if (l->kind[j] == LOSS_FOCAL) {
            o->softmax_focal(o, z, t->labels, w, l->focal_gamma, KERAS_EPSILON, scale,
                             t->state->loss, dlogits);
        } else if (l->kind[j] == LOSS_LOVASZ) {
            o->lovasz(o, z, t->labels, groups,
                      l->weight[j] / (float)(l->per_image ? step_images : 1), w,
                      &t->state->loss_scale, t->lovasz_ws, &t->state->region_loss, dlogits);
        } else {
            if (!summed) o->region_sums(o, z, t->labels, groups, t->region_sums, t->region_rows);
            if (!summed && region_exchanges(t) && !l->per_image &&
                comm_allreduce_backend(t, t->region_sums, (size_t)3 * K))
                return -1;
            summed = 1;
            const RegionArgs a = region_args(l, j, l->per_image ? step_images : 1);
            // presummed: every micro-batch has the step's value; the first one reports it
            float *value = t->region_presummed == 2 ? t->region_coefs + 2 * K * groups
                                                    : &t->state->region_loss;
            o->region_grad(o, z, t->labels, groups, t->region_sums, &a, w, &t->state->loss_scale,
                           t->region_coefs, value, dlogits);
        }
    }
    if (t->region_presummed && n > 0) t->region_presummed = 2;
    // an empty shard adds zeros to the sums (unless region_presum summed them)
    if (n == 0 && region_exchanges(t) && !l->per_image && !t->region_presummed) {
        o->fill(o, tensor_f32(t->region_sums, shape4(3 * K, 1, 1, 1)), 0.0f);
        if (comm_allreduce_backend(t, t->region_sums, (size_t)3 * K)) return -1;
    }
    if (n > 0) o->confusion_accumulate(o, z, t->labels, t->confusion);
    if (n > 0 && t->c->iou_per_image)
        o->iou_per_image(o, z, t->labels, t->class_weights + (size_t)l->n * K,
                         t->confusion + (size_t)K * K);
    return 0;
}

// A step's region value *v from this replica's part (the replicas' parts summed
// when each holds its images' share); -1 if a collective failed.
static int region_value(Trainer *t, float part, double *v) {
    *v = part;
    return t->loss.per_image && t->comm->size > 1 && t->comm->allreduce_f64(t->comm, v, 1);
}

// An evaluation batch of the global batch's `images`: the forward, its loss Σ w·nll
// plus the region terms' value times the batch's Σ w here (norm), so that the pass's
// Σ over Σ norm weighs each batch's region value by its Σ w, into *loss; metrics
// into the confusion matrix. Returns -1 if a collective failed.
static int eval_batch(Trainer *t, const MicroBatch *mb, int images, double norm, double *loss) {
    Ops *o = t->o;
    Net *net = &t->net;
    stage_batch(t, mb);
    if (mb->n) upload_staged(t, mb->n);
    net_forward(net, mb->n, 0);
    o->fill(o, tensor_f32(t->state->loss, shape4(4, 1, 1, 1)), 0.0f);  // loss[3], region_loss
    if (score_batch(t, tensor(NULL, net_tensor(net, t->logits).shape, net->dtype), mb->n, images))
        return -1;
    float sums[4];
    o->download(o, sums, t->state->loss, sizeof sums);
    snCheck(sums[2] == 0.0f, "labels outside 0..%d passed the data set's checks", t->K - 1);
    double region;
    if (region_value(t, sums[3], &region)) return -1;
    *loss = sums[0] + region * norm;
    return 0;
}

// A region term over the global batch of k > 1 micro-batches needs all their
// probabilities before the first backward: a forward of each (the same
// dropout masks and batch statistics, BN's running statistics left alone)
// adds its sums, the replicas add theirs, and score_batch takes them
// (region_presummed). The cost: one more forward per micro-batch. Micro-batch 0
// is staged again for the step. Returns -1 if a collective failed.
static int region_presum(Trainer *t, const MicroBatch *mb, int k) {
    const LossCfg *l = &t->loss;
    if (k == 1 || l->per_image || !t->region_sums) return 0;
    Ops *o = t->o;
    Net *net = &t->net;
    const Shape sums = shape4(3 * t->K, 1, 1, 1);
    float *part = t->region_sums + 3 * t->K;  // a micro-batch's, beside the total
    o->fill(o, tensor_f32(t->region_sums, sums), 0.0f);
    net->keep_running = 1;
    for (int i = 0; i < k; i++) {
        if (i > 0) {
            o->synchronize(o);
            stage_batch(t, &mb[i]);
        }
        if (mb[i].n) upload_staged(t, mb[i].n);
        net->first_sample = (uint64_t)mb[i].first;
        net_forward(net, mb[i].n, 1);
        if (net->failed) break;
        if (!mb[i].n) continue;
        o->region_sums(o, net_tensor(net, t->logits), t->labels, 1, part, t->region_rows);
        o->axpby(o, tensor_f32(t->region_sums, sums), tensor_f32(part, sums), 1.0f, 0.0f, 1);
    }
    net->keep_running = 0;
    if (net->failed || comm_allreduce_backend(t, t->region_sums, (size_t)3 * t->K)) return -1;
    o->synchronize(o);
    stage_batch(t, &mb[0]);
    t->region_presummed = 1;
    return 0;
}
