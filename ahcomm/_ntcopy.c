/* ahcomm._ntcopy: a copy whose stores bypass the cache (non-temporal), for a collective's large
 * output that nobody reads soon. glibc's memmove uses such stores only from a size fixed at
 * process start (x86_non_temporal_threshold: 181 MiB on a 2-core Intel VM); below it a cold
 * destination line is read into the cache before it is written. Measured there, 32 MiB from a
 * cold source to a cold destination: 11.8 GB/s against numpy.copyto's 7.0
 * (benchmarks/results/2026-11-26-nt-stores.md).
 *
 * copy(dst_address, src_address, nbytes): no overlap; the GIL is released for the copy.
 * NON_TEMPORAL: 1 where this build has the stores (x86-64's SSE2), else 0 and copy is memcpy.
 * Optional: where it does not build, ahcomm copies with numpy (ahcomm/_memcopy.py). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#define NON_TEMPORAL 1

static void nt_copy(char *d, const char *s, size_t n)
{
    size_t head = (64 - ((uintptr_t)d & 63)) & 63; /* whole cache lines (the stores need 16 bytes) */
    if (head > n)
        head = n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t lines = n / 64;
    for (size_t i = 0; i < lines; i++, s += 64, d += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
    _mm_sfence(); /* the stores are visible before anything this thread does next */
    memcpy(d, s, n - lines * 64);
}
#else
#define NON_TEMPORAL 0

static void nt_copy(char *d, const char *s, size_t n)
{
    memcpy(d, s, n);
}
#endif

static PyObject *copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "copy(dst_address, src_address, nbytes) takes 3 arguments");
        return NULL;
    }
    void *dst = PyLong_AsVoidPtr(args[0]);
    if (dst == NULL && PyErr_Occurred())
        return NULL;
    void *src = PyLong_AsVoidPtr(args[1]);
    if (src == NULL && PyErr_Occurred())
        return NULL;
    size_t n = PyLong_AsSize_t(args[2]);
    if (n == (size_t)-1 && PyErr_Occurred())
        return NULL;
    if (n == 0)
        Py_RETURN_NONE;
    if (dst == NULL || src == NULL) {
        PyErr_SetString(PyExc_ValueError, "copy: a null address");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    nt_copy((char *)dst, (const char *)src, n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", (PyCFunction)(void (*)(void))copy, METH_FASTCALL,
     "copy(dst_address, src_address, nbytes): copy with non-temporal stores (no overlap)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "ahcomm._ntcopy",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__ntcopy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "NON_TEMPORAL", NON_TEMPORAL) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
