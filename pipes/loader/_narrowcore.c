/* An int64 array copied into int32 storage in one pass, checking that every value fits
 * (pipes/loader/wire_ring.py: a batch's token ids, labels and positions cross to the training
 * process as int32). numpy needs three passes for the same: min, max, then the narrowing copy.
 * Without this module, wire_ring.py makes those three passes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* narrow(src, dst) -> bool: src a C-contiguous int64 buffer, dst a writable int32 buffer of as many
 * items. False (dst partly written) as soon as a value does not fit in int32. */
static PyObject *py_narrow(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "y*w*", &src, &dst)) return NULL;
    if (src.len % 8 != 0 || dst.len != src.len / 2) {
        PyErr_Format(PyExc_ValueError, "_narrowcore.narrow: %zd source bytes for %zd destination bytes", src.len,
                     dst.len);
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return NULL;
    }
    const int64_t *s = src.buf;
    int32_t *d = dst.buf;
    Py_ssize_t n = src.len / 8;
    int ok = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t v = s[i];
        if (v < INT32_MIN || v > INT32_MAX) {
            ok = 0;
            break;
        }
        d[i] = (int32_t)v;
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"narrow", py_narrow, METH_VARARGS, "narrow(src int64, dst int32) -> whether every value fit (then dst holds them)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_narrowcore", "int64 -> int32 in one checked pass (C).", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__narrowcore(void) { return PyModule_Create(&module); }
