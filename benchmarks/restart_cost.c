/* What the restart markers in a prepared crop's synthetic JPEG cost libjpeg-turbo (driven by
 * benchmarks/restart_cost.py, which writes the crops and builds this with the system cc).
 *
 * Usage: restart_cost DIR ROUNDS. DIR holds the synthetic JPEGs the extension builds for a
 * prepared file's crop (a restart marker after every MCU) and list.txt, a line per crop:
 * "FILE SCALE Y0 ROWS MCUS", the decode request on it (rows [Y0, Y0+ROWS) at SCALE/8, every
 * column), as _jpegturbo.c's decode() makes it.
 *
 * For each crop, untimed: copies of the same coefficients with no restart markers (libjpeg's
 * coefficient round trip), in two pairings. "as built": the synthetic file itself against a
 * marker-free copy with Huffman tables optimised for it (what a marker-free prepared format
 * would carry: its DC table codes differences, not absolute values, so the file's own tables
 * do not serve). "same tables": both re-encoded with libjpeg's standard tables, one with a
 * marker after every MCU, one with none (the markers' cost alone). Every copy must decode to
 * the same pixels as its pair (a checksum of the request's rows), or this exits 1.
 *
 * Timed: CPU time of decoding every crop, the two files of a pairing in alternating order
 * each round, medians of ROUNDS; both the pipeline's request and the whole synthetic image at
 * 1/8 (the IDCT a DC term, the colour conversion 1/64 of the pixels: mostly Huffman decoding).
 * And "splice": the least a marker-free synthesis would add over today's byte copy, each
 * crop's entropy-coded bytes unstuffed, shifted by 3 bits (a crop row starts anywhere in a
 * byte) and stuffed again, with no Huffman work at all. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jpeglib.h>

typedef struct {
    unsigned char *data[2];
    unsigned long len[2];
    int scale, y0, rows, mcus;
} crop;

static double cpu(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* The coefficients of src re-encoded: restart interval `restart`, libjpeg's standard
 * Huffman tables (optimize 0) or tables optimised for them (optimize 1). */
static void transcode(const unsigned char *src, unsigned long n, int restart, int optimize,
                      unsigned char **out, unsigned long *out_len) {
    struct jpeg_decompress_struct s;
    struct jpeg_compress_struct d;
    struct jpeg_error_mgr es, ed;
    jvirt_barray_ptr *coef;
    s.err = jpeg_std_error(&es);
    d.err = jpeg_std_error(&ed);
    jpeg_create_decompress(&s);
    jpeg_create_compress(&d);
    jpeg_mem_src(&s, src, n);
    jpeg_read_header(&s, TRUE);
    coef = jpeg_read_coefficients(&s);
    jpeg_copy_critical_parameters(&s, &d);
    d.optimize_coding = optimize ? TRUE : FALSE;
    d.restart_interval = (unsigned)restart;
    d.restart_in_rows = 0;
    *out = NULL;
    *out_len = 0;
    jpeg_mem_dest(&d, out, out_len);
    jpeg_write_coefficients(&d, coef);
    jpeg_finish_compress(&d);
    jpeg_destroy_compress(&d);
    jpeg_finish_decompress(&s);
    jpeg_destroy_decompress(&s);
}

static unsigned char row_buf[65536 * 3];
static volatile uint64_t sink; /* what the decodes read: nothing is optimised away */

/* Decodes as _jpegturbo.c does (ISLOW, fancy upsampling, RGB): whole = 0, the crop's request;
 * whole = 1, every row at 1/8. Returns a checksum of the rows decoded. */
static uint64_t decode(const unsigned char *p, unsigned long n, const crop *c, int whole) {
    struct jpeg_decompress_struct d;
    struct jpeg_error_mgr e;
    JSAMPROW row = row_buf;
    unsigned y0 = whole ? 0 : (unsigned)c->y0, end;
    uint64_t sum = 1469598103934665603ULL;
    d.err = jpeg_std_error(&e);
    jpeg_create_decompress(&d);
    jpeg_mem_src(&d, p, n);
    jpeg_read_header(&d, TRUE);
    d.out_color_space = JCS_EXT_RGB;
    d.scale_num = whole ? 1 : (unsigned)c->scale;
    d.scale_denom = 8;
    d.dct_method = JDCT_ISLOW;
    d.do_fancy_upsampling = TRUE;
    jpeg_start_decompress(&d);
    end = whole ? d.output_height : y0 + (unsigned)c->rows;
    if (y0 > 0)
        jpeg_skip_scanlines(&d, y0);
    while (d.output_scanline < end) {
        size_t k;
        jpeg_read_scanlines(&d, &row, 1);
        for (k = 0; k < (size_t)d.output_width * 3; k += 8)
            sum = (sum ^ row_buf[k]) * 1099511628211ULL;
    }
    jpeg_abort_decompress(&d);
    jpeg_destroy_decompress(&d);
    sink += sum;
    return sum;
}

