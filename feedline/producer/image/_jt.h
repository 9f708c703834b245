/* Shared by the C files of feedline.producer.image._jpegturbo: libjpeg error handling that
 * longjmps back to the caller with a message, and the module's exception types. */
#ifndef FEEDLINE_JT_H
#define FEEDLINE_JT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>

#include <jpeglib.h>

#ifndef LIBJPEG_TURBO_VERSION
#error "libjpeg-turbo is required (jpeg_crop_scanline, jpeg_skip_scanlines)"
#endif

extern PyObject *jt_CorruptJPEG; /* the data is bad, or over a limit */
extern PyObject *jt_Unsupported; /* this decoder cannot, another may */

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    int unsupported;
    char message[JMSG_LENGTH_MAX + 224];
} jt_error;

/* Sets up err for a libjpeg object: errors longjmp to err->jump with err->message set;
 * warnings that mean missing or garbage pixels are errors (see _jpegturbo.c). */
struct jpeg_error_mgr *jt_error_init(jt_error *err);

/* Sets the exception err describes; returns NULL. */
PyObject *jt_raise(const jt_error *err);

/* Bounds libjpeg's memory for an image of at most max_pixels pixels: a progressive image
 * keeps all its coefficients (2 bytes each, up to 3 components at 4:4:4) and a transcode
 * keeps them for both sides. */
#define JT_MAX_MEMORY(max_pixels) ((long)((max_pixels) * 16 + (16L << 20)))

#endif
