/* The placement core of tokenloom's best-fit packers (see pipes/pack/core.py for the spec;
 * pipes/_packcore_py.py is the same algorithm in Python and the tests check they agree).
 *
 * Buffered documents live in slots. A slot's "next segment" is min(remaining, C) tokens.
 * Slots are indexed by next-segment length: one doubly linked list per length 1..C, each
 * ordered by document sequence number (oldest first), and a bitmap of non-empty lengths.
 * "Largest length <= space" and "smallest length > space" are word scans of the bitmap
 * (C = 2049 is 33 words), so a placement costs O(C/64) word operations, independent of the
 * buffer size. Ordering by sequence number (not insertion time) makes the index a function
 * of the buffered (seq, length, used) triples alone, which is what lets a restore rebuild
 * it exactly from a saved position.
 *
 * Only the buffer protocol is used (no numpy headers): every array is a writable
 * contiguous buffer owned by the Python side.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    int64_t *seq;
    int32_t *len, *used, *head, *tail, *next, *prev;
    uint64_t *bits;
    int C, nwords;
} Index;

static inline int32_t next_len(const Index *ix, int s) {
    int32_t r = ix->len[s] - ix->used[s];
    return r < ix->C ? r : ix->C;
}

static void ix_remove(Index *ix, int s, int L) {
    int p = ix->prev[s], n = ix->next[s];
    if (p >= 0) ix->next[p] = n; else ix->head[L] = n;
    if (n >= 0) ix->prev[n] = p; else ix->tail[L] = p;
    if (ix->head[L] < 0) ix->bits[L >> 6] &= ~(1ULL << (L & 63));
}

static void ix_insert(Index *ix, int s) {
    int L = next_len(ix, s);
    int64_t q = ix->seq[s];
    int p = ix->tail[L];
    /* New documents are the newest, so the walk from the tail is usually zero steps. */
    while (p >= 0 && ix->seq[p] > q) p = ix->prev[p];
    int n = p >= 0 ? ix->next[p] : ix->head[L];
    ix->prev[s] = p;
    ix->next[s] = n;
    if (p >= 0) ix->next[p] = s; else ix->head[L] = s;
    if (n >= 0) ix->prev[n] = s; else ix->tail[L] = s;
    ix->bits[L >> 6] |= 1ULL << (L & 63);
}

/* Largest non-empty length <= x, or -1. */
static int ix_le(const Index *ix, int x) {
    int w = x >> 6, b = x & 63;
    uint64_t m = ix->bits[w] & (b == 63 ? ~0ULL : ((1ULL << (b + 1)) - 1));
    for (;;) {
        if (m) return (w << 6) + 63 - __builtin_clzll(m);
        if (--w < 0) return -1;
        m = ix->bits[w];
    }
}

/* Smallest non-empty length > x, or -1. */
static int ix_gt(const Index *ix, int x) {
    int y = x + 1;
    if (y > ix->C) return -1;
    int w = y >> 6;
    uint64_t m = ix->bits[w] & (~0ULL << (y & 63));
    for (;;) {
        if (m) return (w << 6) + __builtin_ctzll(m);
        if (++w >= ix->nwords) return -1;
        m = ix->bits[w];
    }
}

typedef struct {
    Py_buffer b[18];
    int nb;
} Buffers;

static void release_all(Buffers *bs) {
    for (int i = 0; i < bs->nb; i++) PyBuffer_Release(&bs->b[i]);
    bs->nb = 0;
}