/* The splice's floor: the entropy-coded bytes after the SOS segment unstuffed (restart
 * markers dropped), shifted by 3 bits, stuffed again. Returns the bytes written. */
static size_t splice(const unsigned char *p, size_t n, unsigned char *a, unsigned char *b) {
    size_t i = 2, na = 0, nb = 0, k;
    uint64_t acc = 0; /* the low `bits` bits not yet written */
    int bits = 3;
    while (i + 4 <= n && !(p[i] == 0xFF && p[i + 1] == 0xDA))
        i += 2 + (((size_t)p[i + 2] << 8) | p[i + 3]);
    i += 2 + (((size_t)p[i + 2] << 8) | p[i + 3]);
    while (i < n) { /* unstuff: copy runs between 0xFF bytes */
        const unsigned char *q = memchr(p + i, 0xFF, n - i);
        size_t run = q ? (size_t)(q - p) - i : n - i;
        memcpy(a + na, p + i, run);
        na += run;
        i += run;
        if (q == NULL || i + 1 >= n || p[i + 1] == 0xD9)
            break;
        if (p[i + 1] == 0x00)
            a[na++] = 0xFF;
        i += 2; /* a stuffed 0xFF, or a restart marker dropped */
    }
    /* Shift 8 bytes at a time; a word with a 0xFF byte in it is stuffed byte by byte. */
    for (k = 0; k + 8 <= na; k += 8) {
        uint64_t w, v, ff;
        int j;
        memcpy(&w, a + k, 8);
        w = __builtin_bswap64(w); /* big-endian: the stream's first bit is the top bit */
        v = (acc << (64 - bits)) | (w >> bits);
        acc = w & ((1u << bits) - 1);
        ff = ~v; /* a byte of v is 0xFF where a byte of ff is zero */
        if (((ff - 0x0101010101010101ULL) & ~ff & 0x8080808080808080ULL) == 0) {
            uint64_t be = __builtin_bswap64(v);
            memcpy(b + nb, &be, 8);
            nb += 8;
        } else {
            for (j = 0; j < 8; j++) {
                b[nb++] = (unsigned char)(v >> (56 - 8 * j));
                if (b[nb - 1] == 0xFF)
                    b[nb++] = 0x00;
            }
        }
    }
    for (; k < na; k++) /* the tail, unshifted: its cost is nothing next to the words */
        b[nb++] = a[k];
    return nb;
}

static int by_value(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return a < b ? -1 : a > b;
}

/* Median CPU seconds per pass of both files of every crop, alternating which goes first. */
static void race(crop *cs, int n, int rounds, int whole, double *t0, double *t1) {
    double *a = malloc(sizeof(double) * (size_t)rounds), *b = malloc(sizeof(double) * (size_t)rounds);
    int r, i, k;
    for (r = 0; r < rounds; r++) {
        for (k = 0; k < 2; k++) {
            int which = (r & 1) ^ k;
            double t = cpu();
            for (i = 0; i < n; i++)
                decode(cs[i].data[which], cs[i].len[which], &cs[i], whole);
            (which ? b : a)[r] = cpu() - t;
        }
    }
    qsort(a, (size_t)rounds, sizeof(double), by_value);
    qsort(b, (size_t)rounds, sizeof(double), by_value);
    *t0 = a[rounds / 2];
    *t1 = b[rounds / 2];
    free(a);
    free(b);
}

