// curves.c -- training curves: curves.svg from metrics.csv's figures.
// Plumbing of the segnet program: segnet.c (the math, the models, the step)
// includes this file at its end, so that the program is one translation unit.

// ----------------------------------------------------------------------------
// training curves (curves.svg)
//
// Four panels in a 2×2 grid against the epoch: loss (train, val), the metric
// (train, val), the gradient norm (mean, max; the clipping threshold as a
// line; a cross at epochs with skipped steps; the loss scale on a right axis)
// and the learning rate (the update ratio on a right axis). A series is its
// finite values joined in row order (a missing validation epoch is bridged),
// with a marker on each value, so a single epoch shows as points. y axes start
// at 0 and end at a "nice" number above the largest value; the metric's axis
// spans at least 0..1. The loss and the gradient norm go on a log axis when
// their values are all positive and span more than 10× (a first epoch's
// spike): a linear one would press the other epochs into a few pixels at its
// bottom, and clipping the axis at a quantile would hide the spike's size,
// where a log axis shows both and the ratios that matter for these two. The
// best epoch is a dotted vertical line in each panel. Text boxes do not
// overlap: the plot's left edge moves right of the widest tick label, and
// the "best" label turns inward at the plot's edges.

#define SVG_PANEL_W 480
#define SVG_PANEL_H 360
#define SVG_LEFT 70     // plot area inside a panel: x in [LEFT, PANEL_W - RIGHT],
#define SVG_RIGHT 20    // y in [TOP, PANEL_H - BOTTOM]; RIGHT_AXIS instead of
#define SVG_RIGHT_AXIS 70  // RIGHT when the panel has a second axis
#define SVG_TOP 40
#define SVG_BOTTOM 50
// a character's width at the font size 12, at most: DejaVu Sans (Linux's usual sans-serif)
// draws digits 0.636 em wide, 7.6 px
#define SVG_CHAR_W 7.7

typedef struct { size_t offset; const char *name, *colour, *dash; } SvgSeries;
typedef struct {
    const char *title;
    const SvgSeries *left;   // 2 series on the left axis (name NULL: absent)
    const SvgSeries *right;  // NULL, or 1 series on a right axis of its own
    double y_min_top;        // the left axis reaches at least this
    double hline;            // > 0: a horizontal line at this left-axis value, named hline_name
    const char *hline_name;
    int mark_skipped;        // a red cross at the bottom of the epochs with skipped steps
    int log_ok;              // the left axis may be logarithmic (see above)
} SvgPanel;

static double record_value(const EpochRecord *r, size_t offset) {
    return *(const double *)((const char *)r + offset);
}

// a step of 1, 2 or 5 × 10^k near (hi - lo)/5 (computed so that it stays finite near ±DBL_MAX)
static double nice_step(double lo, double hi) {
    double raw = hi / 5 - lo / 5, mag = pow(10, floor(log10(raw))), f = raw / mag;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag;
}

// text with &, <, > and " escaped
static void svg_text(FILE *f, const char *s) {
    for (; *s; s++) {
        if (*s == '&') fputs("&amp;", f);
        else if (*s == '<') fputs("&lt;", f);
        else if (*s == '>') fputs("&gt;", f);
        else if (*s == '"') fputs("&quot;", f);
        else fputc(*s, f);
    }
}

