/* feedline.producer.image._jpegturbo.resample: bilinear sampling of a fractional box.
 *
 *   resample(pixels, rows, width, col0, cols, y0, x0, fy, fx, out_rows, out_cols) -> bytearray
 *
 * OpenCV's INTER_LINEAR resize cannot start between pixels, and its warpAffine is 4x slower
 * on 3 channels. Output pixel (j, i) is the input at (y0 + (j + 0.5) * fy - 0.5,
 * x0 + (i + 0.5) * fx - 0.5) (pixel centres, as cv2.resize maps them) within the columns
 * [col0, col0 + cols) of a rows x width x 3 image, edges replicated, weights in 1/2048:
 * within 1 grey level of cv2.resize where both apply. Separable: each source row is
 * interpolated horizontally once (kept while consecutive output rows share it), then rows
 * are blended. The GIL is released while it runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>

#define WBITS 11
#define WONE (1 << WBITS)

/* For each output position: the byte offset of its left/upper neighbour (in units of
 * `unit`), the offset to the other neighbour (0 at the edge) and the other one's weight. */
static void taps(double start, double step, unsigned n, unsigned size, size_t unit,
                 size_t *off, size_t *next, int *wt) {
    for (unsigned i = 0; i < n; i++) {
        double s = start + (i + 0.5) * step - 0.5;
        unsigned k;
        if (s <= 0) {
            off[i] = 0;
            next[i] = 0;
            wt[i] = 0;
            continue;
        }
        if (s >= (double)(size - 1)) {
            off[i] = (size - 1) * unit;
            next[i] = 0;
            wt[i] = 0;
            continue;
        }
        k = (unsigned)s;
        off[i] = k * unit;
        next[i] = unit;
        wt[i] = (int)((s - k) * WONE + 0.5);
    }
}

/* One source row interpolated horizontally, in units of 1/WONE. */
static void hrow(const unsigned char *restrict row, unsigned out_cols,
                 const size_t *restrict xo, const size_t *restrict xn, const int *restrict xw,
                 int *restrict dst) {
    for (unsigned i = 0; i < out_cols; i++) {
        const unsigned char *p = row + xo[i];
        const unsigned char *q = p + xn[i];
        int a = xw[i], b = WONE - a;
        dst[3 * i] = p[0] * b + q[0] * a;
        dst[3 * i + 1] = p[1] * b + q[1] * a;
        dst[3 * i + 2] = p[2] * b + q[2] * a;
    }
}

static void vblend(const int *restrict h0, const int *restrict h1, int b, unsigned n,
                   unsigned char *restrict dst) {
    int a = WONE - b;
    for (unsigned i = 0; i < n; i++)
        dst[i] = (unsigned char)((h0[i] * a + h1[i] * b + (1 << (2 * WBITS - 1))) >>
                                 (2 * WBITS));
}

PyObject *jt_resample(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned rows, width, col0, cols, out_rows, out_cols;
    double y0, x0, fy, fx;
    PyObject *out;
    size_t *xo, *xn, *yo, *yn;
    int *xw, *yw, *h0, *h1;
    void *mem;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*IIIIddddII:resample", &view, &rows, &width, &col0, &cols,
                          &y0, &x0, &fy, &fx, &out_rows, &out_cols))
        return NULL;
    if (rows == 0 || cols == 0 || out_rows == 0 || out_cols == 0 || out_rows > 65535 ||
        out_cols > 65535 || (unsigned long long)col0 + cols > width ||
        (unsigned long long)rows * width * 3 > (unsigned long long)view.len ||
        !(fy > 0 && fx > 0 && fy < 1e6 && fx < 1e6 && y0 > -1e6 && y0 < 1e6 && x0 > -1e6 &&
          x0 < 1e6)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "resample: bad geometry");
        return NULL;
    }
    out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)out_rows * out_cols * 3);
    mem = PyMem_RawMalloc((sizeof(size_t) * 2 + sizeof(int)) * ((size_t)out_cols + out_rows) +
                          sizeof(int) * 6 * (size_t)out_cols);
    if (out == NULL || mem == NULL) {
        Py_XDECREF(out);
        PyMem_RawFree(mem);
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    xo = mem;
    xn = xo + out_cols;
    yo = xn + out_cols;
    yn = yo + out_rows;
    xw = (int *)(yn + out_rows);
    yw = xw + out_cols;
    h0 = yw + out_rows;
    h1 = h0 + 3 * (size_t)out_cols;
    Py_BEGIN_ALLOW_THREADS
    {
        const unsigned char *src = (const unsigned char *)view.buf + 3 * (size_t)col0;
        unsigned char *dst = (unsigned char *)PyByteArray_AS_STRING(out);
        size_t have0 = (size_t)-1, have1 = (size_t)-1;
        taps(x0, fx, out_cols, cols, 3, xo, xn, xw);
        taps(y0, fy, out_rows, rows, 3 * (size_t)width, yo, yn, yw);
        for (unsigned j = 0; j < out_rows; j++) {
            size_t r0 = yo[j], r1 = yo[j] + yn[j];
            if (r0 == have1 && r0 != have0) { /* the last lower row is our upper one */
                int *t = h0;
                h0 = h1;
                h1 = t;
                have0 = have1;
                have1 = (size_t)-1;
            }
            if (r0 != have0) {
                hrow(src + r0, out_cols, xo, xn, xw, h0);
                have0 = r0;
            }
            if (r1 != have1) {
                hrow(src + r1, out_cols, xo, xn, xw, h1);
                have1 = r1;
            }
            vblend(h0, h1, yw[j], 3 * out_cols, dst);
            dst += 3 * (size_t)out_cols;
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(mem);
    PyBuffer_Release(&view);
    return out;
}

