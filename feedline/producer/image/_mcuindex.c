/* MCU-indexed JPEGs: decode a crop by entropy-decoding only the MCUs that hold it.
 *
 * A prepared JPEG (_prepare.c) is one interleaved baseline scan with a restart marker after
 * every MCU, so every MCU starts on a byte boundary with its DC predictions reset: any
 * rectangle of MCUs, its intervals put one after another with their restart markers
 * renumbered, is itself a valid scan, of a JPEG whose frame is that rectangle's size. The
 * file carries an index, an APP9 segment before its SOS marker:
 *
 *   "feedline-mcu-index"  18 bytes
 *   version               u8, 1
 *   interval              u16, MCUs per restart interval: 1
 *   cols, rows            u16 each: MCUs per row, MCU rows (as the frame implies)
 *   scan_len              u32: entropy-coded bytes, from the end of the SOS segment up to
 *                         the EOI marker that ends the file
 *   offsets               rows x u32: where each MCU row's first interval starts, from the
 *                         start of the entropy-coded data (row 0: 0)
 *
 * (big-endian, as JPEG). Every other decoder skips the segment: the file decodes everywhere
 * to the pixels of the file it was made from. Within a row, intervals are found by their
 * restart markers: a scan for 0xFF bytes (memchr), which costs far less than the Huffman
 * decoding it saves, and an index of 4 bytes per MCU row instead of per MCU.
 *
 * Hostile input: everything here reads only inside the file's bytes and writes only inside
 * the caller's buffer. The index must fit the frame (its grid), the scan (offsets increasing,
 * inside the entropy-coded data, each row's first byte right after the restart marker that
 * ends the previous row, with that marker's number) and the file (EOI right after the scan).
 * Walking a row, every marker met must be the restart marker of the interval's number in
 * sequence, at most one row's intervals long; anything else (another marker, a marker cut
 * off, a row with fewer intervals than the index promises) is an error that names it.
 * libjpeg then decodes the synthetic file and checks the entropy-coded data itself.
 */
#include "_mcuindex.h"

#include <stdio.h>
#include <string.h>

static const char MAGIC[] = "feedline-mcu-index";
#define MAGIC_LEN 18
#define HEAD_LEN (MAGIC_LEN + 1 + 2 + 2 + 2 + 4) /* payload before the offsets */
#define VERSION 1

static unsigned be16(const unsigned char *p) { return ((unsigned)p[0] << 8) | p[1]; }

static size_t be32(const unsigned char *p) {
    return ((size_t)p[0] << 24) | ((size_t)p[1] << 16) | ((size_t)p[2] << 8) | p[3];
}

static void put16(unsigned char *p, unsigned v) {
    p[0] = (unsigned char)(v >> 8);
    p[1] = (unsigned char)v;
}