// An axis 0..max(values, top) (or from a negative minimum), rounded out to a nice step;
// with log_ok, values all positive and spanning more than 10×: a log axis from the
// largest 1, 2 or 5 × 10^k at most their minimum to the smallest at least their maximum
#define SVG_TICKS_MAX 32
typedef struct { double lo, hi, step; int ticks, log; double tick[SVG_TICKS_MAX]; } SvgAxis;
static SvgAxis svg_axis(const EpochRecord *rows, int n, const SvgSeries *s, int n_series,
                        double top, int *present, int log_ok) {
    SvgAxis a = {0, top, 0, 0, 0, {0}};
    double pmin = top > 0 ? top : INFINITY;  // the smallest value, where all are positive
    for (int k = 0; k < n_series; k++) {
        present[k] = 0;
        for (int i = 0; s[k].name && i < n; i++) {
            double v = record_value(&rows[i], s[k].offset);
            if (!isfinite(v)) continue;
            present[k]++;
            a.lo = fmin(a.lo, v); a.hi = fmax(a.hi, v);
            pmin = v > 0 ? fmin(pmin, v) : -INFINITY;
        }
    }
    if (log_ok && pmin > 0 && a.hi / pmin > 10 && a.hi < 1e300) {  // 10^(k1) stays finite
        static const double M[3] = {1, 2, 5};
        const int k0 = (int)floor(log10(pmin)), k1 = (int)ceil(log10(a.hi));
        a.log = 1;
        a.lo = pow(10, k0);
        a.hi = pow(10, k1);
        for (int j = 2; j >= 0; j--)
            if (M[j] * pow(10, k0) <= pmin) { a.lo = M[j] * pow(10, k0); break; }
        for (int j = 0; j < 3; j++)
            if (M[j] * pow(10, k1 - 1) >= a.hi / 1.0000001) {
                a.hi = M[j] * pow(10, k1 - 1);
                break;
            }
        // ticks: 1, 2, 5 × 10^k over at most 2 decades, else every d-th power of 10
        const int decades = k1 - k0, d = (decades + 5) / 6;
        for (int k = k0; k <= k1 && a.ticks < SVG_TICKS_MAX; k++)
            for (int j = 0; j < 3 && a.ticks < SVG_TICKS_MAX; j++) {
                const double v = M[j] * pow(10, k);
                if ((decades > 2 && (j || (k - k0) % d)) || v < a.lo / 1.0000001 ||
                    v > a.hi * 1.0000001)
                    continue;
                a.tick[a.ticks++] = v;
            }
        return a;
    }
    if (a.hi == a.lo) a.hi = a.lo + 1;  // all values 0
    a.step = nice_step(a.lo, a.hi);
    double lo = floor(a.lo / a.step) * a.step, hi = ceil(a.hi / a.step) * a.step;
    if (isfinite(lo)) a.lo = lo;
    if (isfinite(hi)) a.hi = hi;
    const int ticks = (int)floor(a.hi / a.step - a.lo / a.step + 1e-9);
    for (int i = 0; i <= ticks && a.ticks < SVG_TICKS_MAX; i++)
        a.tick[a.ticks++] = 2 * (a.lo / 2 + i * (a.step / 2));
    return a;
}

// the y of value v on axis a between the plot's bottom B and top T (halves: finite near
// ±DBL_MAX; on a log axis a value at most 0 sits at the bottom)
static double svg_y(const SvgAxis *a, double v, double T, double B) {
    if (a->log) {
        const double l = v > 0 ? log10(v) : log10(a->lo);
        return B - (l - log10(a->lo)) / (log10(a->hi) - log10(a->lo)) * (B - T);
    }
    return B - (v / 2 - a->lo / 2) / (a->hi / 2 - a->lo / 2) * (B - T);
}

