/* MCU-indexed JPEGs (see _mcuindex.c): where each MCU row's restart intervals start, and the
 * synthetic JPEG that holds only a rectangle of a file's MCUs. Pure C over bytes. */
#ifndef FEEDLINE_MCUINDEX_H
#define FEEDLINE_MCUINDEX_H

#include <stddef.h>

#define MI_NONE 0 /* no index: a JPEG like any other (libjpeg judges it) */
#define MI_OK 1
#define MI_BAD (-1) /* an index that does not fit the file: the message says why */

#define MI_ERRLEN 200

/* The frame and scan of an indexed JPEG. Offsets are into the file's bytes. */
typedef struct {
    size_t sof;         /* the frame header's marker (FF C0 or FF C1) */
    size_t index;       /* the index segment's marker */
    size_t index_len;   /* the whole segment, marker included */
    size_t scan;        /* the first byte of entropy-coded data (after the SOS segment) */
    size_t scan_len;    /* entropy-coded bytes, up to the EOI marker that ends the file */
    unsigned width, height;
    unsigned mcu_w, mcu_h; /* an MCU's size in pixels */
    unsigned cols, rows;   /* MCUs per row, MCU rows */
    const unsigned char *offsets; /* rows x big-endian u32: each row's first byte, from scan */
} mi_layout;

/* Reads the file's structure up to its scan. MI_NONE if it has no index segment; MI_OK and
 * lay filled in if it has one that fits the file (checked: see _mcuindex.c); MI_BAD with
 * err set otherwise. */
int mi_parse(const unsigned char *d, size_t n, mi_layout *lay, char *err);

/* The most bytes mi_synthetic() writes for this file. */
size_t mi_synthetic_bound(const mi_layout *lay);

/* Writes to out (cap bytes) a baseline JPEG of MCU rows [r0, r1) and columns [c0, c1) of the
 * indexed file d: its headers without the index, the frame's size changed, the intervals of
 * those MCUs with their restart markers renumbered, EOI. Returns the length, or 0 with err
 * set when the scan does not hold what the index says. */
size_t mi_synthetic(const unsigned char *d, const mi_layout *lay, unsigned r0, unsigned r1,
                    unsigned c0, unsigned c1, unsigned char *out, size_t cap, char *err);

/* For a file just written with a restart marker after every MCU (one interleaved baseline
 * scan), the index segment that goes before its SOS marker: written to seg (cap bytes).
 * Returns the segment's length and sets *sos to the SOS marker's offset, or 0 with err set. */
size_t mi_make_index(const unsigned char *d, size_t n, unsigned char *seg, size_t cap,
                     size_t *sos, char *err);

/* The index segment's size for a file of this many MCU rows. */
size_t mi_index_size(unsigned rows);

#endif
