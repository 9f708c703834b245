/* feedline.producer.image._jpegturbo.prepare: a JPEG transcoded losslessly for crop decoding.
 *
 *   prepare(data, optimize, max_pixels, interval=1) -> (bytes, "") or (None, why not)
 *
 * The coefficients are read (jpeg_read_coefficients) and written again (jpeg_write_
 * coefficients) with the same quantisation tables, sampling and component ids, so every
 * decoder gives the same pixels: nothing is requantised. What changes is the coding: one
 * baseline (sequential, Huffman) scan with a restart marker after every MCU, Huffman tables
 * optimised for this image when `optimize` (it recovers much of what the markers cost), and
 * an MCU index segment (_mcuindex.c) before the scan, so that the decoder can entropy-decode
 * only the MCUs a crop needs. APPn and COM segments are kept (EXIF, ICC profiles, ...), but
 * the JFIF or Adobe segment the library writes itself for the colour space, and an old index.
 *
 * Not prepared (None, and why): colour spaces the fused decoder leaves to OpenCV (CMYK,
 * YCCK, unknown), progressive files whose scans never refine some coefficients fully
 * (libjpeg smooths the blocks of such files: a baseline copy would decode differently), and
 * files that redefine a quantisation table between scans (libjpeg cannot write them). A
 * progressive file that is complete becomes baseline: the same coefficients. Errors as in
 * decode(): CorruptJPEG for data that does not decode (truncated, corrupt entropy-coded
 * data), or declares more than max_pixels; Unsupported for 12-bit and lossless files. After
 * writing, the result's header is read back: a colour space, size or sampling that came out
 * different is an error (it would mean other pixels), not a result.
 *
 * `interval` other than 1 (MCUs per restart interval; 0: one MCU row) writes the file with
 * that interval and no index: only for measuring what the choice of 1 costs and saves
 * (benchmarks/prepare_jpegs.py --intervals); the decoder reads only indexes of 1.
 */
#include "_jt.h"

#include <stdlib.h>
#include <string.h>

#include <jerror.h>

#include "_mcuindex.h"

static const char INDEX_MAGIC[] = "feedline-mcu-index";

/* Copies the source's saved APPn and COM segments but those the writer makes itself. */
static void copy_markers(j_decompress_ptr src, j_compress_ptr dst) {
    jpeg_saved_marker_ptr m;
    for (m = src->marker_list; m != NULL; m = m->next) {
        int is = (int)m->marker;
        if (dst->write_JFIF_header && is == JPEG_APP0 && m->data_length >= 5 &&
            memcmp(m->data, "JFIF", 5) == 0)
            continue;
        if (dst->write_Adobe_marker && is == JPEG_APP0 + 14 && m->data_length >= 5 &&
            memcmp(m->data, "Adobe", 5) == 0)
            continue;
        if (is == JPEG_APP0 + 9 && m->data_length >= sizeof INDEX_MAGIC - 1 &&
            memcmp(m->data, INDEX_MAGIC, sizeof INDEX_MAGIC - 1) == 0)
            continue;
        jpeg_write_marker(dst, is, m->data, m->data_length);
    }
}

/* Every coefficient of every component got all its bits (a progressive scan script that
 * stopped early leaves some at -1 or above 0: libjpeg then smooths those blocks). */
static int complete(j_decompress_ptr src) {
    int ci, k;
    if (!src->progressive_mode)
        return 1;
    for (ci = 0; ci < src->num_components; ci++)
        for (k = 0; k < DCTSIZE2; k++)
            if (src->coef_bits[ci][k] != 0)
                return 0;
    return 1;
}

/* The written file reads back as the same image: size, colour space, components. */
static int same_frame(j_decompress_ptr src, j_decompress_ptr chk_, const unsigned char *buf,
                      unsigned long len) {
    struct jpeg_decompress_struct chk;
    int ci, same;
    jpeg_create_decompress(chk_);
    jpeg_mem_src(chk_, buf, len);
    jpeg_read_header(chk_, TRUE);
    chk = *chk_;
    same = chk.image_width == src->image_width && chk.image_height == src->image_height &&
           chk.num_components == src->num_components &&
           chk.jpeg_color_space == src->jpeg_color_space && !chk.progressive_mode;
    for (ci = 0; same && ci < src->num_components; ci++)
        same = chk.comp_info[ci].component_id == src->comp_info[ci].component_id &&
               chk.comp_info[ci].h_samp_factor == src->comp_info[ci].h_samp_factor &&
               chk.comp_info[ci].v_samp_factor == src->comp_info[ci].v_samp_factor;
    return same;
}

