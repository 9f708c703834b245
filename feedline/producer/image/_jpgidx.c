/* JPEG side indexes: decode a crop of an unmodified baseline JPEG by entropy-decoding only
 * the MCUs under it.
 *
 * A baseline JPEG's Huffman-coded scan can only be read from its start: each block's DC
 * coefficient is coded as the difference from the previous block's of its component, and
 * blocks start at arbitrary bits. The index records, for every MCU row and every `step`
 * MCUs within it, where that MCU starts (a bit offset into the entropy-coded bytes, stuffed
 * bytes included) and each component's DC prediction there. A rectangle of MCUs whose left
 * and right edges are entries is then a valid JPEG by itself: per MCU row, the bits from
 * the entry at its left edge to the entry at its right edge (or the next row's first),
 * realigned to a byte boundary and made one restart interval (so the predictions restart
 * at 0), with the first DC difference of each component re-coded as the difference from 0:
 * the prediction plus the difference the file has. libjpeg decodes that JPEG at any DCT
 * scale; every pixel away from its edges is the full image's. The file stays byte for byte
 * what it was: the index is a side file.
 *
 * Format (big-endian, version 2):
 *
 *   "FLJI"      4 bytes
 *   version     u8, 2
 *   step        u8, MCUs per entry within a row (1..255)
 *   ncomp       u8, components in the (one, interleaved) scan: 1..4
 *   zero        u8
 *   width       u16, height u16: the frame's
 *   sampling    4 x u8: H << 4 | V of each scan component (zero past ncomp)
 *   file_len    u32: the JPEG's size
 *   scan_off    u32: its first entropy-coded byte
 *   end_bits    u32: the bit, from scan_off, where the last MCU ends
 *   checksum    u64: XXH64 (seed 0) of the whole JPEG: an index applies to one file only
 *   entries     u32: rows x ceil(cols / step)
 *   entries x   (varint: bits since the previous entry (the first: 0), then per component
 *                a zigzag varint: its prediction minus the previous entry's)
 *   sealed      u64: XXH64 (seed 0) of the index's bytes before it: an index damaged where
 *                it is stored (a bit flipped, bytes lost) is refused, as an edited entry
 *                that passes the checks below would show other pixels
 *
 * Indexable files: one sequential Huffman scan (SOF0/SOF1) of every component, 8-bit, all
 * coefficients, no restart interval, its Huffman tables in the file, and tables that can
 * code every entry's first DC value (an optimised table may lack the category; the build
 * then says so). Anything else is JI_NOT_INDEXABLE: it decodes as it does without an index.
 *
 * Hostile input: ji_parse checks everything an index says before anything is copied: its
 * own checksum, its size (exactly its entries, nothing after), the file's checksum, frame
 * size and sampling against
 * the file's, each entry's bit after the previous one's, inside the scan and not inside a
 * stuffed byte, each prediction within what a DC value can be (|p| <= 2047), and rows
 * starting where the previous row's last entry allows. ji_synthetic then reads only inside
 * the scan and writes only inside the caller's buffer; the first MCU of each segment is
 * Huffman-decoded here (a bad code or a marker is an error) and must end inside its segment.
 * An index forged with both checksums right can make garbage pixels, never an overrun:
 * libjpeg checks the synthetic file as it checks any.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_jpgidx.h"

#include <stdio.h>
#include <string.h>

#define VERSION 2
#define HEAD 40
#define SEAL 8 /* the index's own XXH64, after its entries */
#define MAX_DC 2047 /* a baseline DC value: category 11 at most */

/* ------------------------------------------------------------------------- XXH64 */

#define P1 0x9E3779B185EBCA87ULL
#define P2 0xC2B2AE3D27D4EB4FULL
#define P3 0x165667B19E3779F9ULL
#define P4 0x85EBCA77C2B2AE63ULL
#define P5 0x27D4EB2F165667C5ULL

static uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static uint64_t le64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}

static uint64_t xround(uint64_t acc, uint64_t in) {
    acc += in * P2;
    return rotl(acc, 31) * P1;
}

static uint64_t xmerge(uint64_t acc, uint64_t v) {
    acc ^= xround(0, v);
    return acc * P1 + P4;
}

