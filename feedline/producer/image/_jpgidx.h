/* JPEG side indexes (see _jpgidx.c): random access into an unmodified baseline JPEG by the
 * bit offset and DC predictions at every k-th MCU of each MCU row. Pure C over bytes. */
#ifndef FEEDLINE_JPGIDX_H
#define FEEDLINE_JPGIDX_H

#include <stddef.h>
#include <stdint.h>

#define JI_ERRLEN 200

#define JI_OK 1
#define JI_NOT_INDEXABLE 0 /* a JPEG this index cannot address: decode it as today */
#define JI_BAD (-1)        /* corrupt data, or an index that does not fit its file */

/* A parsed and checked index, with what it needs of its file. */
typedef struct {
    const unsigned char *scan; /* the file's entropy-coded data */
    size_t scan_len;           /* its bytes, up to the marker that ends it */
    size_t head_len;           /* synthetic headers: kept segments, DRI, SOS */
    unsigned char *head;       /* SOI + the segments a decoder needs, up to its SOS */
    size_t sof;                /* the frame header's marker, in head */
    size_t dri;                /* where the DRI segment's interval goes, in head */
    unsigned width, height, ncomp, step;
    unsigned mcu_w, mcu_h, cols, rows, per_row; /* per_row: index entries per MCU row */
    uint32_t end_bits;         /* the bit where the last MCU ends */
    uint32_t *bits;            /* rows x per_row entry positions (bits from scan) */
    int16_t *preds;            /* rows x per_row x ncomp DC predictions */
    void *tables;              /* the scan's Huffman tables, per component */
} ji_index;

/* Builds the index of data[0, n) with an entry every `step` MCUs of each row: *out is
 * malloc'd (PyMem_Raw) with *out_len bytes. JI_OK; JI_NOT_INDEXABLE (err says why: a
 * progressive file, restart markers, ...); JI_BAD for data that does not decode. */
int ji_build(const unsigned char *d, size_t n, unsigned step, unsigned char **out,
             size_t *out_len, char *err);

/* Checks idx[0, idx_len) against the file d[0, n) (its checksum, frame, scan and every
 * entry) and fills ix: JI_OK, or JI_BAD with err set and nothing allocated. */
int ji_parse(const unsigned char *d, size_t n, const unsigned char *idx, size_t idx_len,
             ji_index *ix, char *err);

void ji_free(ji_index *ix);

/* The most bytes ji_synthetic() writes. */
size_t ji_synthetic_bound(const ji_index *ix);

/* Writes to out (cap bytes) a baseline JPEG of MCU rows [r0, r1) and columns [c0, c1) of
 * the indexed file, c0 and c1 on index entries (multiples of step, or cols): one restart
 * interval per row, each starting from its entry's bit, its first DC differences re-coded
 * from the entry's predictions. Returns the length, or 0 with err set. */
size_t ji_synthetic(const ji_index *ix, unsigned r0, unsigned r1, unsigned c0, unsigned c1,
                    unsigned char *out, size_t cap, char *err);

/* Writes the last 8 bytes of idx[0, len) (len >= 48): the XXH64 of the bytes before them,
 * the seal ji_parse checks first (for tests and fuzzing that edit an index and must reach
 * the checks behind the seal). */
void ji_seal(unsigned char *idx, size_t len);

/* XXH64 (seed 0) of data[0, n): the checksum an index holds of its file. */
uint64_t ji_xxh64(const unsigned char *p, size_t n);

#endif