int main(int argc, char **argv) {
    char path[4096], line[1024];
    FILE *list;
    crop *built, *same;
    int n = 0, cap = 1024, rounds, i, pairing;
    long mcus = 0;
    if (argc != 3 || (rounds = atoi(argv[2])) < 1) {
        fprintf(stderr, "usage: restart_cost DIR ROUNDS\n");
        return 2;
    }
    snprintf(path, sizeof path, "%s/list.txt", argv[1]);
    if ((list = fopen(path, "r")) == NULL) {
        fprintf(stderr, "no %s\n", path);
        return 2;
    }
    built = calloc((size_t)cap, sizeof *built);
    same = calloc((size_t)cap, sizeof *same);
    while (n < cap && fgets(line, sizeof line, list)) {
        char name[256];
        FILE *f;
        crop *c = &built[n];
        if (sscanf(line, "%255s %d %d %d %d", name, &c->scale, &c->y0, &c->rows, &c->mcus) != 5)
            continue;
        snprintf(path, sizeof path, "%s/%s", argv[1], name);
        if ((f = fopen(path, "rb")) == NULL) {
            fprintf(stderr, "no %s\n", path);
            return 2;
        }
        fseek(f, 0, SEEK_END);
        c->len[0] = (unsigned long)ftell(f);
        rewind(f);
        c->data[0] = malloc(c->len[0]);
        if (fread(c->data[0], 1, c->len[0], f) != c->len[0])
            return 2;
        fclose(f);
        transcode(c->data[0], c->len[0], 0, 1, &c->data[1], &c->len[1]);
        same[n] = *c;
        transcode(c->data[0], c->len[0], 1, 0, &same[n].data[0], &same[n].len[0]);
        transcode(c->data[0], c->len[0], 0, 0, &same[n].data[1], &same[n].len[1]);
        if (decode(c->data[0], c->len[0], c, 0) != decode(c->data[1], c->len[1], c, 0) ||
            decode(c->data[0], c->len[0], c, 0) !=
                decode(same[n].data[0], same[n].len[0], c, 0) ||
            decode(c->data[0], c->len[0], c, 0) !=
                decode(same[n].data[1], same[n].len[1], c, 0)) {
            fprintf(stderr, "%s: a marker-free copy decodes to other pixels\n", name);
            return 1;
        }
        mcus += c->mcus;
        n++;
    }
    fclose(list);
    if (n == 0) {
        fprintf(stderr, "no crops in %s/list.txt\n", argv[1]);
        return 2;
    }
    printf("%d crops of %.0f MCUs on average, each decoding to the same pixels with and "
           "without markers; medians of %d rounds, CPU us per crop\n\n", n, (double)mcus / n,
           rounds);
    printf("| pairing | bytes | request: markers | no markers | ratio | whole at 1/8: markers "
           "| no markers | ratio |\n|---|---|---|---|---|---|---|---|\n");
    for (pairing = 0; pairing < 2; pairing++) {
        crop *cs = pairing ? same : built;
        double bytes0 = 0, bytes1 = 0, r0, r1, w0, w1;
        for (i = 0; i < n; i++) {
            bytes0 += (double)cs[i].len[0];
            bytes1 += (double)cs[i].len[1];
        }
        race(cs, n, rounds, 0, &r0, &r1);
        race(cs, n, rounds, 1, &w0, &w1);
        printf("| %s | %.3f | %.0f | %.0f | %.3f | %.0f | %.0f | %.3f |\n",
               pairing ? "same tables (standard)" : "as built vs optimised, no markers",
               bytes1 / bytes0, r0 / n * 1e6, r1 / n * 1e6, r1 / r0, w0 / n * 1e6,
               w1 / n * 1e6, w1 / w0);
    }
    {
        size_t most = 0, total = 0;
        unsigned char *a, *b;
        double t, best = 1e9;
        int r;
        for (i = 0; i < n; i++)
            most = built[i].len[0] > most ? built[i].len[0] : most;
        a = malloc(most);
        b = malloc(2 * most);
        for (r = 0; r < rounds; r++) {
            t = cpu();
            for (i = 0; i < n; i++)
                total += splice(built[i].data[1], built[i].len[1], a, b);
            t = cpu() - t;
            best = t < best ? t : best;
        }
        sink += total;
        printf("\nsplice floor (unstuff, shift 3 bits, stuff; no Huffman work): %.1f us per "
               "crop (best of %d)\n", best / n * 1e6, rounds);
    }
    return 0;
}
