/* feedline.producer.image._jpegturbo: decode a region of a JPEG at a DCT scale of M/8, over
 * libjpeg-turbo's jpeglib.h (jpeg_skip_scanlines, jpeg_crop_scanline, scale_num/scale_denom).
 *
 * The functions take any contiguous buffer (bytes, a uint8 numpy array):
 *
 *   header(data) -> (height, width, components, progressive)
 *   decode(data, scale, y0, x0, rows, cols, bgr, max_pixels, max_scans)
 *       -> (pixels: bytearray, x_start, width, image_height, image_width)
 *   index_info(data), synthetic(data, r0, r1, c0, c1): MCU-indexed files (_mcuindex.c)
 *   prepare(data, optimize, max_pixels): _prepare.c; resample(...): _resample.c
 *
 * decode() scales the image by scale/8 (1..8) in the IDCT, then returns the rows
 * [y0, y0 + rows) of the scaled image, with columns [x_start, x_start + width) where
 * x_start <= x0 and x_start + width >= x0 + cols. pixels holds rows x width x 3 bytes, BGR or
 * RGB. An ordinary file: libjpeg-turbo skips the rows above (entropy-decoding them), widens
 * the crop to the left up to an iMCU boundary (x_start + width == x0 + cols) and stops below
 * it. A file with an MCU index (prepared, _prepare.c): libjpeg decodes a synthetic JPEG of
 * only the MCUs under the region and one pixel around it (_mcuindex.c), all its columns:
 * every pixel of the region is the full decode's.
 *
 * Errors: Unsupported (this decoder cannot, another may: CMYK/YCCK, 12-bit, lossless,
 * arithmetic coding the library was built without) and CorruptJPEG (the data is bad, or
 * over a limit, or an MCU index does not fit its file). Warnings that mean the pixels are
 * missing or garbage (premature end of data, bad Huffman/arithmetic code, a marker in the
 * middle of entropy-coded data) are errors; cosmetic warnings (extraneous bytes between
 * markers, unknown JFIF revision) are not. Limits: the image's declared width x height <=
 * max_pixels (checked before anything is allocated for it), libjpeg's own buffers <= 16
 * bytes per allowed pixel + 16 MiB, at most max_scans scans (a progressive file of many tiny
 * scans costs CPU per scan). The GIL is released while libjpeg runs.
 */
#include "_jt.h"

#include <string.h>

#include <jerror.h>

#include "_jpgidx.h"
#include "_mcuindex.h"

#define STR_(x) #x
#define STR(x) STR_(x)

PyObject *jt_CorruptJPEG;
PyObject *jt_Unsupported;
PyObject *jt_BadIndex;

typedef struct {
    struct jpeg_progress_mgr pub;
    int max_scans;
} ScanLimit;

