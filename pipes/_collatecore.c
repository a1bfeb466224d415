/* The batch layout of pipes/batch.py in one pass over the rows (see its module docstring for the
 * tensors; `collate_numpy` there is the same layout in numpy, and the tests check they agree bit
 * for bit).
 *
 * Per row, each token is written once: input ids and labels from the row's tokens, segment and
 * position ids piece by piece (the row's segments, then its padding run), a boundary of
 * cu_seqlens at each piece that starts inside the inputs. numpy needs some forty calls a batch
 * for the same, each over the whole (B, T) block or a small array; here it is one loop.
 *
 * Only the buffer protocol is used (no numpy headers): the outputs are writable contiguous
 * buffers allocated by the caller. A row whose arrays are not what the packers make (int32
 * tokens, one row long; int32 or int64 segment lengths; a one-byte mask) gets None back, and the
 * caller uses numpy, which accepts any dtype; so does a row with a zero-length segment (none of
 * the packers makes one). Every piece then holds a token, so at most T pieces a row start inside
 * the inputs and cu_seqlens (B * T + 1 entries) always has room.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define IGNORE_INDEX (-100)

/* Is this buffer's format one of the one-letter struct codes `codes` (native byte order), of `itemsize` bytes
 * (a 4-byte integer is "i" or, where long is 32-bit, "l")? */
static int format_is(const Py_buffer *v, const char *codes, Py_ssize_t itemsize) {
    const char *f = v->format ? v->format : "B";
    if (*f == '@' || *f == '=') f++;
    return v->itemsize == itemsize && f[0] && !f[1] && strchr(codes, f[0]) != NULL;
}

typedef struct {
    Py_buffer tok, len, mask;
    int has_len, has_mask;
} RowBufs;

static void release_row(RowBufs *r) {
    PyBuffer_Release(&r->tok);
    if (r->has_len) PyBuffer_Release(&r->len);
    if (r->has_mask) PyBuffer_Release(&r->mask);
    r->has_len = r->has_mask = 0;
}

/* 1: bound, 0: not the packers' dtypes (the caller falls back to numpy), -1: error set. */
static int bind_row(PyObject *row, RowBufs *r, Py_ssize_t C) {
    r->has_len = r->has_mask = 0;
    if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) < 3) return 0;
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(row, 0), &r->tok, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return 0;
    }
    if (!format_is(&r->tok, "il", 4) || r->tok.ndim != 1 || r->tok.len != C * 4) {
        PyBuffer_Release(&r->tok);
        return 0;
    }
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(row, 1), &r->len, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        release_row(r);
        return 0;
    }
    r->has_len = 1;
    if (r->len.ndim != 1 || !(format_is(&r->len, "il", 4) || format_is(&r->len, "lq", 8))) {
        release_row(r);
        return 0;
    }
    PyObject *mask = PyTuple_GET_ITEM(row, 2);
    if (mask != Py_None) {
        if (PyObject_GetBuffer(mask, &r->mask, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            PyErr_Clear();
            release_row(r);
            return 0;
        }
        r->has_mask = 1;
        if (r->mask.ndim != 1 || !format_is(&r->mask, "?", 1)) {
            release_row(r);
            return 0;
        }
    }
    return 1;
}

static inline int64_t seg_len_at(const RowBufs *r, Py_ssize_t j) {
    return r->len.itemsize == 4 ? ((const int32_t *)r->len.buf)[j] : ((const int64_t *)r->len.buf)[j];
}

/* collate(rows, input_ids, labels, position_ids, segment_ids, cu_seqlens, B, T, pad_id, end_label)
 *   -> (max_seqlen, num_seqs), or None when a row's arrays are not the packers' dtypes. */