static void *get_buf(Buffers *bs, PyObject *o, Py_ssize_t min_bytes, const char *what) {
    Py_buffer *v = &bs->b[bs->nb];
    if (PyObject_GetBuffer(o, v, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    bs->nb++;
    if (v->len < min_bytes) {
        PyErr_Format(PyExc_ValueError, "_packcore: buffer %s has %zd bytes, needs %zd", what, v->len, min_bytes);
        return NULL;
    }
    return v->buf;
}

/* Bind the eight index buffers (seq, len, used, head, tail, next, prev, bits) for C tokens a row and at
 * least S slots (S = 0: whatever the buffers hold). 0 on success; on failure the error is set and every
 * buffer in bs is released (a later release_all of bs releases nothing). */
static int bind_index(Buffers *bs, PyObject **o, int C, Py_ssize_t S, Index *ix) {
    ix->C = C;
    ix->nwords = (C >> 6) + 1;
    if (!(ix->seq = get_buf(bs, o[0], S * 8, "seq")) || !(ix->len = get_buf(bs, o[1], S * 4, "len")) ||
        !(ix->used = get_buf(bs, o[2], S * 4, "used")) || !(ix->head = get_buf(bs, o[3], (C + 1) * 4, "head")) ||
        !(ix->tail = get_buf(bs, o[4], (C + 1) * 4, "tail")) || !(ix->next = get_buf(bs, o[5], S * 4, "next")) ||
        !(ix->prev = get_buf(bs, o[6], S * 4, "prev")) || !(ix->bits = get_buf(bs, o[7], ix->nwords * 8, "bits"))) {
        release_all(bs);
        return -1;
    }
    return 0;
}

/* Copy `take` tokens (and mask bytes) of slot s into the row at pos. */
static int copy_segment(PyObject *docs, PyObject *masks, int s, int32_t start, int32_t take, int32_t *row,
                        uint8_t *rowmask, int pos) {
    Py_buffer v;
    if (PyObject_GetBuffer(PyList_GET_ITEM(docs, s), &v, PyBUF_C_CONTIGUOUS) < 0) return -1;
    memcpy(row + pos, (int32_t *)v.buf + start, (size_t)take * sizeof(int32_t));
    PyBuffer_Release(&v);
    if (rowmask) {
        PyObject *m = masks == Py_None ? Py_None : PyList_GET_ITEM(masks, s);
        if (m == Py_None) {
            memset(rowmask + pos, 1, (size_t)take);
        } else {
            if (PyObject_GetBuffer(m, &v, PyBUF_C_CONTIGUOUS) < 0) return -1;
            memcpy(rowmask + pos, (uint8_t *)v.buf + start, (size_t)take);
            PyBuffer_Release(&v);
        }
    }
    return 0;
}

static PyObject *py_insert(PyObject *self, PyObject *args) {
    PyObject *o[8];
    int s, C;
    if (!PyArg_ParseTuple(args, "OOOOOOOOii", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &s, &C))
        return NULL;
    Buffers bs = {.nb = 0};
    Index ix;
    if (bind_index(&bs, o, C, 0, &ix) < 0) return NULL;
    if (s < 0 || (Py_ssize_t)(s + 1) * 4 > bs.b[1].len || next_len(&ix, s) < 1) {
        release_all(&bs);
        PyErr_Format(PyExc_ValueError, "_packcore.insert: slot %d is out of range or empty", s);
        return NULL;
    }
    ix_insert(&ix, s);
    release_all(&bs);
    Py_RETURN_NONE;
}

/* Insert many slots at once: insert_many(seq, len, used, head, tail, next, prev, bits, C, slots, seqs, lens, used0)
 * with the last four Python lists of ints. One call per refill instead of one per document. */
static PyObject *py_insert_many(PyObject *self, PyObject *args) {
    PyObject *o[8], *slots, *seqs, *lens, *useds;
    int C;
    if (!PyArg_ParseTuple(args, "OOOOOOOOiO!O!O!O!", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &C,
                          &PyList_Type, &slots, &PyList_Type, &seqs, &PyList_Type, &lens, &PyList_Type, &useds))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(slots);
    if (PyList_GET_SIZE(seqs) != n || PyList_GET_SIZE(lens) != n || PyList_GET_SIZE(useds) != n) {
        PyErr_SetString(PyExc_ValueError, "_packcore.insert_many: lists differ in length");
        return NULL;
    }
    Buffers bs = {.nb = 0};
    Index ix;
    if (bind_index(&bs, o, C, 0, &ix) < 0) return NULL;
    Py_ssize_t S = bs.b[1].len / 4;
    for (Py_ssize_t i = 0; i < n; i++) {
        long s = PyLong_AsLong(PyList_GET_ITEM(slots, i));
        long long q = PyLong_AsLongLong(PyList_GET_ITEM(seqs, i));
        long L = PyLong_AsLong(PyList_GET_ITEM(lens, i));
        long u = PyLong_AsLong(PyList_GET_ITEM(useds, i));
        if (PyErr_Occurred()) { release_all(&bs); return NULL; }
        if (s < 0 || s >= S || L - u < 1) {
            release_all(&bs);
            PyErr_Format(PyExc_ValueError, "_packcore.insert_many: slot %ld out of range or empty", s);
            return NULL;
        }
        ix.seq[s] = q;
        ix.len[s] = (int32_t)L;
        ix.used[s] = (int32_t)u;
        ix_insert(&ix, (int)s);
    }
    release_all(&bs);
    Py_RETURN_NONE;
}

enum { MODE_BESTFIT = 0, MODE_CROP = 1 };

/* An open slot holds a document whose next pieces are still to come (pipes/pieces.py). While it
 * has a row or less left it is parked: out of the index, so it is never placed whole into the
 * middle of a row (which would end a segment mid-document); placed as a full row or a gap cut,
 * it always ends at the row's end. Its next piece (core.py: Slots.extend) puts it back. */
#define PARKED(ix, open, s) ((open)[s] && (ix)->len[s] - (ix)->used[s] <= (ix)->C)

/* Continue one row from (pos, nseg, nfreed); see core.py for the rules.
 * The caller tops the buffer up before each call. When nothing fits and this call freed a
 * slot (so the buffer is no longer full) while upstream has not ended, it stops ("stuck")
 * so the caller can top up and call again: gaps are cut only from a full buffer.
 * Returns (segments, filled, freed, discarded, newly_cut, stuck). */
static PyObject *py_build_row(PyObject *self, PyObject *args) {
    PyObject *docs, *masks, *o[8], *row_o, *rowmask_o, *seglen_o, *segslot_o, *segoff_o, *freed_o, *forced_o, *open_o;
    int C, mode, nforced, min_fill, pos, nseg, nfreed, ended;
    if (!PyArg_ParseTuple(args, "O!OOOOOOOOOOOOOOOOOiiiiiiii", &PyList_Type, &docs, &masks, &o[0], &o[1], &o[2],
                          &o[3], &o[4], &o[5], &o[6], &o[7], &row_o, &rowmask_o, &seglen_o, &segslot_o, &segoff_o,
                          &freed_o, &forced_o, &open_o, &C, &mode, &nforced, &min_fill, &pos, &nseg, &nfreed, &ended))
        return NULL;
    if (masks != Py_None && !PyList_Check(masks)) {
        PyErr_SetString(PyExc_TypeError, "_packcore.build_row: masks must be a list or None");
        return NULL;
    }
    Buffers bs = {.nb = 0};
    Index ix;
    Py_ssize_t S = PyList_GET_SIZE(docs);
    int32_t *row, *seglen, *segslot, *segoff, *freed, *forced = NULL;
    uint8_t *rowmask = NULL, *open;
    if (bind_index(&bs, o, C, S, &ix) < 0 || !(open = get_buf(&bs, open_o, S, "open")) ||
        !(row = get_buf(&bs, row_o, C * 4, "row")) || !(seglen = get_buf(&bs, seglen_o, C * 4, "seglen")) ||
        !(segslot = get_buf(&bs, segslot_o, C * 4, "segslot")) || !(segoff = get_buf(&bs, segoff_o, C * 4, "segoff")) ||
        !(freed = get_buf(&bs, freed_o, S * 4, "freed")) ||
        (rowmask_o != Py_None && !(rowmask = get_buf(&bs, rowmask_o, C, "rowmask"))) ||
        (nforced > 0 && !(forced = get_buf(&bs, forced_o, (Py_ssize_t)nforced * 4, "forced")))) {
        release_all(&bs);
        return NULL;
    }
    if (masks != Py_None && PyList_GET_SIZE(masks) != S) {
        release_all(&bs);
        PyErr_SetString(PyExc_ValueError, "_packcore.build_row: masks and docs differ in length");
        return NULL;
    }
    long long discarded = 0, newly_cut = 0;
    int stuck = 0, nfreed0 = nfreed;
    int s = -1, f = 0;
    int32_t take = 0;
    if (pos == 0 && nseg == 0 && mode == MODE_CROP && ix.head[C] >= 0) {
        /* Crop: a document of a row or more starts a row of its own, before overdue ones. It fills
         * the row whatever else is buffered and loses its tokens beyond C anyway; started later, it
         * would only hold a slot (and, overdue, push fillers out of rows they pack better). */
        s = ix.head[C];
        take = C;
    }
    if (pos == 0 && nseg == 0 && mode == MODE_BESTFIT && nforced == 0) {
        /* Draining: a document with at least two rows' worth left gives a full row now. Its bulk
         * never waits (and costs no padding); it stays buffered with less than 2C tokens, as
         * material for filling gaps. Overdue documents go first: they bound the window a restore
         * re-reads; meanwhile long documents are only nibbled (gap cuts), and the buffer's token
         * bound stops pulling while they hold it, so they do not pile up. */
        for (int c = ix.head[C]; c >= 0; c = ix.next[c])
            if (ix.len[c] - ix.used[c] >= 2 * C) { s = c; take = C; break; }
    }
    for (;;) {
        /* The label slot: a row's last token is only the target of the input before it, so a
         * segment starting there would hold a token that is neither an input nor, after a whole
         * document, a target (the end label replaces it). Both modes leave it as padding: in crop a
         * document placed there would be cut to its BOS, a target only, and never begin (issue 42);
         * it stays whole in the buffer for a later row instead, and the row's inputs are full. */
        if (s < 0 && C - pos == 1) break;
        if (s < 0 && f < nforced) {
            /* Overdue documents, oldest first, while they fit. */
            int c = forced[f];
            if (ix.seq[c] >= 0 && !PARKED(&ix, open, c) && next_len(&ix, c) <= C - pos) {
                s = c;
                take = next_len(&ix, c);
                f++;
            } else {
                f = nforced;
                continue;
            }
        }
        if (s < 0) {
            int space = C - pos;
            if (space == 0) break;
            int L = ix_le(&ix, space);
            if (L > 0) {
                s = ix.head[L];
                take = L;
            } else if (!ended && nfreed > nfreed0) {
                stuck = 1;
                break;
            } else if (mode == MODE_BESTFIT) {
                /* Nothing fits: cut the gap off the oldest document longer than a row, which must
                 * be cut anyway; a document that fits a row is never cut. */
                if (space < min_fill) break;
                for (int c = ix.head[C]; c >= 0; c = ix.next[c])
                    if (ix.len[c] - ix.used[c] > C) { s = c; break; }
                if (s < 0) break;
                take = space;
            } else {
                /* Crop: the smallest document that does not fit loses the least. Once upstream has
                 * ended no row waits for more documents, so the gap is padded instead: every
                 * buffered document keeps its place in a later row, whole (or its first C tokens). */
                if (ended) break;
                int L2 = ix_gt(&ix, space);
                if (L2 < 0) break;
                s = ix.head[L2];
                take = space;
            }
        }
        /* place `take` tokens of slot s */
        int32_t start = ix.used[s];
        if (copy_segment(docs, masks, s, start, take, row, rowmask, pos) < 0) {
            release_all(&bs);
            return NULL;
        }
        ix_remove(&ix, s, next_len(&ix, s));
        seglen[nseg] = take;
        segslot[nseg] = s;
        segoff[nseg] = start;
        nseg++;
        pos += take;
        ix.used[s] = start + take;
        int32_t rest = ix.len[s] - ix.used[s];
        if (rest > 0 && mode == MODE_CROP) {
            discarded += rest;
            ix.used[s] = ix.len[s];
            newly_cut++;
            rest = 0;
        } else if (rest > 0 && start == 0) {
            newly_cut++;
        }
        if (rest == 0) {
            ix.seq[s] = -1;
            freed[nfreed++] = s;
        } else if (!PARKED(&ix, open, s)) {
            ix_insert(&ix, s);
        }
        s = -1;
    }
    if (pos < C && !stuck) {
        for (int i = pos; i < C; i++) row[i] = 0;
        if (rowmask) memset(rowmask + pos, 0, (size_t)(C - pos));
    }
    release_all(&bs);
    return Py_BuildValue("(iiiLLi)", nseg, pos, nfreed, discarded, newly_cut, stuck);
}

static PyMethodDef methods[] = {
    {"insert", py_insert, METH_VARARGS, "insert(seq, len, used, head, tail, next, prev, bits, slot, C)"},
    {"insert_many", py_insert_many, METH_VARARGS,
     "insert_many(seq, len, used, head, tail, next, prev, bits, C, slots, seqs, lens, used0)"},
    {"build_row", py_build_row, METH_VARARGS,
     "build_row(docs, masks, seq, len, used, head, tail, next, prev, bits, row, rowmask, seglen, segslot, segoff, freed, "
     "forced, C, mode, nforced, min_fill, pos, nseg, nfreed, ended) -> (segments, filled, freed, discarded, newly_cut, "
     "stuck)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_packcore", "Best-fit placement core (C).", -1, methods};

PyMODINIT_FUNC PyInit__packcore(void) { return PyModule_Create(&module); }
