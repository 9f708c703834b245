/* feedline.producer.image._jpegturbo: decode a region of a JPEG at a DCT scale of M/8, over
 * libjpeg-turbo's jpeglib.h (jpeg_skip_scanlines, jpeg_crop_scanline, scale_num/scale_denom).
 *
 * Three functions; the first two take any contiguous buffer (bytes, a uint8 numpy array):
 *
 *   header(data) -> (height, width, components, progressive)
 *   decode(data, scale, y0, x0, rows, cols, bgr, max_pixels, max_scans)
 *       -> (pixels: bytearray, x_start, width, image_height, image_width)
 *   resample(pixels, rows, width, col0, cols, y0, x0, fy, fx, out_rows, out_cols) -> bytearray
 *
 * decode() scales the image by scale/8 (1..8) in the IDCT, then returns the rows
 * [y0, y0 + rows) of the scaled image, with columns [x_start, x_start + width) where
 * x_start <= x0 and x_start + width == x0 + cols (libjpeg-turbo widens a crop to the left up
 * to an iMCU boundary). pixels holds rows x width x 3 bytes, BGR or RGB.
 *
 * Errors: Unsupported (this decoder cannot, another may: CMYK/YCCK, 12-bit, lossless,
 * arithmetic coding the library was built without) and CorruptJPEG (the data is bad, or
 * over a limit). Warnings that mean the pixels are missing or garbage (premature end of
 * data, bad Huffman/arithmetic code, a marker in the middle of entropy-coded data) are
 * errors; cosmetic warnings (extraneous bytes between markers, unknown JFIF revision) are
 * not. Limits: the image's declared width x height <= max_pixels (checked before anything is
 * allocated for it), libjpeg's own buffers <= 16 bytes per allowed pixel + 16 MiB, at most
 * max_scans scans (a progressive file of many tiny scans costs CPU per scan).
 * The GIL is released while libjpeg runs.
 *
 * resample() is in _resample.c.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

#ifndef LIBJPEG_TURBO_VERSION
#error "libjpeg-turbo is required (jpeg_crop_scanline, jpeg_skip_scanlines)"
#endif
#define STR_(x) #x
#define STR(x) STR_(x)

static PyObject *CorruptJPEG;
static PyObject *Unsupported;

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    int unsupported;
    char message[JMSG_LENGTH_MAX + 96];
} ErrorMgr;

typedef struct {
    struct jpeg_progress_mgr pub;
    int max_scans;
} ScanLimit;

static void fail(j_common_ptr cinfo) {
    ErrorMgr *err = (ErrorMgr *)cinfo->err;
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

static void check_scans(j_common_ptr cinfo) {
    ScanLimit *lim = (ScanLimit *)cinfo->progress;
    j_decompress_ptr d = (j_decompress_ptr)cinfo;
    if (d->input_scan_number > lim->max_scans) {
        ErrorMgr *err = (ErrorMgr *)cinfo->err;
        snprintf(err->message, sizeof err->message,
                 "more than %d scans (a progressive JPEG this fragmented is refused)",
                 lim->max_scans);
        longjmp(err->jump, 1);
    }
}

static PyObject *raise_from(ErrorMgr *err) {
    PyErr_SetString(err->unsupported ? Unsupported : CorruptJPEG, err->message);
    return NULL;
}

static PyObject *header(PyObject *self, PyObject *args) {
    Py_buffer view;
    struct jpeg_decompress_struct cinfo;
    ErrorMgr err;
    int ok;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*:header", &view))
        return NULL;
    if (view.len <= 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(CorruptJPEG, "empty data");
        return NULL;
    }
    memset(&cinfo, 0, sizeof cinfo);
    memset(&err, 0, sizeof err);
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = fail;
    err.pub.emit_message = warn;
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
        return raise_from(&err);
    return Py_BuildValue("(IIiO)", cinfo.image_height, cinfo.image_width, cinfo.num_components,
                         cinfo.progressive_mode ? Py_True : Py_False);
}

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer view;
    int scale, bgr, max_scans;
    unsigned int y0, x0, rows, cols;
    unsigned long long max_pixels;
    struct jpeg_decompress_struct cinfo;
    ErrorMgr err;
    ScanLimit lim;
    PyObject *volatile out = NULL;
    PyThreadState *volatile ts = NULL;
    JDIMENSION x_start = 0, width = 0, image_h = 0, image_w = 0;
    (void)self;

    if (!PyArg_ParseTuple(args, "y*iIIIIpKi:decode", &view, &scale, &y0, &x0, &rows, &cols,
                          &bgr, &max_pixels, &max_scans))
        return NULL;
    if (scale < 1 || scale > 8 || rows == 0 || cols == 0 || max_scans < 1 ||
        max_pixels > (1ULL << 32)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError,
                        "scale must be 1..8, rows, cols and max_scans >= 1, max_pixels <= 2**32");
        return NULL;
    }
    if (view.len <= 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(CorruptJPEG, "empty data");
        return NULL;
    }
    memset(&cinfo, 0, sizeof cinfo);
    memset(&err, 0, sizeof err);
    memset(&lim, 0, sizeof lim);
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = fail;
    err.pub.emit_message = warn;

    ts = PyEval_SaveThread();
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&cinfo);
        PyEval_RestoreThread(ts);
        Py_XDECREF(out);
        PyBuffer_Release(&view);
        return raise_from(&err);
    }
    jpeg_create_decompress(&cinfo);
    lim.pub.progress_monitor = check_scans;
    lim.max_scans = max_scans;
    cinfo.progress = &lim.pub;
    jpeg_mem_src(&cinfo, (const unsigned char *)view.buf, (unsigned long)view.len);
    jpeg_read_header(&cinfo, TRUE);
    image_h = cinfo.image_height;
    image_w = cinfo.image_width;
    if ((unsigned long long)image_h * image_w > max_pixels) {
        snprintf(err.message, sizeof err.message,
                 "declares %ux%u pixels, over the limit of %llu", (unsigned)image_w,
                 (unsigned)image_h, max_pixels);
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
    /* Bounded buffers: a progressive image keeps all its coefficients (2 bytes each). */
    cinfo.mem->max_memory_to_use = (long)(max_pixels * 16 + (16L << 20));
    cinfo.out_color_space = bgr ? JCS_EXT_BGR : JCS_EXT_RGB;
    cinfo.scale_num = (unsigned int)scale;
    cinfo.scale_denom = 8;
    cinfo.dct_method = JDCT_ISLOW;     /* what OpenCV uses: same pixels at scale 8/8 */
    cinfo.do_fancy_upsampling = TRUE;
    jpeg_calc_output_dimensions(&cinfo);
    if ((unsigned long long)y0 + rows > cinfo.output_height ||
        (unsigned long long)x0 + cols > cinfo.output_width) {
        snprintf(err.message, sizeof err.message,
                 "region %ux%u at (%u, %u) is outside the %ux%u image at scale %d/8", cols,
                 rows, x0, y0, (unsigned)cinfo.output_width, (unsigned)cinfo.output_height,
                 scale);
        longjmp(err.jump, 1);
    }
    jpeg_start_decompress(&cinfo);
    x_start = x0;
    width = cols;
    if (width < cinfo.output_width)
        jpeg_crop_scanline(&cinfo, &x_start, &width);

    /* The output buffer is a Python object: take the GIL back only to allocate it. */
    PyEval_RestoreThread(ts);
    out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)rows * width * 3);
    if (out == NULL) {
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&view);
        return NULL;
    }
    ts = PyEval_SaveThread();
    {
        JSAMPLE *base = (JSAMPLE *)PyByteArray_AS_STRING(out);
        size_t stride = (size_t)width * 3;
        if (y0 > 0 && jpeg_skip_scanlines(&cinfo, y0) != y0) {
            snprintf(err.message, sizeof err.message, "could not skip to row %u", y0);
            longjmp(err.jump, 1);
        }
        while (cinfo.output_scanline < y0 + rows) {
            JSAMPROW row = base + (size_t)(cinfo.output_scanline - y0) * stride;
            if (jpeg_read_scanlines(&cinfo, &row, 1) != 1) {
                snprintf(err.message, sizeof err.message, "no data for row %u",
                         (unsigned)cinfo.output_scanline);
                longjmp(err.jump, 1);
            }
        }
    }
    jpeg_destroy_decompress(&cinfo); /* the rows below the region are never decoded */
    PyEval_RestoreThread(ts);
    PyBuffer_Release(&view);
    return Py_BuildValue("(NIIII)", out, (unsigned)x_start, (unsigned)width,
                         (unsigned)image_h, (unsigned)image_w);
}