static void put32(unsigned char *p, size_t v) {
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

size_t mi_index_size(unsigned rows) { return 4 + HEAD_LEN + 4 * (size_t)rows; }

/* What the marker segments before the first scan say. */
typedef struct {
    int sof_kind;   /* 0: none yet, 1: SOF0/SOF1 (Huffman sequential), 2: any other SOF */
    size_t sof, sos, scan, index, index_len;
    unsigned restart, width, height, ncomp, max_h, max_v, scan_comps;
    unsigned ss, se, ahal;
    const unsigned char *index_data; /* the segment's payload after the magic */
    size_t index_data_len;
} headers;

/* Walks the segments from SOI to the first SOS. 1 when it got there, 0 when the file does
 * not have that structure (err says where). */
static int walk(const unsigned char *d, size_t n, headers *h, char *err) {
    size_t pos = 2;
    memset(h, 0, sizeof *h);
    if (n < 4 || d[0] != 0xFF || d[1] != 0xD8) {
        snprintf(err, MI_ERRLEN, "no SOI marker");
        return 0;
    }
    for (;;) {
        unsigned m, len;
        const unsigned char *seg;
        if (pos + 4 > n) {
            snprintf(err, MI_ERRLEN, "the file ends at byte %zu, before its scan", n);
            return 0;
        }
        if (d[pos] != 0xFF) {
            snprintf(err, MI_ERRLEN, "no marker at byte %zu", pos);
            return 0;
        }
        m = d[pos + 1];
        if (m == 0xFF) { /* a fill byte before a marker */
            pos++;
            continue;
        }
        if (m == 0x00 || m == 0x01 || m == 0xD8 || m == 0xD9 || (m >= 0xD0 && m <= 0xD7)) {
            snprintf(err, MI_ERRLEN, "marker FF%02X at byte %zu where a segment belongs", m,
                     pos);
            return 0;
        }
        len = be16(d + pos + 2);
        if (len < 2 || pos + 2 + len > n) {
            snprintf(err, MI_ERRLEN, "segment FF%02X at byte %zu runs past the file", m, pos);
            return 0;
        }
        seg = d + pos + 4; /* the payload: len - 2 bytes */
        if (m == 0xE9 && len - 2 >= MAGIC_LEN && memcmp(seg, MAGIC, MAGIC_LEN) == 0) {
            if (h->index_data != NULL) {
                snprintf(err, MI_ERRLEN, "two MCU indexes");
                return 0;
            }
            h->index = pos;
            h->index_len = 2 + (size_t)len;
            h->index_data = seg + MAGIC_LEN;
            h->index_data_len = len - 2 - MAGIC_LEN;
        } else if (m == 0xDD) { /* DRI */
            if (len != 4) {
                snprintf(err, MI_ERRLEN, "a DRI segment of %u bytes", len);
                return 0;
            }
            h->restart = be16(seg);
        } else if (m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC) {
            unsigned c;
            if (h->sof_kind != 0) {
                snprintf(err, MI_ERRLEN, "two frame headers");
                return 0;
            }
            h->sof_kind = (m == 0xC0 || m == 0xC1) ? 1 : 2;
            h->sof = pos;
            if (len < 8 || seg[0] != 8) {
                snprintf(err, MI_ERRLEN, "a frame header that is not 8-bit");
                return 0;
            }
            h->height = be16(seg + 1);
            h->width = be16(seg + 3);
            h->ncomp = seg[5];
            if (h->ncomp < 1 || h->ncomp > 4 || len != 8 + 3 * h->ncomp) {
                snprintf(err, MI_ERRLEN, "a frame header of %u components in %u bytes",
                         h->ncomp, len);
                return 0;
            }
            for (c = 0; c < h->ncomp; c++) {
                unsigned hs = seg[7 + 3 * c] >> 4, vs = seg[7 + 3 * c] & 15;
                if (hs < 1 || hs > 4 || vs < 1 || vs > 4) {
                    snprintf(err, MI_ERRLEN, "sampling factors %ux%u", hs, vs);
                    return 0;
                }
                h->max_h = hs > h->max_h ? hs : h->max_h;
                h->max_v = vs > h->max_v ? vs : h->max_v;
            }
        } else if (m == 0xDA) { /* SOS: Ns, Ns x (id, tables), Ss, Se, Ah/Al */
            if (len < 6 || len != 6 + 2 * (unsigned)seg[0]) {
                snprintf(err, MI_ERRLEN, "an SOS segment of %u bytes", len);
                return 0;
            }
            h->scan_comps = seg[0];
            h->ss = seg[len - 5];
            h->se = seg[len - 4];
            h->ahal = seg[len - 3];
            h->sos = pos;
            h->scan = pos + 2 + len;
            return 1;
        }
        pos += 2 + (size_t)len;
    }
}

/* The frame's MCU grid: single-component scans have 8x8 MCUs (one block), interleaved ones
 * 8*max_h x 8*max_v pixels. */
static void grid(const headers *h, mi_layout *lay) {
    lay->mcu_w = h->ncomp == 1 ? 8 : 8 * h->max_h;
    lay->mcu_h = h->ncomp == 1 ? 8 : 8 * h->max_v;
    lay->cols = (h->width + lay->mcu_w - 1) / lay->mcu_w;
    lay->rows = (h->height + lay->mcu_h - 1) / lay->mcu_h;
    lay->width = h->width;
    lay->height = h->height;
}

/* The scan must be what an index can address: one baseline scan of every component. */
static int sequential(const headers *h, char *err) {
    if (h->sof_kind != 1) {
        snprintf(err, MI_ERRLEN, "%s", h->sof_kind == 0 ? "no frame header before the scan"
                                  : "not a baseline Huffman frame");
        return 0;
    }
    if (h->width == 0 || h->height == 0) {
        snprintf(err, MI_ERRLEN, "a frame of %ux%u pixels", h->width, h->height);
        return 0;
    }
    if (h->scan_comps != h->ncomp || h->ss != 0 || h->se != 63 || h->ahal != 0) {
        snprintf(err, MI_ERRLEN, "a scan that is not all components, all coefficients");
        return 0;
    }
    if (h->restart != 1) {
        snprintf(err, MI_ERRLEN, "a restart interval of %u MCUs, not 1", h->restart);
        return 0;
    }
    return 1;
}

int mi_parse(const unsigned char *d, size_t n, mi_layout *lay, char *err) {
    headers h;
    const unsigned char *p;
    unsigned version, interval, cols, rows, r;
    size_t prev = 0;
    if (!walk(d, n, &h, err))
        return h.index_data != NULL ? MI_BAD : MI_NONE; /* libjpeg judges an unindexed file */
    if (h.index_data == NULL)
        return MI_NONE;
    if (!sequential(&h, err))
        return MI_BAD;
    memset(lay, 0, sizeof *lay);
    grid(&h, lay);
    p = h.index_data;
    if (h.index_data_len < HEAD_LEN - MAGIC_LEN) {
        snprintf(err, MI_ERRLEN, "an index segment of %zu bytes", h.index_data_len);
        return MI_BAD;
    }
    version = p[0];
    interval = be16(p + 1);
    cols = be16(p + 3);
    rows = be16(p + 5);
    lay->scan_len = be32(p + 7);
    if (version != VERSION || interval != 1) {
        snprintf(err, MI_ERRLEN, "index version %u, interval %u (this reads version %d, 1)",
                 version, interval, VERSION);
        return MI_BAD;
    }
    if (cols != lay->cols || rows != lay->rows) {
        snprintf(err, MI_ERRLEN, "an index of %ux%u MCUs for a frame of %ux%u", cols, rows,
                 lay->cols, lay->rows);
        return MI_BAD;
    }
    if (h.index_data_len != HEAD_LEN - MAGIC_LEN + 4 * (size_t)rows) {
        snprintf(err, MI_ERRLEN, "an index segment of %zu bytes for %u rows",
                 h.index_data_len, rows);
        return MI_BAD;
    }
    if (lay->scan_len == 0 || h.scan + 2 > n || lay->scan_len > n - h.scan - 2 ||
        d[h.scan + lay->scan_len] != 0xFF || d[h.scan + lay->scan_len + 1] != 0xD9) {
        snprintf(err, MI_ERRLEN, "the index says the scan holds %zu bytes, and no EOI follows "
                 "them", lay->scan_len);
        return MI_BAD;
    }
    lay->offsets = p + 11;
    for (r = 0; r < rows; r++) {
        size_t off = be32(lay->offsets + 4 * (size_t)r);
        size_t at = h.scan + off;
        if ((r == 0 && off != 0) || (r > 0 && (off <= prev + 2 || off >= lay->scan_len))) {
            snprintf(err, MI_ERRLEN, "MCU row %u starts at %zu, not after row %u's %zu", r, off,
                     r ? r - 1 : 0, prev);
            return MI_BAD;
        }
        /* The previous row's last interval ends with the restart marker of its number. */
        if (r > 0 && (d[at - 2] != 0xFF ||
                      d[at - 1] != 0xD0 + (((size_t)r * cols - 1) & 7))) {
            snprintf(err, MI_ERRLEN, "MCU row %u does not start after a restart marker", r);
            return MI_BAD;
        }
        prev = off;
    }
    lay->sof = h.sof;
    lay->index = h.index;
    lay->index_len = h.index_len;
    lay->scan = h.scan;
    return MI_OK;
}

size_t mi_synthetic_bound(const mi_layout *lay) {
    /* The headers without the index; at most every entropy-coded byte, a restart marker
     * more than the file has (after its last interval) and EOI. */
    return lay->scan - lay->index_len + lay->scan_len + 4;
}

/* The next restart marker in [p, lim): its offset, or (size_t)-1 when there is none; -2 with
 * err set for any other marker, or one cut off by lim. */
static size_t next_rst(const unsigned char *d, size_t p, size_t lim, char *err) {
    while (p < lim) {
        const unsigned char *q = memchr(d + p, 0xFF, lim - p);
        size_t at;
        if (q == NULL)
            return (size_t)-1;
        at = (size_t)(q - d);
        if (at + 1 >= lim) {
            snprintf(err, MI_ERRLEN, "a marker cut off at byte %zu", at);
            return (size_t)-2;
        }
        if (d[at + 1] == 0x00) { /* a stuffed 0xFF data byte */
            p = at + 2;
            continue;
        }
        if (d[at + 1] >= 0xD0 && d[at + 1] <= 0xD7)
            return at;
        snprintf(err, MI_ERRLEN, "marker FF%02X inside the scan at byte %zu", d[at + 1], at);
        return (size_t)-2;
    }
    return (size_t)-1;
}

size_t mi_synthetic(const unsigned char *d, const mi_layout *lay, unsigned r0, unsigned r1,
                    unsigned c0, unsigned c1, unsigned char *out, size_t cap, char *err) {
    size_t w = 0, head = lay->scan - lay->index_len, sof;
    unsigned k = 0, r, c;
    unsigned width = (c1 * lay->mcu_w < lay->width ? c1 * lay->mcu_w : lay->width) -
                     c0 * lay->mcu_w;
    unsigned height = (r1 * lay->mcu_h < lay->height ? r1 * lay->mcu_h : lay->height) -
                      r0 * lay->mcu_h;
    if (r0 >= r1 || r1 > lay->rows || c0 >= c1 || c1 > lay->cols || cap < head + 4) {
        snprintf(err, MI_ERRLEN, "MCUs [%u, %u) x [%u, %u) of %u x %u", r0, r1, c0, c1,
                 lay->rows, lay->cols);
        return 0;
    }
    /* The headers, less the index segment; the frame declares the rectangle's size. */
    memcpy(out, d, lay->index);
    memcpy(out + lay->index, d + lay->index + lay->index_len,
           lay->scan - lay->index - lay->index_len);
    w = head;
    sof = lay->sof < lay->index ? lay->sof : lay->sof - lay->index_len;
    put16(out + sof + 5, height);
    put16(out + sof + 7, width);
    for (r = r0; r < r1; r++) {
        size_t p = lay->scan + be32(lay->offsets + 4 * (size_t)r);
        size_t lim = r + 1 < lay->rows ? lay->scan + be32(lay->offsets + 4 * ((size_t)r + 1))
                                       : lay->scan + lay->scan_len;
        for (c = 0; c < c1; c++) {
            size_t e, next;
            if (r + 1 == lay->rows && c + 1 == lay->cols) {
                e = next = lim; /* the file's last interval ends at EOI */
            } else {
                e = next_rst(d, p, lim, err);
                if (e == (size_t)-2)
                    return 0;
                if (e == (size_t)-1) {
                    snprintf(err, MI_ERRLEN, "MCU row %u holds %u intervals, not %u", r, c,
                             lay->cols);
                    return 0;
                }
                if (d[e + 1] != 0xD0 + (((size_t)r * lay->cols + c) & 7)) {
                    snprintf(err, MI_ERRLEN, "restart marker %d after MCU (%u, %u), not %u",
                             d[e + 1] - 0xD0, r, c,
                             (unsigned)(((size_t)r * lay->cols + c) & 7));
                    return 0;
                }
                next = e + 2;
                if (c + 1 == lay->cols && next != lim) {
                    snprintf(err, MI_ERRLEN, "MCU row %u holds more than %u intervals", r,
                             lay->cols);
                    return 0;
                }
            }
            if (c >= c0) {
                int last = r + 1 == r1 && c + 1 == c1;
                if (e - p + 2 > cap - w) {
                    snprintf(err, MI_ERRLEN, "the synthetic scan outgrew its bound");
                    return 0;
                }
                memcpy(out + w, d + p, e - p);
                w += e - p;
                if (!last) {
                    out[w++] = 0xFF;
                    out[w++] = (unsigned char)(0xD0 + (k & 7));
                    k++;
                }
            }
            p = next;
        }
    }
    if (cap - w < 2) {
        snprintf(err, MI_ERRLEN, "the synthetic scan outgrew its bound");
        return 0;
    }
    out[w++] = 0xFF;
    out[w++] = 0xD9;
    return w;
}

size_t mi_make_index(const unsigned char *d, size_t n, unsigned char *seg, size_t cap,
                     size_t *sos, char *err) {
    headers h;
    mi_layout lay;
    size_t p, size, i, total;
    if (!walk(d, n, &h, err) || !sequential(&h, err))
        return 0;
    if (h.index_data != NULL) {
        snprintf(err, MI_ERRLEN, "already has an index");
        return 0;
    }
    grid(&h, &lay);
    size = mi_index_size(lay.rows);
    if (size - 2 > 0xFFFF || size > cap || lay.cols > 0xFFFF || lay.rows > 0xFFFF) {
        snprintf(err, MI_ERRLEN, "%u MCU rows: too many for an index segment", lay.rows);
        return 0;
    }
    total = (size_t)lay.cols * lay.rows;
    p = h.scan;
    for (i = 0; i < total; i++) {
        if (i % lay.cols == 0) {
            if (p - h.scan > 0xFFFFFFFFu) {
                snprintf(err, MI_ERRLEN, "a scan over 4 GiB");
                return 0;
            }
            put32(seg + 4 + HEAD_LEN + 4 * (i / lay.cols), p - h.scan);
        }
        if (i + 1 < total) {
            size_t e = next_rst(d, p, n, err);
            if (e == (size_t)-2)
                return 0;
            if (e == (size_t)-1 || d[e + 1] != 0xD0 + (i & 7)) {
                snprintf(err, MI_ERRLEN, "no restart marker %u after MCU %zu", (unsigned)(i & 7),
                         i);
                return 0;
            }
            p = e + 2;
        }
    }
    /* The last interval runs to EOI: the first marker that is not a stuffed byte. */
    for (;;) {
        const unsigned char *q = p < n ? memchr(d + p, 0xFF, n - p) : NULL;
        if (q == NULL || (size_t)(q - d) + 1 >= n) {
            snprintf(err, MI_ERRLEN, "no EOI after the scan");
            return 0;
        }
        p = (size_t)(q - d);
        if (d[p + 1] == 0x00) {
            p += 2;
            continue;
        }
        if (d[p + 1] != 0xD9) {
            snprintf(err, MI_ERRLEN, "marker FF%02X after the last MCU", d[p + 1]);
            return 0;
        }
        break;
    }
    seg[0] = 0xFF;
    seg[1] = 0xE9;
    put16(seg + 2, (unsigned)(size - 2));
    memcpy(seg + 4, MAGIC, MAGIC_LEN);
    seg[4 + MAGIC_LEN] = VERSION;
    put16(seg + 4 + MAGIC_LEN + 1, 1);
    put16(seg + 4 + MAGIC_LEN + 3, lay.cols);
    put16(seg + 4 + MAGIC_LEN + 5, lay.rows);
    put32(seg + 4 + MAGIC_LEN + 7, p - h.scan);
    *sos = h.sos;
    return size;
}