static PyObject *py_collate(PyObject *self, PyObject *args) {
    PyObject *rows, *o[5], *end_obj;
    Py_ssize_t B, T;
    long long pad_id;
    if (!PyArg_ParseTuple(args, "O!OOOOOnnLO", &PyList_Type, &rows, &o[0], &o[1], &o[2], &o[3], &o[4], &B, &T,
                          &pad_id, &end_obj))
        return NULL;
    int has_end = end_obj != Py_None;
    long long end_label = has_end ? PyLong_AsLongLong(end_obj) : 0;
    if (has_end && end_label == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t R = PyList_GET_SIZE(rows), C = T + 1;
    if (B < 1 || T < 1 || R > B) {
        PyErr_Format(PyExc_ValueError, "_collatecore: %zd rows for batch_size %zd, seq_len %zd", R, B, T);
        return NULL;
    }
    Py_buffer out[5];
    const Py_ssize_t need[5] = {B * T * 8, B * T * 8, B * T * 8, B * T * 4, (B * T + 1) * 4};
    int nout = 0;
    for (; nout < 5; nout++) {
        if (PyObject_GetBuffer(o[nout], &out[nout], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto fail_out;
        if (out[nout].len != need[nout]) {
            PyErr_Format(PyExc_ValueError, "_collatecore: output %d has %zd bytes, needs %zd", nout, out[nout].len,
                         need[nout]);
            nout++;
            goto fail_out;
        }
    }
    int64_t *ids = out[0].buf, *labels = out[1].buf, *pos = out[2].buf;
    int32_t *seg = out[3].buf, *cu = out[4].buf;
    Py_ssize_t ncu = 0;
    int64_t max_seqlen = 0;
    for (Py_ssize_t b = 0; b < B; b++) {
        int64_t *ids_b = ids + b * T, *lab_b = labels + b * T, *pos_b = pos + b * T;
        int32_t *seg_b = seg + b * T;
        if (b >= R) {  /* a padding row: one padding piece */
            for (Py_ssize_t t = 0; t < T; t++) {
                ids_b[t] = pad_id;
                lab_b[t] = IGNORE_INDEX;
                pos_b[t] = t;
                seg_b[t] = 0;
            }
            cu[ncu++] = (int32_t)(b * T);
            if (T > max_seqlen) max_seqlen = T;
            continue;
        }
        RowBufs r;
        int bound = bind_row(PyList_GET_ITEM(rows, b), &r, C);
        if (bound <= 0) {
            for (int i = 0; i < nout; i++) PyBuffer_Release(&out[i]);
            if (bound < 0) return NULL;
            Py_RETURN_NONE;
        }
        const int32_t *tok = r.tok.buf;
        const uint8_t *mask = r.has_mask ? r.mask.buf : NULL;
        Py_ssize_t nseg = r.len.shape[0];
        int64_t real = 0;
        for (Py_ssize_t j = 0; j < nseg; j++) {
            int64_t L = seg_len_at(&r, j);
            if (L == 0) {  /* no packer makes one; numpy keeps what it did with it */
                release_row(&r);
                for (int i = 0; i < nout; i++) PyBuffer_Release(&out[i]);
                Py_RETURN_NONE;
            }
            if (L < 0 || L > C - real) {
                PyErr_Format(PyExc_ValueError, "collate: row %zd has segment lengths that do not fit its %zd tokens "
                             "(segment %zd of length %lld after %lld tokens)", b, C, j, (long long)L, (long long)real);
                release_row(&r);
                goto fail_out;
            }
            real += L;
        }
        if (mask && r.mask.shape[0] < real) {
            PyErr_Format(PyExc_ValueError, "collate: row %zd has a mask of %zd entries for %lld tokens", b,
                         r.mask.shape[0], (long long)real);
            release_row(&r);
            goto fail_out;
        }
        for (Py_ssize_t t = 0; t < T; t++) {
            ids_b[t] = tok[t];
            /* the label is the next token: a target while it is real (and the mask says so) */
            lab_b[t] = (t + 1 < real && (!mask || mask[t + 1])) ? tok[t + 1] : IGNORE_INDEX;
        }
        int64_t at = 0;
        for (Py_ssize_t j = 0; j < nseg; j++) {
            int64_t L = seg_len_at(&r, j), stop = at + L < T ? at + L : T;
            for (int64_t t = at; t < stop; t++) {
                seg_b[t] = (int32_t)(j + 1);
                pos_b[t] = t - at;
            }
            if (at < T) {
                cu[ncu++] = (int32_t)(b * T + at);
                if (stop - at > max_seqlen) max_seqlen = stop - at;
            }
            /* a whole document's last token, followed by something in the row: its label (batch.py) */
            if (has_end && L > 0 && at + L - 1 < T) lab_b[at + L - 1] = end_label;
            at += L;
        }
        if (real < C) {  /* the padding run, its own sequence */
            for (int64_t t = real; t < T; t++) {
                seg_b[t] = 0;
                pos_b[t] = t - real;
            }
            if (real < T) {
                cu[ncu++] = (int32_t)(b * T + real);
                if (T - real > max_seqlen) max_seqlen = T - real;
            }
        }
        release_row(&r);
    }
    for (Py_ssize_t i = ncu; i <= B * T; i++) cu[i] = (int32_t)(B * T);
    for (int i = 0; i < nout; i++) PyBuffer_Release(&out[i]);
    return Py_BuildValue("(Ln)", (long long)max_seqlen, ncu);

fail_out:
    for (int i = 0; i < nout; i++) PyBuffer_Release(&out[i]);
    return NULL;
}

static PyMethodDef methods[] = {
    {"collate", py_collate, METH_VARARGS,
     "collate(rows, input_ids, labels, position_ids, segment_ids, cu_seqlens, B, T, pad_id, end_label) -> "
     "(max_seqlen, num_seqs), or None for rows numpy must collate"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_collatecore", "The batch layout in one pass (C).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__collatecore(void) { return PyModule_Create(&module); }