static void svg_panel(FILE *f, int x0, int y0, const SvgPanel *p, const EpochRecord *rows, int n,
                      int best_epoch) {
    const double R = x0 + SVG_PANEL_W - (p->right ? SVG_RIGHT_AXIS : SVG_RIGHT);
    const double T = y0 + SVG_TOP, B = y0 + SVG_PANEL_H - SVG_BOTTOM;
    // x: the epochs, ±½ around a single one
    double ex0 = rows[0].epoch, ex1 = rows[0].epoch;
    for (int i = 0; i < n; i++) { ex0 = fmin(ex0, rows[i].epoch); ex1 = fmax(ex1, rows[i].epoch); }
    if (ex1 == ex0) { ex0 -= 0.5; ex1 += 0.5; }
    const double xstep = fmax(1, round(nice_step(ex0, ex1)));
    int present[3];
    SvgAxis ya = svg_axis(rows, n, p->left, 2, fmax(p->y_min_top, p->hline), present, p->log_ok),
            yr = {0, 1, 1, 0, 0, {0}};
    if (p->right) yr = svg_axis(rows, n, p->right, 1, 0, present + 2, 0);
    else present[2] = 0;
    // the left edge: right of the axis title (x0 + 18, 12 px high rotated: to x0 + 21) and
    // of the widest tick label (ending 6 px left of the edge), 4 px apart
    char label[SVG_TICKS_MAX][32];
    double widest = 0;
    for (int i = 0; i < ya.ticks; i++) {
        snprintf(label[i], sizeof label[i], "%.3g", ya.tick[i]);
        widest = fmax(widest, SVG_CHAR_W * strlen(label[i]));
    }
    const double L = x0 + fmax(SVG_LEFT, 21 + 4 + widest + 6);
#define SVG_X(e) (L + ((e) - ex0) / (ex1 - ex0) * (R - L))
#define SVG_Y(a, v) svg_y(&(a), v, T, B)

    fprintf(f,
            "<g>\n<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" font-size=\"15\" "
            "font-weight=\"bold\">",
            (L + R) / 2, y0 + 22.0);
    svg_text(f, p->title);
    fputs("</text>\n", f);
    for (int i = 0; i < ya.ticks; i++) {  // y ticks and grid
        double y = SVG_Y(ya, ya.tick[i]);
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n",
                L, y, R, y, L - 6, y + 4, label[i]);
    }
    for (int i = 0; p->right && i < yr.ticks; i++) {  // the right axis' ticks
        double v = yr.tick[i], y = SVG_Y(yr, v);
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333\"/>"
                "<text x=\"%.1f\" y=\"%.1f\" fill=\"%s\">%.6g</text>\n",
                R, y, R + 5, y, R + 8, y + 4, p->right->colour, v);
    }
    for (double e = ceil(ex0 / xstep) * xstep; e <= ex1; e += xstep)  // x ticks
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333\"/>"
                "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.0f</text>\n",
                SVG_X(e), B, SVG_X(e), B + 5, SVG_X(e), B + 19, e);
    fprintf(f,
            "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
            "stroke=\"#333\"/>\n",
            L, T, R - L, B - T);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">epoch</text>\n", (L + R) / 2,
            B + 40.0);
    fprintf(f,
            "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" transform=\"rotate(-90 %.1f "
            "%.1f)\">",
            x0 + 18.0, (T + B) / 2, x0 + 18.0, (T + B) / 2);
    svg_text(f, p->title);
    fputs("</text>\n", f);
    if (best_epoch >= ex0 && best_epoch <= ex1) {
        // within half the label's width of an edge it turns inward, off the corner's ticks
        const double bx = SVG_X(best_epoch), half = 2 * SVG_CHAR_W;
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#2ca02c\" "
                "stroke-dasharray=\"2 3\"/>"
                "<text x=\"%.1f\" y=\"%.1f\" fill=\"#2ca02c\" text-anchor=\"%s\">best</text>\n",
                bx, T, bx, B, bx, T - 4,
                bx - L < half ? "start" : R - bx < half ? "end" : "middle");
    }
    if (p->hline > 0)
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#d62728\" "
                "stroke-dasharray=\"8 3\"/>\n",
                L, SVG_Y(ya, p->hline), R, SVG_Y(ya, p->hline));
    // the series: left ones, then the right one against its own axis
    const SvgSeries *all[3] = {&p->left[0], &p->left[1], p->right};
    const SvgAxis *axis[3] = {&ya, &ya, &yr};
    for (int k = 0; k < 3; k++) {
        if (!present[k]) continue;
        fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\"%s points=\"",
                all[k]->colour, all[k]->dash);
        for (int i = 0; i < n; i++) {
            double v = record_value(&rows[i], all[k]->offset);
            if (isfinite(v)) fprintf(f, "%.1f,%.1f ", SVG_X(rows[i].epoch), SVG_Y(*axis[k], v));
        }
        fputs("\"/>\n", f);
        for (int i = 0; i < n; i++) {
            double v = record_value(&rows[i], all[k]->offset);
            if (isfinite(v))
                fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>\n",
                        SVG_X(rows[i].epoch), SVG_Y(*axis[k], v), all[k]->colour);
        }
    }
    // a cross at the bottom of each epoch with skipped steps
    for (int i = 0; p->mark_skipped && i < n; i++) {
        if (!(rows[i].skipped_steps > 0)) continue;
        double x = SVG_X(rows[i].epoch);
        fprintf(f, "<path d=\"M%.1f %.1fl8 8m0 -8l-8 8\" stroke=\"#d62728\" stroke-width=\"2\"/>\n",
                x - 4, B - 14);
    }
    // the legend goes top right, or bottom right when more of the values in the panel's right
    // half lie in its upper half (curves that end high: accuracy, IoU)
    const char *names[5];
    const char *colours[5], *dashes[5];
    int n_legend = 0, upper = 0, lower = 0;
    for (int k = 0; k < 3; k++) {
        if (!present[k]) continue;
        names[n_legend] = all[k]->name;
        colours[n_legend] = all[k]->colour;
        dashes[n_legend++] = all[k]->dash;
        for (int i = 0; i < n; i++) {
            double v = record_value(&rows[i], all[k]->offset);
            if (!isfinite(v) || SVG_X(rows[i].epoch) < (L + R) / 2) continue;
            if (SVG_Y(*axis[k], v) < (T + B) / 2) upper++;
            else lower++;
        }
    }
    const int bottom = upper > lower;
    if (p->hline > 0) {
        names[n_legend] = p->hline_name;
        colours[n_legend] = "#d62728";
        dashes[n_legend++] = " stroke-dasharray=\"8 3\"";
    }
    int any_skipped = 0;
    for (int i = 0; p->mark_skipped && i < n; i++) any_skipped |= rows[i].skipped_steps > 0;
    const int lines = n_legend + any_skipped;
    if (lines) {  // on a white ground, over what it covers
        const double top = bottom ? B - 12 - 18 * (lines - 1) : T + 14;
        fprintf(f,
                "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"white\" "
                "fill-opacity=\"0.85\"/>\n",
                R - 116, top - 11, 112.0, 18.0 * lines + 4);
    }
    for (int k = 0; k < lines; k++) {
        double ly = bottom ? B - 12 - 18 * (lines - 1 - k) : T + 14 + 18 * k;
        if (k < n_legend)
            fprintf(f,
                    "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                    "stroke-width=\"2\"%s/>",
                    R - 110, ly, R - 86, ly, colours[k], dashes[k]);
        else
            fprintf(f,
                    "<path d=\"M%.1f %.1fl8 8m0 -8l-8 8\" stroke=\"#d62728\" stroke-width=\"2\"/>",
                    R - 102, ly - 4);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\">", R - 80, ly + 4);
        svg_text(f, k < n_legend ? names[k] : "skipped steps");
        fputs("</text>\n", f);
    }
    if (!present[0] && !present[1])
        fprintf(f,
                "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" fill=\"#888\">no "
                "values</text>\n",
                (L + R) / 2, (T + B) / 2);
    fputs("</g>\n", f);