/* _resample.c */
PyObject *jt_resample(PyObject *self, PyObject *args);

static PyMethodDef methods[] = {
    {"header", header, METH_VARARGS,
     "header(data) -> (height, width, components, progressive) from the frame header."},
    {"decode", decode, METH_VARARGS,
     "decode(data, scale, y0, x0, rows, cols, bgr, max_pixels, max_scans) -> (pixels, "
     "x_start, width, image_height, image_width): rows [y0, y0+rows) of the image scaled by "
     "scale/8, columns [x_start, x0+cols) with x_start <= x0; rows x width x 3 bytes."},
    {"resample", jt_resample, METH_VARARGS,
     "resample(pixels, rows, width, col0, cols, y0, x0, fy, fx, out_rows, out_cols) -> "
     "bytearray: bilinear samples of a fractional box (see the module's comment)."},
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
    CorruptJPEG = PyErr_NewException("feedline.producer.image._jpegturbo.CorruptJPEG", bases,
                                     NULL);
    Unsupported = PyErr_NewException("feedline.producer.image._jpegturbo.Unsupported", bases,
                                     NULL);
    Py_DECREF(bases);
    if (CorruptJPEG == NULL || Unsupported == NULL ||
        PyModule_AddObjectRef(m, "CorruptJPEG", CorruptJPEG) < 0 ||
        PyModule_AddObjectRef(m, "Unsupported", Unsupported) < 0 ||
        PyModule_AddStringConstant(m, "LIBJPEG_TURBO_VERSION", STR(LIBJPEG_TURBO_VERSION)) < 0 ||
        PyModule_AddIntConstant(m, "JPEG_LIB_VERSION", JPEG_LIB_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