PyObject *jt_prepare(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kw[] = {"data", "optimize", "max_pixels", "interval", NULL};
    Py_buffer view;
    int optimize, m;
    unsigned interval = 1;
    unsigned long long max_pixels;
    struct jpeg_decompress_struct src;
    struct jpeg_compress_struct dst;
    struct jpeg_decompress_struct chk; /* the result, read back */
    jt_error err;
    jvirt_barray_ptr *coefs;
    unsigned char *volatile written = NULL; /* jpeg_mem_dest's buffer (malloc) */
    unsigned long written_len = 0;
    unsigned char *volatile seg = NULL;
    volatile size_t seg_len = 0;
    size_t sos = 0;
    const char *volatile note = NULL;
    char msg[MI_ERRLEN];
    PyThreadState *ts;
    PyObject *res = NULL;
    (void)self;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*pK|I:prepare", kw, &view, &optimize,
                                     &max_pixels, &interval))
        return NULL;
    if (interval > 0xFFFF) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "interval must be 0..65535 MCUs");
        return NULL;
    }
    if (view.len <= 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(jt_CorruptJPEG, "empty data");
        return NULL;
    }
    memset(&src, 0, sizeof src);
    memset(&dst, 0, sizeof dst);
    memset(&chk, 0, sizeof chk);
    src.err = jt_error_init(&err);
    dst.err = &err.pub;
    chk.err = &err.pub;

    ts = PyEval_SaveThread();
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&chk);
        jpeg_destroy_compress(&dst);
        jpeg_destroy_decompress(&src);
        free(written);
        free(seg);
        PyEval_RestoreThread(ts);
        PyBuffer_Release(&view);
        if (err.pub.msg_code == JERR_MISMATCHED_QUANT_TABLE) /* a slot redefined between
                                                               * scans: libjpeg cannot write
                                                               * that; the file is fine */
            return Py_BuildValue("(Os)", Py_None, "a JPEG that redefines a quantisation table "
                                 "between scans");
        return jt_raise(&err);
    }
    jpeg_create_decompress(&src);
    jpeg_create_compress(&dst);
    jpeg_mem_src(&src, (const unsigned char *)view.buf, (unsigned long)view.len);
    jpeg_save_markers(&src, JPEG_COM, 0xFFFF);
    for (m = 0; m < 16; m++)
        jpeg_save_markers(&src, JPEG_APP0 + m, 0xFFFF);
    jpeg_read_header(&src, TRUE);
    if ((unsigned long long)src.image_width * src.image_height > max_pixels) {
        snprintf(err.message, sizeof err.message, "declares %ux%u pixels, over the limit of "
                 "%llu", (unsigned)src.image_width, (unsigned)src.image_height, max_pixels);
        longjmp(err.jump, 1);
    }
    if (src.jpeg_color_space != JCS_YCbCr && src.jpeg_color_space != JCS_GRAYSCALE &&
        src.jpeg_color_space != JCS_RGB) {
        note = "a CMYK, YCCK or unknown colour space's JPEG (decoded by OpenCV)";
        goto done;
    }
    src.mem->max_memory_to_use = JT_MAX_MEMORY(max_pixels);
    coefs = jpeg_read_coefficients(&src);
    if (!complete(&src)) {
        note = "a progressive JPEG whose scans leave some coefficients unrefined";
        goto done;
    }
    jpeg_mem_dest(&dst, (unsigned char **)&written, &written_len);
    jpeg_copy_critical_parameters(&src, &dst);
    dst.mem->max_memory_to_use = JT_MAX_MEMORY(max_pixels);
    dst.restart_interval = interval;
    dst.restart_in_rows = interval == 0; /* 0: a restart marker after every MCU row */
    dst.optimize_coding = optimize ? TRUE : FALSE;
    jpeg_write_coefficients(&dst, coefs);
    copy_markers(&src, &dst);
    jpeg_finish_compress(&dst);
    if (!same_frame(&src, &chk, written, written_len)) {
        snprintf(err.message, sizeof err.message, "the transcoded file reads back as another "
                 "frame (colour space or sampling)");
        longjmp(err.jump, 1);
    }
    if (interval != 1)
        goto done; /* measured, not decoded by index (see above) */
    seg = malloc(mi_index_size(0xFFFF));
    if (seg == NULL) {
        snprintf(err.message, sizeof err.message, "no memory for an MCU index");
        longjmp(err.jump, 1);
    }
    seg_len = mi_make_index(written, written_len, seg, mi_index_size(0xFFFF), &sos, msg);
    if (seg_len == 0) {
        snprintf(err.message, sizeof err.message, "the transcoded file has no MCU grid to "
                 "index: %s", msg);
        longjmp(err.jump, 1);
    }
done:
    jpeg_destroy_decompress(&chk);
    jpeg_destroy_compress(&dst);
    jpeg_destroy_decompress(&src);
    PyEval_RestoreThread(ts);
    PyBuffer_Release(&view);
    if (note != NULL) {
        res = Py_BuildValue("(Os)", Py_None, note);
    } else {
        PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(written_len + seg_len));
        if (out != NULL) {
            char *o = PyBytes_AS_STRING(out);
            memcpy(o, written, sos);
            memcpy(o + sos, seg, seg_len);
            memcpy(o + sos + seg_len, written + sos, written_len - sos);
            res = Py_BuildValue("(Ns)", out, "");
        }
    }
    free(written);
    free(seg);
    return res;
}