static void fail(j_common_ptr cinfo) {
    jt_error *err = (jt_error *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    switch (cinfo->err->msg_code) {
    case JERR_BAD_PRECISION:      /* 12- or 16-bit samples: OpenCV's build may have them */
    case JERR_SOF_UNSUPPORTED:    /* lossless, hierarchical */
    case JERR_CONVERSION_NOTIMPL: /* a colour space we do not convert */
    case JERR_NOT_COMPILED:       /* e.g. arithmetic decoding left out of the library */
        err->unsupported = 1;
        break;
    default:
        break;
    }
    longjmp(err->jump, 1);
}

static void warn(j_common_ptr cinfo, int level) {
    if (level >= 0) /* trace messages */
        return;
    switch (cinfo->err->msg_code) {
    case JWRN_JPEG_EOF:       /* truncated: libjpeg would fill the rest with grey */
    case JWRN_HUFF_BAD_CODE:  /* corrupt entropy-coded data */
    case JWRN_ARITH_BAD_CODE:
    case JWRN_HIT_MARKER:     /* a marker where entropy-coded data should be */
    case JWRN_MUST_RESYNC:    /* a restart marker out of sequence */
        fail(cinfo);
        return;
    default:
        cinfo->err->num_warnings++;
    }
}

struct jpeg_error_mgr *jt_error_init(jt_error *err) {
    memset(err, 0, sizeof *err);
    jpeg_std_error(&err->pub);
    err->pub.error_exit = fail;
    err->pub.emit_message = warn;
    return &err->pub;
}

static void check_scans(j_common_ptr cinfo) {
    ScanLimit *lim = (ScanLimit *)cinfo->progress;
    j_decompress_ptr d = (j_decompress_ptr)cinfo;
    if (d->input_scan_number > lim->max_scans) {
        jt_error *err = (jt_error *)cinfo->err;
        snprintf(err->message, sizeof err->message,
                 "more than %d scans (a progressive JPEG this fragmented is refused)",
                 lim->max_scans);
        longjmp(err->jump, 1);
    }
}

PyObject *jt_raise(const jt_error *err) {
    PyErr_SetString(err->unsupported ? jt_Unsupported : jt_CorruptJPEG, err->message);
    return NULL;
}

static PyObject *header(PyObject *self, PyObject *args) {
    Py_buffer view;
    struct jpeg_decompress_struct cinfo;
    jt_error err;
    int ok;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*:header", &view))
        return NULL;
    if (view.len <= 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(jt_CorruptJPEG, "empty data");
        return NULL;
    }
    memset(&cinfo, 0, sizeof cinfo);
    cinfo.err = jt_error_init(&err);
    Py_BEGIN_ALLOW_THREADS
    if (setjmp(err.jump)) {
        ok = 0;
    } else {
        jpeg_create_decompress(&cinfo);
        jpeg_mem_src(&cinfo, (const unsigned char *)view.buf, (unsigned long)view.len);
        jpeg_read_header(&cinfo, TRUE);
        ok = 1;
    }
    Py_END_ALLOW_THREADS
    jpeg_destroy_decompress(&cinfo);
    PyBuffer_Release(&view);
    if (!ok)
        return jt_raise(&err);
    return Py_BuildValue("(IIiO)", cinfo.image_height, cinfo.image_width, cinfo.num_components,
                         cinfo.progressive_mode ? Py_True : Py_False);
}

/* What decode() was asked for, and what it found. */
typedef struct {
    int scale, bgr, max_scans;
    unsigned y0, x0, rows, cols;
    unsigned long long max_pixels;
    JDIMENSION x_start, width, image_h, image_w;
} Request;

/* The MCUs [r0, r1) x [c0, c1) of a grid of mcu_w x mcu_h pixels that hold the request's
 * region, plus one scaled pixel each side (fancy upsampling reads one chroma sample past a
 * pixel: at a synthetic image's edges it would replicate instead), and at least two MCUs
 * each way where the image has them (libjpeg-turbo upsamples a component of 2 samples or
 * fewer without interpolation). Every pixel of the region then comes out of a JPEG of only
 * those MCUs as a full decode gives it. 0 with err set for a region outside the image. */
static int crop_mcus(const Request *q, unsigned width, unsigned height, unsigned mcu_w,
                     unsigned mcu_h, unsigned cols, unsigned rows, unsigned *r0, unsigned *r1,
                     unsigned *c0, unsigned *c1, jt_error *err) {
    unsigned smw = mcu_w * (unsigned)q->scale / 8, smh = mcu_h * (unsigned)q->scale / 8;
    unsigned sw = (unsigned)(((unsigned long long)width * q->scale + 7) / 8);
    unsigned sh = (unsigned)(((unsigned long long)height * q->scale + 7) / 8);
    unsigned xa, xb, ya, yb;
    if ((unsigned long long)width * height > q->max_pixels) {
        snprintf(err->message, sizeof err->message, "declares %ux%u pixels, over the limit "
                 "of %llu", width, height, q->max_pixels);
        return 0;
    }
    if ((unsigned long long)q->y0 + q->rows > sh || (unsigned long long)q->x0 + q->cols > sw) {
        snprintf(err->message, sizeof err->message, "region %ux%u at (%u, %u) is outside the "
                 "%ux%u image at scale %d/8", q->cols, q->rows, q->x0, q->y0, sw, sh, q->scale);
        return 0;
    }
    xa = q->x0 > 0 ? q->x0 - 1 : 0;
    ya = q->y0 > 0 ? q->y0 - 1 : 0;
    xb = q->x0 + q->cols < sw ? q->x0 + q->cols + 1 : sw;
    yb = q->y0 + q->rows < sh ? q->y0 + q->rows + 1 : sh;
    *c0 = xa / smw;
    *c1 = (xb + smw - 1) / smw;
    *r0 = ya / smh;
    *r1 = (yb + smh - 1) / smh;
    if (*c1 - *c0 < 2 && cols >= 2) {
        if (*c1 < cols)
            (*c1)++;
        else
            (*c0)--;
    }
    if (*r1 - *r0 < 2 && rows >= 2) {
        if (*r1 < rows)
            (*r1)++;
        else
            (*r0)--;
    }
    return 1;
}

/* For a prepared file (MCU index): the JPEG of the MCUs crop_mcus() picks. The request is
 * moved to the synthetic image's coordinates (all its columns); *syn is malloc'd
 * (PyMem_Raw). */
static int synthetic(const unsigned char *data, const mi_layout *lay, Request *q,
                     unsigned char **syn, size_t *syn_len, jt_error *err) {
    unsigned smw = lay->mcu_w * (unsigned)q->scale / 8, smh = lay->mcu_h * (unsigned)q->scale / 8;
    unsigned c0, c1, r0, r1;
    char msg[MI_ERRLEN];
    size_t cap;
    if (!crop_mcus(q, lay->width, lay->height, lay->mcu_w, lay->mcu_h, lay->cols, lay->rows,
                   &r0, &r1, &c0, &c1, err))
        return 0;
    cap = mi_synthetic_bound(lay);
    *syn = PyMem_RawMalloc(cap);
    if (*syn == NULL) {
        snprintf(err->message, sizeof err->message, "no memory for %zu bytes", cap);
        return 0;
    }
    *syn_len = mi_synthetic(data, lay, r0, r1, c0, c1, *syn, cap, msg);
    if (*syn_len == 0) {
        snprintf(err->message, sizeof err->message, "MCU index: %s", msg);
        return 0;
    }
    q->image_h = lay->height;
    q->image_w = lay->width;
    q->y0 -= r0 * smh;
    q->x_start = c0 * smw; /* where the synthetic image's columns start */
    q->x0 = 0;
    q->cols = ((c1 * lay->mcu_w < lay->width ? c1 * lay->mcu_w : lay->width) - c0 * lay->mcu_w) *
              (unsigned)q->scale;
    q->cols = (q->cols + 7) / 8;
    return 1;
}

/* For a file with a side index (_jpgidx.c): the JPEG of the MCUs crop_mcus() picks, its
 * columns widened to index entries. The request is moved to the synthetic image's
 * coordinates; q->x_start is where they start (decode() then crops its columns as it does
 * an ordinary file's: the entries' extra MCUs are entropy-decoded, not transformed). */
static int side_synthetic(const ji_index *ix, Request *q, unsigned char **syn,
                          size_t *syn_len, jt_error *err) {
    unsigned smw = ix->mcu_w * (unsigned)q->scale / 8, smh = ix->mcu_h * (unsigned)q->scale / 8;
    unsigned c0, c1, r0, r1;
    char msg[JI_ERRLEN];
    size_t cap;
    if (!crop_mcus(q, ix->width, ix->height, ix->mcu_w, ix->mcu_h, ix->cols, ix->rows, &r0,
                   &r1, &c0, &c1, err))
        return 0;
    c0 -= c0 % ix->step;
    c1 = c1 % ix->step ? c1 + ix->step - c1 % ix->step : c1;
    c1 = c1 < ix->cols ? c1 : ix->cols;
    cap = ji_synthetic_bound(ix);
    *syn = PyMem_RawMalloc(cap);
    if (*syn == NULL) {
        snprintf(err->message, sizeof err->message, "no memory for %zu bytes", cap);
        return 0;
    }
    *syn_len = ji_synthetic(ix, r0, r1, c0, c1, *syn, cap, msg);
    if (*syn_len == 0) {
        snprintf(err->message, sizeof err->message, "%s", msg);
        return 0;
    }
    q->image_h = ix->height;
    q->image_w = ix->width;
    q->y0 -= r0 * smh;
    q->x_start = c0 * smw;
    q->x0 -= c0 * smw;
    return 1;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer view;
    Request q;
    struct jpeg_decompress_struct cinfo;
    jt_error err;
    ScanLimit lim;
    mi_layout lay;
    ji_index ix;
    char msg[MI_ERRLEN];
    int indexed;
    volatile int side = 0;
    const unsigned char *src;
    PyObject *index = Py_None;
    Py_buffer iview;
    size_t src_len;
    unsigned char *volatile syn = NULL;
    size_t syn_len = 0;
    PyObject *volatile out = NULL;
    PyThreadState *volatile ts = NULL;
    (void)self;

    memset(&q, 0, sizeof q);
    memset(&ix, 0, sizeof ix);
    memset(&iview, 0, sizeof iview);
    if (!PyArg_ParseTuple(args, "y*iIIIIpKi|O:decode", &view, &q.scale, &q.y0, &q.x0, &q.rows,
                          &q.cols, &q.bgr, &q.max_pixels, &q.max_scans, &index))
        return NULL;
    if (index != Py_None && PyObject_GetBuffer(index, &iview, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    if (q.scale < 1 || q.scale > 8 || q.rows == 0 || q.cols == 0 || q.max_scans < 1 ||
        q.max_pixels > (1ULL << 32)) {
        PyBuffer_Release(&view);
        PyBuffer_Release(&iview);
        PyErr_SetString(PyExc_ValueError,
                        "scale must be 1..8, rows, cols and max_scans >= 1, max_pixels <= 2**32");
        return NULL;
    }
    if (view.len <= 0) {
        PyBuffer_Release(&view);
        PyBuffer_Release(&iview);
        PyErr_SetString(jt_CorruptJPEG, "empty data");
        return NULL;
    }
    memset(&cinfo, 0, sizeof cinfo);
    memset(&lim, 0, sizeof lim);
    cinfo.err = jt_error_init(&err);
    src = (const unsigned char *)view.buf;
    src_len = (size_t)view.len;

    ts = PyEval_SaveThread();
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&cinfo);
        PyMem_RawFree(syn);
        ji_free(&ix);
        PyEval_RestoreThread(ts);
        Py_XDECREF(out);
        PyBuffer_Release(&view);
        PyBuffer_Release(&iview);
        if (side && !err.unsupported) { /* the caller decodes again without the index */
            PyErr_Format(jt_BadIndex, "JPEG index: %s", err.message);
            return NULL;
        }
        return jt_raise(&err);
    }
    jpeg_create_decompress(&cinfo);
    indexed = mi_parse(src, src_len, &lay, msg);
    if (indexed == MI_BAD) {
        snprintf(err.message, sizeof err.message, "MCU index: %s", msg);
        longjmp(err.jump, 1);
    }
    if (indexed == MI_OK) {
        unsigned char *s = NULL;
        int ok = synthetic(src, &lay, &q, &s, &syn_len, &err);
        syn = s;
        if (!ok)
            longjmp(err.jump, 1);
        src = syn;
        src_len = syn_len;
    } else if (iview.buf != NULL) {
        /* A side index: checked whole against the file before anything is copied. Any
         * failure from here on is BadIndex, and the caller decodes the file without it. */
        unsigned char *s = NULL;
        int ok;
        char imsg[JI_ERRLEN];
        side = 1;
        if (ji_parse(src, src_len, (const unsigned char *)iview.buf, (size_t)iview.len, &ix,
                     imsg) != JI_OK) {
            snprintf(err.message, sizeof err.message, "%s", imsg);
            longjmp(err.jump, 1);
        }
        ok = side_synthetic(&ix, &q, &s, &syn_len, &err);
        syn = s;
        ji_free(&ix);
        if (!ok)
            longjmp(err.jump, 1);
        src = syn;
        src_len = syn_len;
    }
    lim.pub.progress_monitor = check_scans;
    lim.max_scans = q.max_scans;
    cinfo.progress = &lim.pub;
    jpeg_mem_src(&cinfo, src, (unsigned long)src_len);
    jpeg_read_header(&cinfo, TRUE);
    if (!indexed && !side) {
        q.image_h = cinfo.image_height;
        q.image_w = cinfo.image_width;
    }
    if ((unsigned long long)cinfo.image_height * cinfo.image_width > q.max_pixels) {
        snprintf(err.message, sizeof err.message,
                 "declares %ux%u pixels, over the limit of %llu", (unsigned)cinfo.image_width,
                 (unsigned)cinfo.image_height, q.max_pixels);
        longjmp(err.jump, 1);
    }
    if (cinfo.jpeg_color_space != JCS_YCbCr && cinfo.jpeg_color_space != JCS_GRAYSCALE &&
        cinfo.jpeg_color_space != JCS_RGB) {
        /* CMYK, YCCK (Adobe) or unknown: libjpeg has no conversion to RGB for these. */
        snprintf(err.message, sizeof err.message, "%s JPEG (%d components) is not decoded here",
                 cinfo.jpeg_color_space == JCS_CMYK   ? "a CMYK"
                 : cinfo.jpeg_color_space == JCS_YCCK ? "a YCCK"
                                                      : "an unknown colour space's",
                 cinfo.num_components);
        err.unsupported = 1;
        longjmp(err.jump, 1);
    }
    cinfo.mem->max_memory_to_use = JT_MAX_MEMORY(q.max_pixels);
    cinfo.out_color_space = q.bgr ? JCS_EXT_BGR : JCS_EXT_RGB;
    cinfo.scale_num = (unsigned int)q.scale;
    cinfo.scale_denom = 8;
    cinfo.dct_method = JDCT_ISLOW;     /* what OpenCV uses: same pixels at scale 8/8 */
    cinfo.do_fancy_upsampling = TRUE;
    jpeg_calc_output_dimensions(&cinfo);
    if ((unsigned long long)q.y0 + q.rows > cinfo.output_height ||
        (unsigned long long)q.x0 + q.cols > cinfo.output_width) {
        snprintf(err.message, sizeof err.message,
                 "region %ux%u at (%u, %u) is outside the %ux%u image at scale %d/8", q.cols,
                 q.rows, q.x0, q.y0, (unsigned)cinfo.output_width,
                 (unsigned)cinfo.output_height, q.scale);
        longjmp(err.jump, 1);
    }
    jpeg_start_decompress(&cinfo);
    if (!indexed) {
        JDIMENSION shift = q.x_start; /* a side index's synthetic image starts there */
        q.x_start = q.x0;
        q.width = q.cols;
        if (q.width < cinfo.output_width)
            jpeg_crop_scanline(&cinfo, &q.x_start, &q.width);
        q.x_start += shift;
    } else {
        q.width = cinfo.output_width; /* the synthetic image holds only what is needed */
    }

    /* The output buffer is a Python object: take the GIL back only to allocate it. */
    PyEval_RestoreThread(ts);
    out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)q.rows * q.width * 3);
    if (out == NULL) {
        jpeg_destroy_decompress(&cinfo);
        PyMem_RawFree(syn);
        PyBuffer_Release(&view);
        PyBuffer_Release(&iview);
        return NULL;
    }
    ts = PyEval_SaveThread();
    {
        JSAMPLE *base = (JSAMPLE *)PyByteArray_AS_STRING(out);
        size_t stride = (size_t)q.width * 3;
        if (q.y0 > 0 && jpeg_skip_scanlines(&cinfo, q.y0) != q.y0) {
            snprintf(err.message, sizeof err.message, "could not skip to row %u", q.y0);
            longjmp(err.jump, 1);
        }
        while (cinfo.output_scanline < q.y0 + q.rows) {
            JSAMPROW row = base + (size_t)(cinfo.output_scanline - q.y0) * stride;
            if (jpeg_read_scanlines(&cinfo, &row, 1) != 1) {
                snprintf(err.message, sizeof err.message, "no data for row %u",
                         (unsigned)cinfo.output_scanline);
                longjmp(err.jump, 1);
            }
        }
    }
    jpeg_destroy_decompress(&cinfo); /* the rows below the region are never decoded */
    PyMem_RawFree(syn);
    PyEval_RestoreThread(ts);
    PyBuffer_Release(&view);
    PyBuffer_Release(&iview);
    return Py_BuildValue("(NIIII)", out, (unsigned)q.x_start, (unsigned)q.width,
                         (unsigned)q.image_h, (unsigned)q.image_w);
}