uint64_t ji_xxh64(const unsigned char *p, size_t n) {
    const unsigned char *end = p + n;
    uint64_t h;
    if (n >= 32) {
        uint64_t v1 = P1 + P2, v2 = P2, v3 = 0, v4 = (uint64_t)0 - P1;
        const unsigned char *lim = end - 32;
        do {
            v1 = xround(v1, le64(p));
            v2 = xround(v2, le64(p + 8));
            v3 = xround(v3, le64(p + 16));
            v4 = xround(v4, le64(p + 24));
            p += 32;
        } while (p <= lim);
        h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
        h = xmerge(h, v1);
        h = xmerge(h, v2);
        h = xmerge(h, v3);
        h = xmerge(h, v4);
    } else {
        h = P5;
    }
    h += (uint64_t)n;
    while (p + 8 <= end) {
        h ^= xround(0, le64(p));
        h = rotl(h, 27) * P1 + P4;
        p += 8;
    }
    if (p + 4 <= end) {
        h ^= (uint64_t)le32(p) * P1;
        h = rotl(h, 23) * P2 + P3;
        p += 4;
    }
    while (p < end) {
        h ^= (*p++) * P5;
        h = rotl(h, 11) * P1;
    }
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

/* ------------------------------------------------------------------------- bytes */

static unsigned be16(const unsigned char *p) { return ((unsigned)p[0] << 8) | p[1]; }

static uint32_t be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static void put16(unsigned char *p, unsigned v) {
    p[0] = (unsigned char)(v >> 8);
    p[1] = (unsigned char)v;
}

static void put32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

/* ------------------------------------------------------------------------- Huffman */

#define LUT_BITS 9

typedef struct {
    uint16_t lut[1 << LUT_BITS]; /* (length << 8 | symbol) of a code of <= LUT_BITS; 0: longer */
    int32_t maxcode[18];         /* the largest code of each length; -1: none */
    int32_t valoffset[18];
    unsigned char vals[256];
    uint16_t code[256]; /* the encoder's side: each symbol's code and length (0: none) */
    unsigned char size[256];
} htab;

/* libjpeg's jpeg_make_d_derived_tbl, with its checks: 1, or 0 for a table no decoder takes. */
static int make_table(const unsigned char *counts, const unsigned char *vals, unsigned nsym,
                      int dc, htab *t) {
    unsigned char sizes[257];
    unsigned codes[256];
    unsigned p = 0, l, i, code = 0, si;
    memset(t, 0, sizeof *t);
    for (l = 1; l <= 16; l++)
        for (i = 0; i < counts[l - 1]; i++)
            sizes[p++] = (unsigned char)l;
    sizes[p] = 0;
    if (p != nsym || p == 0)
        return 0;
    si = sizes[0];
    p = 0;
    while (sizes[p]) {
        while (sizes[p] == si)
            codes[p++] = code++;
        if (code >= (1u << si))
            return 0;
        code <<= 1;
        si++;
    }
    p = 0;
    for (l = 1; l <= 16; l++) {
        if (counts[l - 1]) {
            t->valoffset[l] = (int32_t)p - (int32_t)codes[p];
            p += counts[l - 1];
            t->maxcode[l] = (int32_t)codes[p - 1];
        } else {
            t->maxcode[l] = -1;
        }
    }
    t->maxcode[17] = 0x7FFFFFFF;
    memcpy(t->vals, vals, nsym);
    for (p = 0; p < nsym; p++) {
        unsigned s = vals[p];
        if (dc && s > 15)
            return 0;
        if (t->size[s] == 0) { /* a symbol listed twice keeps its first code */
            t->code[s] = (uint16_t)codes[p];
            t->size[s] = sizes[p];
        }
        if (sizes[p] <= LUT_BITS) {
            unsigned lo = codes[p] << (LUT_BITS - sizes[p]), k;
            for (k = 0; k < (1u << (LUT_BITS - sizes[p])); k++)
                t->lut[lo + k] = (uint16_t)((sizes[p] << 8) | s);
        }
    }
    return 1;
}

/* A bit reader over the entropy-coded bytes that knows each bit's position in them. */
typedef struct {
    const unsigned char *d;
    size_t len;     /* the scan's bytes */
    size_t rp;      /* the next byte to load */
    uint64_t buf;   /* left-aligned */
    int n;          /* bits in buf */
    size_t base;    /* the bit of the first loaded byte */
    size_t used;    /* data bits consumed since base (stuffed bytes not counted) */
    size_t loaded;  /* data bytes loaded, of which `real` came from the scan (the rest: 0) */
    size_t real;
    size_t ff[16];  /* data indexes of loaded 0xFF bytes (each followed by a stuffed 0x00) */
    unsigned ffh, fft;
    size_t stuffed; /* stuffed bytes before the byte that holds the next bit */
} reader;

static void r_fill(reader *r);
static void r_skip(reader *r, int k);

static void r_start(reader *r, const unsigned char *d, size_t len, size_t bit) {
    memset(r, 0, sizeof *r);
    r->d = d;
    r->len = len;
    r->rp = bit >> 3;
    r->base = bit & ~(size_t)7;
    r_fill(r);
    r_skip(r, (int)(bit & 7));
}

static void r_fill(reader *r) {
    while (r->n <= 56) {
        unsigned b = 0;
        if (r->rp < r->len && r->real == r->loaded) {
            b = r->d[r->rp];
            if (b == 0xFF) {
                if (r->rp + 1 < r->len && r->d[r->rp + 1] == 0x00) {
                    r->ff[r->fft++ & 15] = r->loaded;
                    r->rp += 2;
                    r->real++;
                } else {
                    b = 0; /* a marker: the data ends; zeros after it, as libjpeg reads */
                }
            } else {
                r->rp++;
                r->real++;
            }
        }
        r->buf |= (uint64_t)b << (56 - r->n);
        r->n += 8;
        r->loaded++;
    }
}

static unsigned r_peek(reader *r, int k) { return (unsigned)(r->buf >> (64 - k)); }

static void r_skip(reader *r, int k) {
    r->buf <<= k;
    r->n -= k;
    r->used += (size_t)k;
}

/* The next k (<= 16) bits; r_fill() must have left at least k. */
static unsigned r_bits(reader *r, int k) {
    unsigned v;
    if (k == 0)
        return 0;
    v = r_peek(r, k);
    r_skip(r, k);
    return v;
}

/* Whether every bit consumed came from the scan (not the zeros after its end). */
static int r_inside(const reader *r) { return r->used <= 8 * r->real; }

/* The bit, in the scan's bytes, that the reader reads next. */
static size_t r_pos(reader *r) {
    size_t byte = r->used >> 3;
    while (r->ffh != r->fft && r->ff[r->ffh & 15] < byte) {
        r->ffh++;
        r->stuffed++;
    }
    return r->base + r->used + 8 * r->stuffed;
}

/* A symbol; -1 for a bit pattern that is no code of t. */
static int r_huff(reader *r, const htab *t) {
    unsigned e, l;
    r_fill(r);
    e = t->lut[r_peek(r, LUT_BITS)];
    if (e) {
        r_skip(r, (int)(e >> 8));
        return (int)(e & 0xFF);
    }
    for (l = LUT_BITS + 1; l <= 16; l++) {
        int32_t code = (int32_t)r_peek(r, (int)l);
        if (code <= t->maxcode[l]) {
            r_skip(r, (int)l);
            return t->vals[(t->valoffset[l] + code) & 0xFF];
        }
    }
    return -1;
}

static int extend(unsigned v, unsigned s) {
    return s == 0 ? 0 : (v < (1u << (s - 1)) ? (int)v - (int)((1u << s) - 1) : (int)v);
}

static unsigned category(int v) {
    unsigned a = (unsigned)(v < 0 ? -v : v), s = 0;
    while (a) {
        s++;
        a >>= 1;
    }
    return s;
}

/* A bit writer that stuffs a 0x00 after every 0xFF byte it writes. */
typedef struct {
    unsigned char *o;
    size_t w, cap;
    uint64_t acc;
    int n;
    int over; /* the buffer was too small */
} writer;

static void w_byte(writer *wr, unsigned b) {
    if (wr->w + 2 > wr->cap) {
        wr->over = 1;
        return;
    }
    wr->o[wr->w++] = (unsigned char)b;
    if (b == 0xFF)
        wr->o[wr->w++] = 0x00;
}

/* Appends the low k (<= 32) bits of v. */
static void w_bits(writer *wr, uint32_t v, int k) {
    if (k == 0)
        return;
    wr->acc = (wr->acc << k) | (v & ((k == 32) ? 0xFFFFFFFFu : ((1u << k) - 1)));
    wr->n += k;
    while (wr->n >= 8) {
        wr->n -= 8;
        w_byte(wr, (unsigned)(wr->acc >> wr->n) & 0xFF);
    }
}

/* Pads to a byte with 1 bits, as an encoder does before a marker. */
static void w_pad(writer *wr) {
    if (wr->n)
        w_bits(wr, (1u << (8 - wr->n)) - 1, 8 - wr->n);
}

/* Copies the scan's bits [p, e) to the writer. 0 with err set on a marker inside them. */
static int copy_bits(writer *wr, const unsigned char *d, size_t len, size_t p, size_t e,
                     char *err) {
    size_t b = p >> 3, eb = e >> 3;
    int o = (int)(p & 7), eo = (int)(e & 7);
    if (p >= e)
        return 1;
    if (eb >= len && eo) {
        snprintf(err, JI_ERRLEN, "a segment ends past the scan");
        return 0;
    }
    if (b == eb) {
        w_bits(wr, (uint32_t)(d[b] >> (8 - eo)) & ((1u << (eo - o)) - 1), eo - o);
        return 1;
    }
    if (o) {
        w_bits(wr, d[b] & ((1u << (8 - o)) - 1), 8 - o);
        b += d[b] == 0xFF ? 2 : 1;
    }
    if (wr->n == 0 && b < eb) {
        /* Byte-aligned: the bytes as they are, their stuffing included. */
        if (wr->w + (eb - b) > wr->cap) {
            wr->over = 1;
            return 1;
        }
        memcpy(wr->o + wr->w, d + b, eb - b);
        wr->w += eb - b;
        if (d[eb - 1] == 0xFF) {
            snprintf(err, JI_ERRLEN, "a segment ends inside a stuffed byte");
            return 0;
        }
        b = eb;
    }
    while (b < eb) {
        unsigned v = d[b];
        wr->acc = (wr->acc << 8) | v;
        if (v == 0xFF) {
            if (b + 1 >= len || d[b + 1] != 0x00) {
                snprintf(err, JI_ERRLEN, "marker FF%02X inside a segment at byte %zu",
                         b + 1 < len ? d[b + 1] : 0, b);
                return 0;
            }
            b += 2;
        } else {
            b++;
        }
        w_byte(wr, (unsigned)(wr->acc >> wr->n) & 0xFF);
    }
    if (b != eb) {
        snprintf(err, JI_ERRLEN, "a segment ends inside a stuffed byte");
        return 0;
    }
    if (eo)
        w_bits(wr, (uint32_t)d[eb] >> (8 - eo), eo);
    return 1;
}

/* ------------------------------------------------------------------------- the file */

typedef struct {
    unsigned td, ta;    /* this scan component's tables: DC, AC */
    unsigned h, v;      /* sampling */
    unsigned first, nb; /* its first block in an MCU, and how many */
} comp;

typedef struct {
    htab t[2][4]; /* [DC, AC][id] */
    int have[2][4];
    comp c[4];
    unsigned ncomp, blocks; /* scan components; blocks per MCU */
    unsigned width, height, mcu_w, mcu_h, cols, rows;
    size_t sof, sos, scan, sos_len;
    size_t app0, app0_len, app14, app14_len; /* the segments that set the colour space */
    size_t dqt[4], dqt_len[4];
    unsigned ndqt;
    size_t dht[32], dht_len[32];
    unsigned ndht;
} frame;

/* Reads the headers to the first scan. JI_OK, JI_NOT_INDEXABLE or JI_BAD (err says why). */
static int read_frame(const unsigned char *d, size_t n, frame *f, char *err) {
    size_t pos = 2;
    unsigned fc[4], fid[4], nfc = 0, i, restart = 0;
    int sof_kind = 0;
    memset(f, 0, sizeof *f);
    if (n < 4 || d[0] != 0xFF || d[1] != 0xD8) {
        snprintf(err, JI_ERRLEN, "not a JPEG (no SOI marker)");
        return JI_BAD;
    }
    for (;;) {
        unsigned m, len;
        const unsigned char *seg;
        if (pos + 4 > n) {
            snprintf(err, JI_ERRLEN, "the file ends at byte %zu, before its scan", n);
            return JI_BAD;
        }
        if (d[pos] != 0xFF) {
            snprintf(err, JI_ERRLEN, "no marker at byte %zu", pos);
            return JI_BAD;
        }
        m = d[pos + 1];
        if (m == 0xFF) {
            pos++;
            continue;
        }
        if (m == 0x00 || m == 0x01 || m == 0xD8 || m == 0xD9 || (m >= 0xD0 && m <= 0xD7)) {
            snprintf(err, JI_ERRLEN, "marker FF%02X at byte %zu where a segment belongs", m,
                     pos);
            return JI_BAD;
        }
        len = be16(d + pos + 2);
        if (len < 2 || pos + 2 + len > n) {
            snprintf(err, JI_ERRLEN, "segment FF%02X at byte %zu runs past the file", m, pos);
            return JI_BAD;
        }
        seg = d + pos + 4;
        if (m == 0xC4) { /* DHT: one or more tables */
            size_t q = 0, plen = len - 2;
            if (f->ndht == 32) {
                snprintf(err, JI_ERRLEN, "more than 32 DHT segments");
                return JI_NOT_INDEXABLE;
            }
            f->dht[f->ndht] = pos;
            f->dht_len[f->ndht++] = 2 + (size_t)len;
            while (q < plen) {
                unsigned tc, th, nsym = 0, l;
                if (q + 17 > plen) {
                    snprintf(err, JI_ERRLEN, "a DHT segment cut short");
                    return JI_BAD;
                }
                tc = seg[q] >> 4;
                th = seg[q] & 15;
                for (l = 0; l < 16; l++)
                    nsym += seg[q + 1 + l];
                if (tc > 1 || th > 3 || nsym > 256 || q + 17 + nsym > plen ||
                    !make_table(seg + q + 1, seg + q + 17, nsym, tc == 0, &f->t[tc][th])) {
                    snprintf(err, JI_ERRLEN, "a bad Huffman table");
                    return JI_BAD;
                }
                f->have[tc][th] = 1;
                q += 17 + nsym;
            }
        } else if (m == 0xDB) {
            if (f->ndqt == 4) {
                snprintf(err, JI_ERRLEN, "more than 4 DQT segments");
                return JI_NOT_INDEXABLE;
            }
            f->dqt[f->ndqt] = pos;
            f->dqt_len[f->ndqt++] = 2 + (size_t)len;
        } else if (m == 0xE0 && f->app0_len == 0) {
            f->app0 = pos;
            f->app0_len = 2 + (size_t)len;
        } else if (m == 0xEE && f->app14_len == 0) {
            f->app14 = pos;
            f->app14_len = 2 + (size_t)len;
        } else if (m == 0xDD) {
            if (len != 4) {
                snprintf(err, JI_ERRLEN, "a DRI segment of %u bytes", len);
                return JI_BAD;
            }
            restart = be16(seg);
        } else if (m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC) {
            if (sof_kind) {
                snprintf(err, JI_ERRLEN, "two frame headers");
                return JI_BAD;
            }
            sof_kind = (m == 0xC0 || m == 0xC1) ? 1 : 2;
            f->sof = pos;
            if (len < 8) {
                snprintf(err, JI_ERRLEN, "a frame header of %u bytes", len);
                return JI_BAD;
            }
            if (sof_kind != 1 || seg[0] != 8) {
                snprintf(err, JI_ERRLEN, "%s", sof_kind != 1
                         ? "not a baseline JPEG (progressive, lossless or arithmetic-coded)"
                         : "not an 8-bit JPEG");
                return JI_NOT_INDEXABLE;
            }
            f->height = be16(seg + 1);
            f->width = be16(seg + 3);
            nfc = seg[5];
            if (nfc < 1 || nfc > 4 || len != 8 + 3 * nfc) {
                snprintf(err, JI_ERRLEN, "a frame header of %u components in %u bytes", nfc,
                         len);
                return JI_BAD;
            }
            for (i = 0; i < nfc; i++) {
                fid[i] = seg[6 + 3 * i];
                fc[i] = seg[7 + 3 * i];
                if ((fc[i] >> 4) < 1 || (fc[i] >> 4) > 4 || (fc[i] & 15) < 1 ||
                    (fc[i] & 15) > 4) {
                    snprintf(err, JI_ERRLEN, "sampling factors %ux%u", fc[i] >> 4, fc[i] & 15);
                    return JI_BAD;
                }
            }
        } else if (m == 0xDA) {
            unsigned ns, hmax = 1, vmax = 1, blocks = 0, k;
            if (!sof_kind) {
                snprintf(err, JI_ERRLEN, "no frame header before the scan");
                return JI_BAD;
            }
            if (len < 6 || len != 6 + 2 * (unsigned)seg[0]) {
                snprintf(err, JI_ERRLEN, "an SOS segment of %u bytes", len);
                return JI_BAD;
            }
            ns = seg[0];
            if (ns != nfc || seg[len - 5] != 0 || seg[len - 4] != 63 || seg[len - 3] != 0) {
                snprintf(err, JI_ERRLEN, "not one scan of every component");
                return JI_NOT_INDEXABLE;
            }
            if (restart) {
                snprintf(err, JI_ERRLEN, "it has restart markers (an interval of %u MCUs)",
                         restart);
                return JI_NOT_INDEXABLE;
            }
            if (f->width == 0 || f->height == 0) {
                snprintf(err, JI_ERRLEN, "a frame of %ux%u pixels", f->width, f->height);
                return JI_BAD;
            }
            for (i = 0; i < nfc; i++) {
                hmax = (fc[i] >> 4) > hmax ? fc[i] >> 4 : hmax;
                vmax = (fc[i] & 15) > vmax ? fc[i] & 15 : vmax;
            }
            for (k = 0; k < ns; k++) {
                unsigned id = seg[1 + 2 * k], td = seg[2 + 2 * k] >> 4, ta = seg[2 + 2 * k] & 15;
                for (i = 0; i < nfc && fid[i] != id; i++)
                    ;
                if (i == nfc || td > 3 || ta > 3) {
                    snprintf(err, JI_ERRLEN, "a scan component the frame does not have");
                    return JI_BAD;
                }
                if (!f->have[0][td] || !f->have[1][ta]) {
                    snprintf(err, JI_ERRLEN, "it uses Huffman tables it does not define");
                    return JI_NOT_INDEXABLE;
                }
                f->c[k].td = td;
                f->c[k].ta = ta;
                f->c[k].h = ns == 1 ? 1 : fc[i] >> 4;
                f->c[k].v = ns == 1 ? 1 : fc[i] & 15;
                f->c[k].first = blocks;
                f->c[k].nb = f->c[k].h * f->c[k].v;
                blocks += f->c[k].nb;
            }
            if (blocks > 10) {
                snprintf(err, JI_ERRLEN, "%u blocks per MCU", blocks);
                return JI_BAD;
            }
            f->ncomp = ns;
            f->blocks = blocks;
            f->mcu_w = ns == 1 ? 8 : 8 * hmax;
            f->mcu_h = ns == 1 ? 8 : 8 * vmax;
            f->cols = (f->width + f->mcu_w - 1) / f->mcu_w;
            f->rows = (f->height + f->mcu_h - 1) / f->mcu_h;
            f->sos = pos;
            f->sos_len = 2 + (size_t)len;
            f->scan = pos + 2 + len;
            return JI_OK;
        }
        pos += 2 + (size_t)len;
    }
}

/* Where the scan's entropy-coded bytes end: the first marker that is not a stuffed byte. */
static size_t scan_end(const unsigned char *d, size_t n, size_t scan) {
    size_t p = scan;
    while (p < n) {
        const unsigned char *q = memchr(d + p, 0xFF, n - p);
        if (q == NULL)
            return n;
        p = (size_t)(q - d);
        if (p + 1 < n && d[p + 1] == 0x00) {
            p += 2;
            continue;
        }
        return p;
    }
    return n;
}

/* Decodes one MCU's Huffman codes (the bits libjpeg's decoder reads), updating pred; with
 * first_dc, each component's first DC value. 1, or 0 with err set. */
static int skip_mcu(reader *r, const frame *f, int *pred, int *first_dc, char *err) {
    unsigned ci, b, k;
    for (ci = 0; ci < f->ncomp; ci++) {
        const comp *c = &f->c[ci];
        const htab *dc = &f->t[0][c->td], *ac = &f->t[1][c->ta];
        for (b = 0; b < c->nb; b++) {
            int s = r_huff(r, dc);
            if (s < 0 || s > 11) {
                snprintf(err, JI_ERRLEN, s < 0 ? "a bad Huffman code" : "a DC category over 11");
                return 0;
            }
            r_fill(r);
            pred[ci] += extend(r_bits(r, s), (unsigned)s);
            if (b == 0 && first_dc != NULL)
                first_dc[ci] = pred[ci];
            for (k = 1; k < 64; k++) {
                int rs = r_huff(r, ac);
                unsigned rr, ss;
                if (rs < 0) {
                    snprintf(err, JI_ERRLEN, "a bad Huffman code");
                    return 0;
                }
                rr = (unsigned)rs >> 4;
                ss = (unsigned)rs & 15;
                if (ss) {
                    k += rr;
                    r_fill(r);
                    r_skip(r, (int)ss);
                } else {
                    if (rr != 15)
                        break;
                    k += 15;
                }
            }
        }
    }
    if (!r_inside(r)) {
        snprintf(err, JI_ERRLEN, "the scan ends before its last MCU");
        return 0;
    }
    return 1;
}

static size_t put_varint(unsigned char *o, uint32_t v) {
    size_t n = 0;
    while (v >= 0x80) {
        o[n++] = (unsigned char)(v | 0x80);
        v >>= 7;
    }
    o[n++] = (unsigned char)v;
    return n;
}

static uint32_t zigzag(int v) { return v < 0 ? ((uint32_t)(-v) << 1) - 1 : (uint32_t)v << 1; }

int ji_build(const unsigned char *d, size_t n, unsigned step, unsigned char **out,
             size_t *out_len, char *err) {
    frame f;
    reader r;
    unsigned row, col, ci, per_row;
    size_t entries, w, end, cap;
    int pred[4] = {0, 0, 0, 0}, first[4], prev_pred[4] = {0, 0, 0, 0};
    size_t prev_bit = 0;
    unsigned char *o;
    int got = read_frame(d, n, &f, err);
    *out = NULL;
    if (got != JI_OK)
        return got;
    if (step < 1 || step > 255) {
        snprintf(err, JI_ERRLEN, "step %u: must be 1..255", step);
        return JI_BAD;
    }
    if (n > 0xFFFFFFFFu) {
        snprintf(err, JI_ERRLEN, "a file over 4 GiB");
        return JI_NOT_INDEXABLE;
    }
    end = scan_end(d, n, f.scan);
    if (end + 1 >= n || d[end + 1] != 0xD9) {
        snprintf(err, JI_ERRLEN, "no EOI right after the scan (more scans, or cut short)");
        return end >= n ? JI_BAD : JI_NOT_INDEXABLE;
    }
    if ((end - f.scan) > 0x1FFFFFFFu) {
        snprintf(err, JI_ERRLEN, "a scan over 512 MiB");
        return JI_NOT_INDEXABLE;
    }
    per_row = (f.cols + step - 1) / step;
    entries = (size_t)per_row * f.rows;
    /* Each entry: at most 5 bytes of bits, 3 per prediction (|delta| <= 4094). */
    cap = HEAD + entries * (5 + 3 * (size_t)f.ncomp) + SEAL;
    o = PyMem_RawMalloc(cap);
    if (o == NULL) {
        snprintf(err, JI_ERRLEN, "no memory for an index of %zu bytes", cap);
        return JI_BAD;
    }
    w = HEAD;
    r_start(&r, d + f.scan, end - f.scan, 0);
    for (row = 0; row < f.rows; row++) {
        for (col = 0; col < f.cols; col++) {
            int entry = col % step == 0;
            size_t bit = 0;
            if (entry) {
                bit = r_pos(&r);
                w += put_varint(o + w, (uint32_t)(bit - prev_bit));
                for (ci = 0; ci < f.ncomp; ci++) {
                    w += put_varint(o + w, zigzag(pred[ci] - prev_pred[ci]));
                    prev_pred[ci] = pred[ci];
                }
                prev_bit = bit;
            }
            if (!skip_mcu(&r, &f, pred, first, err)) {
                char why[JI_ERRLEN];
                memcpy(why, err, JI_ERRLEN);
                snprintf(err, JI_ERRLEN, "%s in MCU (%u, %u)", why, row, col);
                PyMem_RawFree(o);
                return JI_BAD;
            }
            for (ci = 0; entry && ci < f.ncomp; ci++) {
                const htab *t = &f.t[0][f.c[ci].td];
                unsigned cat = category(first[ci]);
                if (first[ci] > MAX_DC || first[ci] < -MAX_DC || t->size[cat] == 0) {
                    snprintf(err, JI_ERRLEN, "its Huffman table cannot code DC value %d "
                             "(category %u) where a segment would start", first[ci], cat);
                    PyMem_RawFree(o);
                    return JI_NOT_INDEXABLE;
                }
            }
        }
    }
    memcpy(o, "FLJI", 4);
    o[4] = VERSION;
    o[5] = (unsigned char)step;
    o[6] = (unsigned char)f.ncomp;
    o[7] = 0;
    put16(o + 8, f.width);
    put16(o + 10, f.height);
    for (ci = 0; ci < 4; ci++)
        o[12 + ci] = ci < f.ncomp ? (unsigned char)(f.c[ci].h << 4 | f.c[ci].v) : 0;
    put32(o + 16, (uint32_t)n);
    put32(o + 20, (uint32_t)f.scan);
    put32(o + 24, (uint32_t)r_pos(&r));
    {
        uint64_t h = ji_xxh64(d, n);
        put32(o + 28, (uint32_t)(h >> 32));
        put32(o + 32, (uint32_t)h);
    }
    put32(o + 36, (uint32_t)entries);
    *out = o;
    *out_len = w + SEAL;
    ji_seal(o, w + SEAL);
    return JI_OK;
}

void ji_seal(unsigned char *idx, size_t len) {
    uint64_t h = ji_xxh64(idx, len - SEAL);
    put32(idx + len - SEAL, (uint32_t)(h >> 32));
    put32(idx + len - SEAL + 4, (uint32_t)h);
}

/* ------------------------------------------------------------------------- decoding */

static int get_varint(const unsigned char *p, size_t n, size_t *at, uint32_t *v) {
    uint32_t x = 0;
    int sh = 0;
    while (*at < n && sh <= 28) {
        unsigned b = p[(*at)++];
        x |= (uint32_t)(b & 0x7F) << sh;
        if (!(b & 0x80)) {
            *v = x;
            return 1;
        }
        sh += 7;
    }
    return 0;
}

void ji_free(ji_index *ix) {
    PyMem_RawFree(ix->bits);
    PyMem_RawFree(ix->preds);
    PyMem_RawFree(ix->head);
    PyMem_RawFree(ix->tables);
    memset(ix, 0, sizeof *ix);
}

/* Whether bit b of the scan can start an MCU: inside it, not inside a stuffed byte. */
static int data_bit(const unsigned char *s, size_t len, size_t b) {
    size_t byte = b >> 3;
    return byte < len && !(byte > 0 && s[byte - 1] == 0xFF);
}

int ji_parse(const unsigned char *d, size_t n, const unsigned char *idx, size_t idx_len,
             ji_index *ix, char *err) {
    frame f;
    unsigned ci, step, per_row, i;
    uint32_t entries;
    size_t at = HEAD, end, prev = 0, hl;
    int pred[4] = {0, 0, 0, 0};
    uint64_t h;
    int got;
    memset(ix, 0, sizeof *ix);
    if (idx_len < HEAD || memcmp(idx, "FLJI", 4) != 0) {
        snprintf(err, JI_ERRLEN, "not a JPEG index (%zu bytes, no FLJI header)", idx_len);
        return JI_BAD;
    }
    if (idx[4] != VERSION) {
        snprintf(err, JI_ERRLEN, "index version %u (this reads version %d): rebuild it", idx[4],
                 VERSION);
        return JI_BAD;
    }
    if (idx_len < HEAD + SEAL) {
        snprintf(err, JI_ERRLEN, "the index is cut short (%zu bytes)", idx_len);
        return JI_BAD;
    }
    h = ji_xxh64(idx, idx_len - SEAL);
    if (be32(idx + idx_len - SEAL) != (uint32_t)(h >> 32) ||
        be32(idx + idx_len - SEAL + 4) != (uint32_t)h) {
        snprintf(err, JI_ERRLEN, "the index's own checksum does not match: it is damaged "
                 "(cut short, edited or a bit flipped)");
        return JI_BAD;
    }
    idx_len -= SEAL; /* the entries end where the seal starts */
    if (be32(idx + 16) != n) {
        snprintf(err, JI_ERRLEN, "the index is of a file of %u bytes, this one has %zu: "
                 "another file's index", be32(idx + 16), n);
        return JI_BAD;
    }
    h = ji_xxh64(d, n);
    if (be32(idx + 28) != (uint32_t)(h >> 32) || be32(idx + 32) != (uint32_t)h) {
        snprintf(err, JI_ERRLEN, "the index's checksum is not this file's: another file's "
                 "index, or the file changed");
        return JI_BAD;
    }
    got = read_frame(d, n, &f, err);
    if (got != JI_OK)
        return JI_BAD;
    step = idx[5];
    if (step == 0 || idx[6] != f.ncomp || be16(idx + 8) != f.width ||
        be16(idx + 10) != f.height || be32(idx + 20) != f.scan) {
        snprintf(err, JI_ERRLEN, "the index's frame (%ux%u, %u components, step %u) is not "
                 "the file's (%ux%u, %u)", be16(idx + 8), be16(idx + 10), idx[6], step,
                 f.width, f.height, f.ncomp);
        return JI_BAD;
    }
    for (ci = 0; ci < 4; ci++) {
        unsigned s = ci < f.ncomp ? (f.c[ci].h << 4 | f.c[ci].v) : 0;
        if (idx[12 + ci] != s) {
            snprintf(err, JI_ERRLEN, "the index's sampling is not the file's");
            return JI_BAD;
        }
    }
    end = scan_end(d, n, f.scan);
    ix->scan = d + f.scan;
    ix->scan_len = end - f.scan;
    ix->end_bits = be32(idx + 24);
    per_row = (f.cols + step - 1) / step;
    entries = be32(idx + 36);
    if (entries != (uint64_t)per_row * f.rows) {
        snprintf(err, JI_ERRLEN, "the index has %u entries, the file's %ux%u MCUs at step %u "
                 "need %u", entries, f.cols, f.rows, step, per_row * f.rows);
        return JI_BAD;
    }
    if (ix->end_bits == 0 || (ix->end_bits + 7) / 8 > ix->scan_len ||
        (ix->end_bits >> 3 > 0 && ix->scan[(ix->end_bits >> 3) - 1] == 0xFF)) {
        snprintf(err, JI_ERRLEN, "the index's scan end (bit %u) is outside the scan of %zu "
                 "bytes", ix->end_bits, ix->scan_len);
        return JI_BAD;
    }
    ix->bits = PyMem_RawMalloc(sizeof(uint32_t) * entries);
    ix->preds = PyMem_RawMalloc(sizeof(int16_t) * entries * f.ncomp);
    ix->tables = PyMem_RawMalloc(sizeof f);
    if (ix->bits == NULL || ix->preds == NULL || ix->tables == NULL) {
        ji_free(ix);
        snprintf(err, JI_ERRLEN, "no memory for an index of %u entries", entries);
        return JI_BAD;
    }
    for (i = 0; i < entries; i++) {
        uint32_t v;
        size_t bit;
        if (!get_varint(idx, idx_len, &at, &v)) {
            ji_free(ix);
            snprintf(err, JI_ERRLEN, "the index is cut short at entry %u of %u", i, entries);
            return JI_BAD;
        }
        bit = prev + v;
        /* Entry 0 is the scan's first bit; every other starts after the one before (an MCU
         * is at least 2 bits a block), inside the scan, before its end. */
        if ((i == 0 && v != 0) || (i > 0 && v < 2) || bit >= ix->end_bits ||
            !data_bit(ix->scan, ix->scan_len, bit)) {
            snprintf(err, JI_ERRLEN, "index entry %u at bit %zu: not after entry %u's %zu, "
                     "inside the scan's %u bits", i, bit, i ? i - 1 : 0, prev, ix->end_bits);
            ji_free(ix); /* after the message: it clears ix */
            return JI_BAD;
        }
        ix->bits[i] = (uint32_t)bit;
        prev = bit;
        for (ci = 0; ci < f.ncomp; ci++) {
            uint32_t z = 0; /* read by the message when the varint is cut short */
            int dv;
            if (!get_varint(idx, idx_len, &at, &z) || z > 8190) {
                ji_free(ix);
                snprintf(err, JI_ERRLEN, z > 8190 ? "index entry %u: a DC prediction out of "
                         "range" : "the index is cut short at entry %u", i);
                return JI_BAD;
            }
            dv = (z & 1) ? -(int)((z + 1) >> 1) : (int)(z >> 1);
            pred[ci] += dv;
            if ((i == 0 && pred[ci] != 0) || pred[ci] > MAX_DC || pred[ci] < -MAX_DC) {
                ji_free(ix);
                snprintf(err, JI_ERRLEN, "index entry %u: DC prediction %d out of range", i,
                         pred[ci]);
                return JI_BAD;
            }
            ix->preds[(size_t)i * f.ncomp + ci] = (int16_t)pred[ci];
        }
    }
    if (at != idx_len) {
        ji_free(ix);
        snprintf(err, JI_ERRLEN, "%zu bytes after the index's last entry", idx_len - at);
        return JI_BAD;
    }
    /* The synthetic file's headers: SOI, JFIF/Adobe (they say the colour space), DQT, DHT,
     * SOF, a DRI whose interval ji_synthetic sets, SOS. EXIF, ICC and the rest stay out. */
    hl = 2 + f.app0_len + f.app14_len + 6 + f.sos_len + (2 + 8 + 3 * 4);
    for (i = 0; i < f.ndqt; i++)
        hl += f.dqt_len[i];
    for (i = 0; i < f.ndht; i++)
        hl += f.dht_len[i];
    ix->head = PyMem_RawMalloc(hl);
    if (ix->head == NULL) {
        ji_free(ix);
        snprintf(err, JI_ERRLEN, "no memory for %zu bytes", hl);
        return JI_BAD;
    }
    {
        unsigned char *o = ix->head;
        size_t w = 0, sof_len = 2 + (size_t)be16(d + f.sof + 2);
        o[w++] = 0xFF;
        o[w++] = 0xD8;
        memcpy(o + w, d + f.app0, f.app0_len);
        w += f.app0_len;
        memcpy(o + w, d + f.app14, f.app14_len);
        w += f.app14_len;
        for (i = 0; i < f.ndqt; i++) {
            memcpy(o + w, d + f.dqt[i], f.dqt_len[i]);
            w += f.dqt_len[i];
        }
        for (i = 0; i < f.ndht; i++) {
            memcpy(o + w, d + f.dht[i], f.dht_len[i]);
            w += f.dht_len[i];
        }
        ix->sof = w;
        memcpy(o + w, d + f.sof, sof_len);
        w += sof_len;
        o[w++] = 0xFF;
        o[w++] = 0xDD;
        put16(o + w, 4);
        ix->dri = w + 2;
        w += 4;
        memcpy(o + w, d + f.sos, f.sos_len);
        w += f.sos_len;
        ix->head_len = w;
    }
    memcpy(ix->tables, &f, sizeof f);
    ix->width = f.width;
    ix->height = f.height;
    ix->ncomp = f.ncomp;
    ix->step = step;
    ix->mcu_w = f.mcu_w;
    ix->mcu_h = f.mcu_h;
    ix->cols = f.cols;
    ix->rows = f.rows;
    ix->per_row = per_row;
    return JI_OK;
}

size_t ji_synthetic_bound(const ji_index *ix) {
    /* Realigned, every byte might become 0xFF 0x00; a re-coded DC is at most 27 bits;
     * padding and a restart marker per row; EOI. */
    return ix->head_len + 2 * ix->scan_len + (size_t)ix->rows * (8 + 4 * ix->ncomp) + 16;
}

/* Writes one segment: the MCUs from the scan's bit p to bit e, their first DC differences
 * re-coded against predictions of 0 from the entry's (pred). */
static int segment(writer *wr, const ji_index *ix, size_t p, size_t e, const int16_t *pred,
                   char *err) {
    const frame *f = (const frame *)ix->tables;
    reader r;
    unsigned ci, b, k;
    r_start(&r, ix->scan, ix->scan_len, p);
    for (ci = 0; ci < f->ncomp; ci++) {
        const comp *c = &f->c[ci];
        const htab *dc = &f->t[0][c->td], *ac = &f->t[1][c->ta];
        for (b = 0; b < c->nb; b++) {
            int s = r_huff(&r, dc), v;
            unsigned bits;
            if (s < 0 || s > 11) {
                snprintf(err, JI_ERRLEN, "a bad DC code at bit %zu", p);
                return 0;
            }
            r_fill(&r);
            bits = r_bits(&r, s);
            if (b == 0) {
                unsigned cat;
                v = pred[ci] + extend(bits, (unsigned)s);
                cat = category(v);
                if (v > MAX_DC || v < -MAX_DC || dc->size[cat] == 0) {
                    snprintf(err, JI_ERRLEN, "DC value %d cannot be coded", v);
                    return 0;
                }
                w_bits(wr, dc->code[cat], dc->size[cat]);
                w_bits(wr, (uint32_t)(v < 0 ? v - 1 : v), (int)cat);
            } else {
                w_bits(wr, dc->code[s], dc->size[s]);
                w_bits(wr, bits, s);
            }
            for (k = 1; k < 64; k++) {
                int rs = r_huff(&r, ac);
                unsigned rr, ss;
                if (rs < 0) {
                    snprintf(err, JI_ERRLEN, "a bad AC code after bit %zu", p);
                    return 0;
                }
                w_bits(wr, ac->code[rs], ac->size[rs]);
                rr = (unsigned)rs >> 4;
                ss = (unsigned)rs & 15;
                if (ss) {
                    k += rr;
                    r_fill(&r);
                    w_bits(wr, r_bits(&r, (int)ss), (int)ss);
                } else {
                    if (rr != 15)
                        break;
                    k += 15;
                }
            }
        }
    }
    {
        size_t at = r_pos(&r);
        if (!r_inside(&r) || at > e) {
            snprintf(err, JI_ERRLEN, "the MCU at bit %zu runs past its segment's end %zu", p, e);
            return 0;
        }
        return copy_bits(wr, ix->scan, ix->scan_len, at, e, err);
    }
}

size_t ji_synthetic(const ji_index *ix, unsigned r0, unsigned r1, unsigned c0, unsigned c1,
                    unsigned char *out, size_t cap, char *err) {
    writer wr;
    unsigned r, k = 0;
    unsigned width = (c1 * ix->mcu_w < ix->width ? c1 * ix->mcu_w : ix->width) - c0 * ix->mcu_w;
    unsigned height = (r1 * ix->mcu_h < ix->height ? r1 * ix->mcu_h : ix->height) -
                      r0 * ix->mcu_h;
    if (r0 >= r1 || r1 > ix->rows || c0 >= c1 || c1 > ix->cols || c0 % ix->step ||
        (c1 != ix->cols && c1 % ix->step) || cap < ix->head_len + 4) {
        snprintf(err, JI_ERRLEN, "MCUs [%u, %u) x [%u, %u) of %u x %u at step %u", r0, r1, c0,
                 c1, ix->rows, ix->cols, ix->step);
        return 0;
    }
    memcpy(out, ix->head, ix->head_len);
    put16(out + ix->sof + 5, height);
    put16(out + ix->sof + 7, width);
    put16(out + ix->dri, c1 - c0);
    memset(&wr, 0, sizeof wr);
    wr.o = out;
    wr.w = ix->head_len;
    wr.cap = cap;
    for (r = r0; r < r1; r++) {
        size_t at = (size_t)r * ix->per_row + c0 / ix->step;
        size_t p = ix->bits[at], e;
        if (c1 < ix->cols)
            e = ix->bits[(size_t)r * ix->per_row + c1 / ix->step];
        else
            e = r + 1 < ix->rows ? ix->bits[(size_t)(r + 1) * ix->per_row] : ix->end_bits;
        if (!segment(&wr, ix, p, e, ix->preds + at * ix->ncomp, err))
            return 0;
        w_pad(&wr);
        if (r + 1 < r1) {
            if (wr.w + 2 > cap) {
                wr.over = 1;
                break;
            }
            out[wr.w++] = 0xFF;
            out[wr.w++] = (unsigned char)(0xD0 + (k++ & 7));
        }
        if (wr.over)
            break;
    }
    if (wr.over || wr.w + 2 > cap) {
        snprintf(err, JI_ERRLEN, "the synthetic scan outgrew its bound");
        return 0;
    }
    out[wr.w++] = 0xFF;
    out[wr.w++] = 0xD9;
    return wr.w;
}