#undef SVG_X
#undef SVG_Y
}

int write_curves_svg(const char *path, const EpochRecord *rows, int n, const char *metric_name,
                     const CurveMarks *marks, char err[SN_ERR_MAX]) {
    snCheck(rows != NULL && n >= 1 && metric_name != NULL, "write_curves_svg: no rows");
    static const char *VAL_DASH = " stroke-dasharray=\"6 4\"";
    const SvgSeries loss[2] = {{offsetof(EpochRecord, loss), "train", "#1f77b4", ""},
                               {offsetof(EpochRecord, val_loss), "val", "#ff7f0e", VAL_DASH}};
    const SvgSeries metric[2] = {{offsetof(EpochRecord, metric), "train", "#1f77b4", ""},
                                 {offsetof(EpochRecord, val_metric), "val", "#ff7f0e", VAL_DASH}};
    const SvgSeries norm[2] = {{offsetof(EpochRecord, grad_norm_mean), "mean", "#1f77b4", ""},
                               {offsetof(EpochRecord, grad_norm_max), "max", "#9467bd", VAL_DASH}};
    const SvgSeries scale = {offsetof(EpochRecord, loss_scale), "loss scale", "#8c564b",
                             " stroke-dasharray=\"2 2\""};
    const SvgSeries lr[2] = {{offsetof(EpochRecord, lr), "lr", "#1f77b4", ""},
                             {0, NULL, NULL, NULL}};
    const SvgSeries ratio = {offsetof(EpochRecord, update_ratio), "update ratio", "#8c564b",
                             " stroke-dasharray=\"2 2\""};
    int fp16 = 0;  // the loss scale is drawn when it is not 1 throughout
    for (int i = 0; i < n; i++) fp16 |= isfinite(rows[i].loss_scale) && rows[i].loss_scale != 1.0;
    const SvgPanel panels[4] = {
            {"loss", loss, NULL, 0, 0, NULL, 0, 1},
            {metric_name, metric, NULL, 1, 0, NULL, 0, 0},
            {"gradient norm", norm, fp16 ? &scale : NULL, 0, marks ? marks->clipnorm : 0,
             "clipnorm", 1, 1},
            {"learning rate", lr, &ratio, 0, 0, NULL, 0, 0},
    };
    char tmp[OUT_PATH_MAX];
    FILE *f = atomic_file_open(path, tmp, err);
    if (!f) return -1;
    fprintf(f,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d "
            "%d\" "
            "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" "
            "fill=\"white\"/>\n",
            2 * SVG_PANEL_W, 2 * SVG_PANEL_H, 2 * SVG_PANEL_W, 2 * SVG_PANEL_H);
    for (int k = 0; k < 4; k++)
        svg_panel(f, (k % 2) * SVG_PANEL_W, (k / 2) * SVG_PANEL_H, &panels[k], rows, n,
                  marks ? marks->best_epoch : 0);
    fputs("</svg>\n", f);
    return atomic_file_commit(f, tmp, path, 1, err);
}