/* index_info(data) -> None, or (mcu_cols, mcu_rows, mcu_width, mcu_height, scan_bytes) of
 * an MCU-indexed file; CorruptJPEG if its index does not fit it. */
static PyObject *index_info(PyObject *self, PyObject *args) {
    Py_buffer view;
    mi_layout lay;
    char msg[MI_ERRLEN];
    int found;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*:index_info", &view))
        return NULL;
    found = mi_parse((const unsigned char *)view.buf, (size_t)view.len, &lay, msg);
    PyBuffer_Release(&view);
    if (found == MI_BAD) {
        PyErr_Format(jt_CorruptJPEG, "MCU index: %s", msg);
        return NULL;
    }
    if (found == MI_NONE)
        Py_RETURN_NONE;
    return Py_BuildValue("(IIIIn)", lay.cols, lay.rows, lay.mcu_w, lay.mcu_h,
                         (Py_ssize_t)lay.scan_len);
}

/* synthetic(data, r0, r1, c0, c1) -> bytes: the JPEG of MCU rows [r0, r1) and columns
 * [c0, c1) of an indexed file, as decode() makes it (for tests and debugging). */
static PyObject *synthetic_py(PyObject *self, PyObject *args) {
    Py_buffer view;
    mi_layout lay;
    char msg[MI_ERRLEN];
    unsigned r0, r1, c0, c1;
    size_t cap, n = 0;
    unsigned char *buf;
    PyObject *res;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*IIII:synthetic", &view, &r0, &r1, &c0, &c1))
        return NULL;
    if (mi_parse((const unsigned char *)view.buf, (size_t)view.len, &lay, msg) != MI_OK) {
        PyBuffer_Release(&view);
        PyErr_SetString(jt_CorruptJPEG, "no MCU index");
        return NULL;
    }
    cap = mi_synthetic_bound(&lay);
    buf = PyMem_RawMalloc(cap);
    if (buf == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    n = mi_synthetic((const unsigned char *)view.buf, &lay, r0, r1, c0, c1, buf, cap, msg);
    PyBuffer_Release(&view);
    res = n ? PyBytes_FromStringAndSize((const char *)buf, (Py_ssize_t)n)
            : PyErr_Format(jt_CorruptJPEG, "MCU index: %s", msg);
    PyMem_RawFree(buf);
    return res;
}

/* index_build(data, step) -> (bytes, "") or (None, why not): the side index of a baseline
 * JPEG (_jpgidx.c); CorruptJPEG for data that does not decode. */
static PyObject *index_build(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned step = 4;
    unsigned char *out = NULL;
    size_t len = 0;
    char msg[JI_ERRLEN];
    int got;
    PyObject *res;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*|I:index_build", &view, &step))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    got = ji_build((const unsigned char *)view.buf, (size_t)view.len, step, &out, &len, msg);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (got == JI_BAD)
        return PyErr_Format(jt_CorruptJPEG, "%s", msg);
    if (got == JI_NOT_INDEXABLE)
        return Py_BuildValue("(Os)", Py_None, msg);
    res = PyBytes_FromStringAndSize((const char *)out, (Py_ssize_t)len);
    PyMem_RawFree(out);
    return res ? Py_BuildValue("(Ns)", res, "") : NULL;
}

/* index_check(data, index) -> (mcu_cols, mcu_rows, step, entries): BadIndex if the index
 * does not fit the file. */
static PyObject *index_check(PyObject *self, PyObject *args) {
    Py_buffer view, iview;
    ji_index ix;
    char msg[JI_ERRLEN];
    int got;
    PyObject *res;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*:index_check", &view, &iview))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    got = ji_parse((const unsigned char *)view.buf, (size_t)view.len,
                   (const unsigned char *)iview.buf, (size_t)iview.len, &ix, msg);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    PyBuffer_Release(&iview);
    if (got != JI_OK)
        return PyErr_Format(jt_BadIndex, "JPEG index: %s", msg);
    res = Py_BuildValue("(IIII)", ix.cols, ix.rows, ix.step, ix.per_row * ix.rows);
    ji_free(&ix);
    return res;
}

/* index_seal(index) -> bytes: the index with its seal (its last 8 bytes: the XXH64 of
 * the others) made right again, for tests and fuzzing that edit an index and must reach
 * the checks behind the seal. ValueError for fewer than 48 bytes. */
static PyObject *index_seal(PyObject *self, PyObject *args) {
    Py_buffer view;
    PyObject *res;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*:index_seal", &view))
        return NULL;
    if (view.len < 48) {
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_ValueError, "an index has at least 48 bytes, got %zd",
                            view.len);
    }
    res = PyBytes_FromStringAndSize((const char *)view.buf, view.len);
    PyBuffer_Release(&view);
    if (res != NULL)
        ji_seal((unsigned char *)PyBytes_AS_STRING(res), (size_t)PyBytes_GET_SIZE(res));
    return res;
}

/* synthetic_indexed(data, index, r0, r1, c0, c1) -> bytes: the JPEG decode() makes of a
 * rectangle of MCUs by a side index (for tests and debugging). */
static PyObject *synthetic_indexed(PyObject *self, PyObject *args) {
    Py_buffer view, iview;
    ji_index ix;
    char msg[JI_ERRLEN];
    unsigned r0, r1, c0, c1;
    size_t cap, n = 0;
    unsigned char *buf = NULL;
    PyObject *res;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*IIII:synthetic_indexed", &view, &iview, &r0, &r1, &c0,
                          &c1))
        return NULL;
    if (ji_parse((const unsigned char *)view.buf, (size_t)view.len,
                 (const unsigned char *)iview.buf, (size_t)iview.len, &ix, msg) != JI_OK) {
        PyBuffer_Release(&view);
        PyBuffer_Release(&iview);
        return PyErr_Format(jt_BadIndex, "JPEG index: %s", msg);
    }
    cap = ji_synthetic_bound(&ix);
    buf = PyMem_RawMalloc(cap);
    if (buf != NULL)
        n = ji_synthetic(&ix, r0, r1, c0, c1, buf, cap, msg);
    ji_free(&ix);
    PyBuffer_Release(&view);
    PyBuffer_Release(&iview);
    if (buf == NULL)
        return PyErr_NoMemory();
    res = n ? PyBytes_FromStringAndSize((const char *)buf, (Py_ssize_t)n)
            : PyErr_Format(jt_BadIndex, "JPEG index: %s", msg);
    PyMem_RawFree(buf);
    return res;
}

/* _prepare.c, _resample.c */
PyObject *jt_prepare(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *jt_resample(PyObject *self, PyObject *args, PyObject *kwargs);

static PyMethodDef methods[] = {
    {"header", header, METH_VARARGS,
     "header(data) -> (height, width, components, progressive) from the frame header."},
    {"decode", decode, METH_VARARGS,
     "decode(data, scale, y0, x0, rows, cols, bgr, max_pixels, max_scans) -> (pixels, "
     "x_start, width, image_height, image_width): rows [y0, y0+rows) of the image scaled by "
     "scale/8, columns [x_start, x_start+width) with x_start <= x0 and x_start+width >= "
     "x0+cols; rows x width x 3 bytes. decode(..., index): by a side index (BadIndex if "
     "it does not fit: decode again without it)."},
    {"index_info", index_info, METH_VARARGS,
     "index_info(data) -> None or (mcu_cols, mcu_rows, mcu_width, mcu_height, scan_bytes)."},
    {"synthetic", synthetic_py, METH_VARARGS,
     "synthetic(data, r0, r1, c0, c1) -> bytes: the JPEG of a rectangle of an indexed "
     "file's MCUs."},
    {"index_build", index_build, METH_VARARGS,
     "index_build(data, step=4) -> (bytes, '') or (None, why not): the side index of a "
     "baseline JPEG, an entry every step MCUs of each MCU row."},
    {"index_check", index_check, METH_VARARGS,
     "index_check(data, index) -> (mcu_cols, mcu_rows, step, entries); BadIndex if the "
     "index does not fit the file."},
    {"index_seal", index_seal, METH_VARARGS,
     "index_seal(index) -> bytes: the index with its seal (last 8 bytes) recomputed."},
    {"synthetic_indexed", synthetic_indexed, METH_VARARGS,
     "synthetic_indexed(data, index, r0, r1, c0, c1) -> bytes: the JPEG of a rectangle of "
     "MCUs (c0, c1 on index entries) by a side index."},
    {"prepare", (PyCFunction)(void (*)(void))jt_prepare, METH_VARARGS | METH_KEYWORDS,
     "prepare(data, optimize, max_pixels, interval=1) -> (bytes, note): the file transcoded "
     "losslessly with a restart marker after every MCU and an MCU index, or None and why "
     "not."},
    {"resample", (PyCFunction)(void (*)(void))jt_resample, METH_VARARGS | METH_KEYWORDS,
     "resample(img, y0, x0, fy, fx, out_rows, out_cols, flip=False, simd=True) -> bytearray: "
     "bilinear samples of a fractional box of an h x w x 3 uint8 image (see _resample.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpegturbo",
    "Region and DCT-scaled JPEG decoding over libjpeg-turbo (see producer/image/turbo.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__jpegturbo(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    /* Both are FeedlineErrors, as every error of the package is (turbo.py translates them,
       but a test walks every module's classes). */
    PyObject *errors = PyImport_ImportModule("feedline.errors");
    PyObject *root = errors ? PyObject_GetAttrString(errors, "FeedlineError") : NULL;
    PyObject *bases = root ? PyTuple_Pack(2, root, PyExc_ValueError) : NULL;
    Py_XDECREF(root);
    Py_XDECREF(errors);
    if (bases == NULL) {
        Py_DECREF(m);
        return NULL;
    }
    jt_CorruptJPEG = PyErr_NewException("feedline.producer.image._jpegturbo.CorruptJPEG",
                                        bases, NULL);
    jt_Unsupported = PyErr_NewException("feedline.producer.image._jpegturbo.Unsupported",
                                        bases, NULL);
    jt_BadIndex = PyErr_NewException("feedline.producer.image._jpegturbo.BadIndex", bases,
                                     NULL);
    Py_DECREF(bases);
    if (jt_CorruptJPEG == NULL || jt_Unsupported == NULL || jt_BadIndex == NULL ||
        PyModule_AddObjectRef(m, "BadIndex", jt_BadIndex) < 0 ||
        PyModule_AddObjectRef(m, "CorruptJPEG", jt_CorruptJPEG) < 0 ||
        PyModule_AddObjectRef(m, "Unsupported", jt_Unsupported) < 0 ||
        PyModule_AddStringConstant(m, "LIBJPEG_TURBO_VERSION", STR(LIBJPEG_TURBO_VERSION)) < 0 ||
        PyModule_AddIntConstant(m, "JPEG_LIB_VERSION", JPEG_LIB_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
