/*
 * fucina.runtime._rt -- the C runtime of Fucina (DESIGN.md section 5, SPEC R-2, R-3).
 *
 *   Pool    per-context transient buffer pool: two arms (f32 size classes, 4 KiB byte slabs),
 *           free lists ascending by capacity, bounded first fit (the smallest cached entry
 *           that holds the request, unless it is more than twice the request and 64 KiB
 *           bigger: then a fresh allocation, so a tiny tensor never pins a huge buffer that
 *           the next big request must then fault in anew), LIFO within a class, byte cap;
 *           outstanding and peak bytes for memory tests.
 *   Buffer  storage object: raw address as a cached Python int + the buffer protocol.
 *           Its death returns the memory to its pool (Python refcounting drives reuse).
 *   Team    persistent pthread workers: spin briefly, then park on a futex.
 *   launch  calls a JIT kernel `void k(const int64_t *args, int64_t c0, int64_t c1)` inline or
 *           spread chunk by chunk over a team. The chunk grid belongs to the kernel; the team
 *           only decides who runs which chunk, so results never depend on the thread count.
 *
 * Everything except the team's workers runs with the GIL held; workers never touch Python.
 * Linux only (futex); x86-64 is the target, other CPUs only lose the pause hint.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#else
#define cpu_relax() ((void)0)
#endif

#define RT_ALIGN 64          /* every pooled allocation; one cache line, enough for AVX-512 */
#define RT_MAX_ARGS 32       /* kernel args copied to the caller's C stack */
#define RT_SLAB 4096         /* byte-slab arm granularity */
#define RT_F32_POW2_MAX 1024 /* f32 arm: powers of two up to this many elements, then multiples */
#define RT_MAX_REQUEST ((size_t)1 << 60) /* keeps class rounding far from size_t overflow */

/*
 * Default inline threshold (bytes touched) below which launch() never wakes the team.
 * Measured by benchmarks/bench_runtime.py (2-vCPU AMD EPYC under KVM, idle machine): a 2-thread
 * scale_f32 beats the inline call from 16 KiB (2 chunks) / 32 KiB (8 chunks) touched when the
 * worker is spinning, and only from ~2 MiB when it is parked (median wake-up ~15 us).
 * 64 KiB = twice the spinning crossover (there the split wins 1.3-1.55x). With a parked worker
 * jobs of 64 KiB..2 MiB run at 0.7-1.0x of inline (the wake-up costs what the split saves): the
 * price of not spinning forever, paid by the first op after an idle spell. 64 KiB also equals
 * the GIL threshold, so a parallel launch never releases the GIL where inline would not.
 */
#define RT_DEFAULT_INLINE_THRESHOLD (64 * 1024)
/* Releasing and re-taking the GIL costs ~100 ns plus a possible switch; not worth it below this. */
#define RT_DEFAULT_GIL_THRESHOLD (64 * 1024)

typedef void (*rt_kernel_fn)(const int64_t *args, int64_t c0, int64_t c1);

static int64_t rt_inline_threshold = RT_DEFAULT_INLINE_THRESHOLD;
static int64_t rt_gil_threshold = RT_DEFAULT_GIL_THRESHOLD;

/* Bumped in a forked child: teams created before the fork have no threads there. */
static unsigned long rt_fork_epoch = 0;

/* Participant id of the running thread: 0 for any caller, 1..n-1 for team workers. */
static _Thread_local int rt_participant = 0;

static inline int64_t
rt_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ------------------------------------------------------------------------------------------ */
/* Integer conversions                                                                         */
/* ------------------------------------------------------------------------------------------ */

/* Any int (or __index__ object) into an int64 bit pattern: [-2^63, 2^64-1] accepted. */
static int
rt_as_bits64(PyObject *o, int64_t *out)
{
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow == 0) {
        *out = (int64_t)v;
        return 0;
    }
    if (overflow < 0) {
        PyErr_SetString(PyExc_OverflowError, "int too small for a 64-bit kernel argument");
        return -1;
    }
    /* Between 2^63 and 2^64-1: keep the bit pattern (PyLong_AsUnsigned* wants a real int). */
    PyObject *idx = PyNumber_Index(o);
    if (idx == NULL)
        return -1;
    unsigned long long u = PyLong_AsUnsignedLongLong(idx);
    Py_DECREF(idx);
    if (u == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (int64_t)u;
    return 0;
}

/* A non-negative int64 (sizes, counts); `what` names the argument in errors. */
static int
rt_as_nonneg64(PyObject *o, int64_t *out, const char *what)
{
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow != 0 || v < 0) {
        PyErr_Format(PyExc_ValueError, "%s must be an int in [0, 2**63)", what);
        return -1;
    }
    *out = (int64_t)v;
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Pool and Buffer                                                                             */
/* ------------------------------------------------------------------------------------------ */

typedef struct {
    void *ptr;
    size_t cap;
    PyObject *addr; /* the Buffer's cached int travels with the memory: reuse builds no new int */
} rt_entry;

/*
 * Free list kept DESCENDING by capacity in memory, which is the spec's ascending list read
 * backwards: the smallest fitting entry and the newest of a class sit at the end of the used
 * part, so the common same-size release/alloc pair moves nothing.
 */
typedef struct {
    rt_entry *v;
    size_t len, alloc;
} rt_freelist;

enum { ARM_SLAB = 0, ARM_F32 = 1 };

typedef struct {
    PyObject_HEAD
    rt_freelist arm[2];
    size_t max_cached;
    size_t cached_bytes;
    Py_ssize_t outstanding;
    size_t outstanding_bytes, peak_bytes; /* capacities of live buffers; their high-water mark */
    uint64_t n_allocs, n_reuses, n_releases, n_dropped;
    int closed;
} PoolObject;

typedef struct {
    PyObject_HEAD
    char *ptr;
    Py_ssize_t nbytes;   /* requested length = the exported length */
    Py_ssize_t capacity; /* bytes actually owned */
    PyObject *addr;      /* int, created once */
    PoolObject *pool;    /* strong ref for pooled buffers, else NULL */
    Py_buffer *src;      /* borrow(): the source's view, released on death */
    PyObject *weakreflist;
    unsigned char f32_arm;
    unsigned char readonly;
} BufferObject;

static PyTypeObject PoolType;
static PyTypeObject BufferType;

/* Capacity in bytes of the class serving `nbytes` (caller bounds nbytes by RT_MAX_REQUEST). */
static size_t
rt_class_bytes(size_t nbytes, int f32_arm)
{
    if (!f32_arm)
        return (nbytes + (RT_SLAB - 1)) & ~(size_t)(RT_SLAB - 1);
    size_t n = (nbytes + 3) / 4;
    if (n <= RT_F32_POW2_MAX)
        n = n <= 1 ? 1 : (size_t)1 << (64 - __builtin_clzll((unsigned long long)(n - 1)));
    else
        n = (n + (RT_F32_POW2_MAX - 1)) & ~(size_t)(RT_F32_POW2_MAX - 1);
    return n * 4;
}

/* Number of entries with cap >= need (they form the prefix of the descending array). */
static size_t
rt_count_ge(const rt_freelist *fl, size_t need)
{
    size_t lo = 0, hi = fl->len;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (fl->v[mid].cap >= need)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

#define RT_FIT_SLACK ((size_t)64 << 10)

/* Smallest cached entry with cap >= need, newest first among equals; 0 if none or if that
 * entry is oversized (cap > 2 need and cap > need + 64 KiB). */
static int
rt_freelist_take(rt_freelist *fl, size_t need, rt_entry *out)
{
    size_t k = rt_count_ge(fl, need);
    if (k == 0)
        return 0;
    size_t cap = fl->v[k - 1].cap;
    if (cap / 2 > need && cap - need > RT_FIT_SLACK)
        return 0;
    *out = fl->v[k - 1];
    memmove(&fl->v[k - 1], &fl->v[k], (fl->len - k) * sizeof(rt_entry));
    fl->len--;
    return 1;
}

/* Insert after every entry with cap >= e.cap = before them in ascending order (LIFO). */
static int
rt_freelist_put(rt_freelist *fl, rt_entry e)
{
    if (fl->len == fl->alloc) {
        size_t na = fl->alloc ? fl->alloc * 2 : 16;
        rt_entry *nv = PyMem_Realloc(fl->v, na * sizeof(rt_entry));
        if (nv == NULL)
            return -1;
        fl->v = nv;
        fl->alloc = na;
    }
    size_t p = rt_count_ge(fl, e.cap);
    memmove(&fl->v[p + 1], &fl->v[p], (fl->len - p) * sizeof(rt_entry));
    fl->v[p] = e;
    fl->len++;
    return 0;
}

static size_t
rt_pool_trim(PoolObject *self)
{
    size_t n = 0;
    for (int a = 0; a < 2; a++) {
        rt_freelist *fl = &self->arm[a];
        for (size_t i = 0; i < fl->len; i++) {
            free(fl->v[i].ptr);
            Py_DECREF(fl->v[i].addr);
        }
        n += fl->len;
        fl->len = 0;
    }
    self->cached_bytes = 0;
    return n;
}

/* A pooled buffer died: cache its memory or free it. Must not fail (runs in dealloc). */
static void
rt_pool_release(PoolObject *pool, BufferObject *b)
{
    size_t cap = (size_t)b->capacity;
    pool->outstanding--;
    pool->outstanding_bytes -= cap;
    if (!pool->closed) {
        pool->n_releases++;
        if (cap <= pool->max_cached && pool->cached_bytes <= pool->max_cached - cap) {
            rt_entry e = {b->ptr, cap, b->addr};
            if (rt_freelist_put(&pool->arm[b->f32_arm], e) == 0) {
                pool->cached_bytes += cap;
                return; /* the entry now owns b->addr */
            }
        }
        pool->n_dropped++;
    }
    free(b->ptr);
    Py_DECREF(b->addr);
}

static void
buffer_dealloc(BufferObject *self)
{
    if (self->weakreflist != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    PoolObject *pool = self->pool;
    if (pool != NULL) {
        rt_pool_release(pool, self);
        Py_DECREF(pool); /* last buffer of a dropped pool may free the pool here */
    }
    else {
        if (self->src != NULL) {
            PyBuffer_Release(self->src);
            PyMem_Free(self->src);
        }
        Py_XDECREF(self->addr);
    }
    PyObject_Free(self); /* exact type only: Buffer is not subclassable */
}

static int
buffer_getbuffer(BufferObject *self, Py_buffer *view, int flags)
{
    /* Raises BufferError on a writable request against a read-only borrow. */
    return PyBuffer_FillInfo(view, (PyObject *)self, self->ptr, self->nbytes, self->readonly,
                             flags);
}

static PyBufferProcs buffer_as_buffer = {
    .bf_getbuffer = (getbufferproc)buffer_getbuffer,
    .bf_releasebuffer = NULL,
};

static PyObject *
buffer_get_addr(BufferObject *self, void *c)
{
    return Py_NewRef(self->addr);
}

static PyObject *
buffer_get_nbytes(BufferObject *self, void *c)
{
    return PyLong_FromSsize_t(self->nbytes);
}

static PyObject *
buffer_get_capacity(BufferObject *self, void *c)
{
    return PyLong_FromSsize_t(self->capacity);
}

static PyObject *
buffer_get_pooled(BufferObject *self, void *c)
{
    return PyBool_FromLong(self->pool != NULL);
}

static PyObject *
buffer_get_readonly(BufferObject *self, void *c)
{
    return PyBool_FromLong(self->readonly);
}

static PyObject *
buffer_get_f32_arm(BufferObject *self, void *c)
{
    return PyBool_FromLong(self->f32_arm);
}

static PyGetSetDef buffer_getset[] = {
    {"addr", (getter)buffer_get_addr, NULL, "raw address of the first byte (int)", NULL},
    {"nbytes", (getter)buffer_get_nbytes, NULL, "requested length in bytes", NULL},
    {"capacity", (getter)buffer_get_capacity, NULL, "bytes actually owned", NULL},
    {"pooled", (getter)buffer_get_pooled, NULL, "True if the memory returns to a Pool", NULL},
    {"readonly", (getter)buffer_get_readonly, NULL, "True for a read-only borrow", NULL},
    {"f32_arm", (getter)buffer_get_f32_arm, NULL, "True if from the pool's f32 arm", NULL},
    {NULL},
};

static PyObject *
buffer_repr(BufferObject *self)
{
    return PyUnicode_FromFormat("<fucina Buffer addr=%p nbytes=%zd capacity=%zd %s>",
                                (void *)self->ptr, self->nbytes, self->capacity,
                                self->pool ? (self->f32_arm ? "pooled f32" : "pooled slab")
                                           : (self->readonly ? "borrowed ro" : "borrowed"));
}

static PyTypeObject BufferType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fucina.runtime._rt.Buffer",
    .tp_basicsize = sizeof(BufferObject),
    .tp_dealloc = (destructor)buffer_dealloc,
    .tp_repr = (reprfunc)buffer_repr,
    .tp_as_buffer = &buffer_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Raw storage: a pooled allocation (Pool.alloc) or a zero-copy borrow (borrow()).\n"
              "Exports a writable 1-D unsigned-byte buffer of length nbytes (read-only for a\n"
              "read-only borrow); np.frombuffer(buf, np.float32) is a zero-copy view.",
    .tp_weaklistoffset = offsetof(BufferObject, weakreflist),
    .tp_getset = buffer_getset,
    /* no tp_new: only Pool.alloc() and borrow() make Buffers */
};

static BufferObject *
rt_buffer_new(void)
{
    BufferObject *b = PyObject_New(BufferObject, &BufferType);
    if (b == NULL)
        return NULL;
    b->ptr = NULL;
    b->nbytes = b->capacity = 0;
    b->addr = NULL;
    b->pool = NULL;
    b->src = NULL;
    b->weakreflist = NULL;
    b->f32_arm = 0;
    b->readonly = 0;
    return b;
}

/* Pool(max_cached_bytes=1<<30) */
static PyObject *
pool_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"max_cached_bytes", NULL};
    Py_ssize_t cap = (Py_ssize_t)1 << 30;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|n:Pool", kwlist, &cap))
        return NULL;
    if (cap < 0) {
        PyErr_SetString(PyExc_ValueError, "max_cached_bytes must be >= 0");
        return NULL;
    }
    PoolObject *self = (PoolObject *)type->tp_alloc(type, 0); /* zero-filled */
    if (self == NULL)
        return NULL;
    self->max_cached = (size_t)cap;
    return (PyObject *)self;
}

static void
pool_dealloc(PoolObject *self)
{
    /* Only reached once no Buffer refers to the pool, so nothing is outstanding. */
    rt_pool_trim(self);
    PyMem_Free(self->arm[0].v);
    PyMem_Free(self->arm[1].v);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
rt_match_kw(PyObject *name, const char *const *names, int n)
{
    for (int i = 0; i < n; i++)
        if (PyUnicode_CompareWithASCIIString(name, names[i]) == 0)
            return i;
    return -1;
}

/* pool.alloc(nbytes, f32_arm, zero=False) -> Buffer  (fastcall: this is on every op's path) */
static PyObject *
pool_alloc(PoolObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"nbytes", "f32_arm", "zero"};
    PyObject *slot[3] = {NULL, NULL, NULL};
    if (nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "alloc() takes at most 3 arguments");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        slot[i] = args[i];
    if (kwnames != NULL) {
        Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t i = 0; i < nk; i++) {
            int k = rt_match_kw(PyTuple_GET_ITEM(kwnames, i), names, 3);
            if (k < 0 || slot[k] != NULL) {
                PyErr_Format(PyExc_TypeError, "alloc() got an unexpected or repeated keyword %R",
                             PyTuple_GET_ITEM(kwnames, i));
                return NULL;
            }
            slot[k] = args[nargs + i];
        }
    }
    if (slot[0] == NULL || slot[1] == NULL) {
        PyErr_SetString(PyExc_TypeError, "alloc() needs nbytes and f32_arm");
        return NULL;
    }
    Py_ssize_t nbytes = PyNumber_AsSsize_t(slot[0], PyExc_OverflowError);
    if (nbytes == -1 && PyErr_Occurred())
        return NULL;
    int f32 = PyObject_IsTrue(slot[1]);
    if (f32 < 0)
        return NULL;
    int zero = slot[2] ? PyObject_IsTrue(slot[2]) : 0;
    if (zero < 0)
        return NULL;
    if (nbytes <= 0) {
        PyErr_Format(PyExc_ValueError, "alloc() needs nbytes > 0, got %zd", nbytes);
        return NULL;
    }
    if ((size_t)nbytes > RT_MAX_REQUEST) {
        PyErr_Format(PyExc_MemoryError, "alloc() request of %zd bytes is too large", nbytes);
        return NULL;
    }
    if (self->closed) {
        PyErr_SetString(PyExc_RuntimeError, "pool closed");
        return NULL;
    }

    BufferObject *b = rt_buffer_new();
    if (b == NULL)
        return NULL;
    size_t need = rt_class_bytes((size_t)nbytes, f32);
    rt_entry e;
    if (rt_freelist_take(&self->arm[f32], need, &e)) {
        self->cached_bytes -= e.cap;
        self->n_reuses++;
    }
    else {
        void *p = NULL;
        if (posix_memalign(&p, RT_ALIGN, need) != 0) {
            /* Cached memory may be what is missing: give it back to the system and retry. */
            rt_pool_trim(self);
            if (posix_memalign(&p, RT_ALIGN, need) != 0) {
                Py_DECREF(b);
                return PyErr_NoMemory();
            }
        }
        PyObject *addr = PyLong_FromVoidPtr(p);
        if (addr == NULL) {
            free(p);
            Py_DECREF(b);
            return NULL;
        }
        e.ptr = p;
        e.cap = need;
        e.addr = addr;
        self->n_allocs++;
    }
    if (zero)
        memset(e.ptr, 0, (size_t)nbytes);
    b->ptr = e.ptr;
    b->nbytes = nbytes;
    b->capacity = (Py_ssize_t)e.cap;
    b->addr = e.addr;
    b->f32_arm = (unsigned char)f32;
    b->pool = (PoolObject *)Py_NewRef(self);
    self->outstanding++;
    self->outstanding_bytes += e.cap;
    if (self->outstanding_bytes > self->peak_bytes)
        self->peak_bytes = self->outstanding_bytes;
    return (PyObject *)b;
}

/* reset_peak() -> int: the peak so far; the peak restarts at the current outstanding bytes. */
static PyObject *
pool_reset_peak(PoolObject *self, PyObject *unused)
{
    size_t peak = self->peak_bytes;
    self->peak_bytes = self->outstanding_bytes;
    return PyLong_FromSize_t(peak);
}

static PyObject *
pool_trim(PoolObject *self, PyObject *unused)
{
    return PyLong_FromSize_t(rt_pool_trim(self));
}

static PyObject *
pool_close(PoolObject *self, PyObject *unused)
{
    rt_pool_trim(self);
    self->closed = 1;
    return PyLong_FromSsize_t(self->outstanding);
}

static PyObject *
pool_cached_buffers(PoolObject *self, PyObject *unused)
{
    return PyLong_FromSize_t(self->arm[ARM_F32].len);
}

static PyObject *
pool_cached_slabs(PoolObject *self, PyObject *unused)
{
    return PyLong_FromSize_t(self->arm[ARM_SLAB].len);
}

static PyObject *
pool_cached_bytes(PoolObject *self, PyObject *unused)
{
    return PyLong_FromSize_t(self->cached_bytes);
}

static PyObject *
pool_outstanding_buffers(PoolObject *self, PyObject *unused)
{
    return PyLong_FromSsize_t(self->outstanding);
}

static int
rt_dict_set_u64(PyObject *d, const char *k, unsigned long long v)
{
    PyObject *o = PyLong_FromUnsignedLongLong(v);
    if (o == NULL)
        return -1;
    int r = PyDict_SetItemString(d, k, o);
    Py_DECREF(o);
    return r;
}

static PyObject *
pool_stats(PoolObject *self, PyObject *unused)
{
    PyObject *d = PyDict_New();
    if (d == NULL)
        return NULL;
    if (rt_dict_set_u64(d, "allocs", self->n_allocs) < 0 ||
        rt_dict_set_u64(d, "reuses", self->n_reuses) < 0 ||
        rt_dict_set_u64(d, "releases", self->n_releases) < 0 ||
        rt_dict_set_u64(d, "dropped", self->n_dropped) < 0 ||
        rt_dict_set_u64(d, "outstanding", (unsigned long long)self->outstanding) < 0 ||
        rt_dict_set_u64(d, "outstanding_bytes", self->outstanding_bytes) < 0 ||
        rt_dict_set_u64(d, "peak_bytes", self->peak_bytes) < 0 ||
        rt_dict_set_u64(d, "cached_buffers", self->arm[ARM_F32].len) < 0 ||
        rt_dict_set_u64(d, "cached_slabs", self->arm[ARM_SLAB].len) < 0 ||
        rt_dict_set_u64(d, "cached_bytes", self->cached_bytes) < 0 ||
        rt_dict_set_u64(d, "max_cached_bytes", self->max_cached) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

/* pool._free_list(f32_arm) -> [(capacity, addr), ...] in the spec's ascending order (tests). */
static PyObject *
pool_free_list(PoolObject *self, PyObject *arg)
{
    int f32 = PyObject_IsTrue(arg);
    if (f32 < 0)
        return NULL;
    rt_freelist *fl = &self->arm[f32];
    PyObject *l = PyList_New((Py_ssize_t)fl->len);
    if (l == NULL)
        return NULL;
    for (size_t i = 0; i < fl->len; i++) {
        rt_entry *e = &fl->v[fl->len - 1 - i];
        PyObject *t = Py_BuildValue("(nO)", (Py_ssize_t)e->cap, e->addr);
        if (t == NULL) {
            Py_DECREF(l);
            return NULL;
        }
        PyList_SET_ITEM(l, (Py_ssize_t)i, t);
    }
    return l;
}

static PyObject *
pool_get_max_cached(PoolObject *self, void *c)
{
    return PyLong_FromSize_t(self->max_cached);
}

static PyObject *
pool_get_closed(PoolObject *self, void *c)
{
    return PyBool_FromLong(self->closed);
}

static PyMethodDef pool_methods[] = {
    {"alloc", (PyCFunction)(void (*)(void))pool_alloc, METH_FASTCALL | METH_KEYWORDS,
     "alloc(nbytes, f32_arm, zero=False) -> Buffer: 64-byte aligned, reused if possible"},
    {"reset_peak", (PyCFunction)pool_reset_peak, METH_NOARGS,
     "reset_peak() -> int: return the peak outstanding bytes and restart it from now"},
    {"trim", (PyCFunction)pool_trim, METH_NOARGS,
     "trim() -> int: free every cached buffer, return how many"},
    {"close", (PyCFunction)pool_close, METH_NOARGS,
     "close() -> int: free the cache, refuse further allocs, return the outstanding count"},
    {"cached_buffers", (PyCFunction)pool_cached_buffers, METH_NOARGS, "f32 arm entries"},
    {"cached_slabs", (PyCFunction)pool_cached_slabs, METH_NOARGS, "byte-slab arm entries"},
    {"cached_bytes", (PyCFunction)pool_cached_bytes, METH_NOARGS, "bytes held by the cache"},
    {"outstanding_buffers", (PyCFunction)pool_outstanding_buffers, METH_NOARGS,
     "buffers handed out and not yet returned"},
    {"stats", (PyCFunction)pool_stats, METH_NOARGS,
     "stats() -> dict: allocs (fresh mallocs), reuses, releases (returns while open),\n"
     "dropped (returns freed because of the cap), and the current counters"},
    {"_free_list", (PyCFunction)pool_free_list, METH_O,
     "_free_list(f32_arm) -> [(capacity, addr)] ascending (for tests)"},
    {NULL},
};

static PyGetSetDef pool_getset[] = {
    {"max_cached_bytes", (getter)pool_get_max_cached, NULL, "byte cap of the cache", NULL},
    {"closed", (getter)pool_get_closed, NULL, "True after close()", NULL},
    {NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fucina.runtime._rt.Pool",
    .tp_basicsize = sizeof(PoolObject),
    .tp_dealloc = (destructor)pool_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Pool(max_cached_bytes=1<<30): per-context transient buffer pool (SPEC R-2).\n"
              "Not thread-safe: drive it from one thread (buffers may die anywhere; the GIL\n"
              "serialises that).",
    .tp_methods = pool_methods,
    .tp_getset = pool_getset,
    .tp_new = pool_new,
};

/* borrow(obj) -> Buffer: zero-copy wrap of a C-contiguous buffer exporter, never pooled. */
static PyObject *
rt_borrow(PyObject *mod, PyObject *obj)
{
    Py_buffer *v = PyMem_Malloc(sizeof(Py_buffer));
    if (v == NULL)
        return PyErr_NoMemory();
    /* No PyBUF_WRITABLE: the exporter reports writability in v->readonly. */
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS) < 0) {
        PyMem_Free(v);
        return NULL;
    }
    BufferObject *b = rt_buffer_new();
    PyObject *addr = b ? PyLong_FromVoidPtr(v->buf) : NULL;
    if (addr == NULL) {
        Py_XDECREF(b);
        PyBuffer_Release(v);
        PyMem_Free(v);
        return NULL;
    }
    b->ptr = v->buf;
    b->nbytes = b->capacity = v->len;
    b->addr = addr;
    b->src = v;
    b->readonly = v->readonly ? 1 : 0;
    return (PyObject *)b;
}

/* ------------------------------------------------------------------------------------------ */
/* Team                                                                                        */
/* ------------------------------------------------------------------------------------------ */

struct rt_team;
typedef struct {
    struct rt_team *sh;
    int id;
} rt_worker_arg;

/*
 * State shared with the workers. A job of n chunks is cut into one contiguous range per
 * participant (the caller is 0, worker i is i): range p is [p*n/T, (p+1)*n/T). Each range is
 * published as its own word `slot[p].ctl` = (tag << 32) | remaining, and a chunk is claimed by
 * CAS-decrementing `remaining` under the expected tag, lowest chunk first. A participant drains
 * its own range, then helps with the others' in turn, so a late or descheduled worker costs
 * nothing, while in the common case every thread streams through one contiguous stretch of
 * memory: on a bandwidth-bound kernel at 2 threads that is ~12 % faster than handing chunks out
 * alternately (the hardware prefetchers keep their streams). The tag makes a worker still
 * holding a finished job's tag unable to take a chunk of the next job, and the caller never has
 * to wait for a worker that claimed nothing. The descriptor (fn/args/n) a worker read before a
 * successful claim is therefore that job's (see rt_run_chunks).
 */
typedef struct {
    _Alignas(64) _Atomic uint64_t ctl;
} rt_slot;

typedef struct rt_team {
    rt_slot *slot; /* nthreads ranges, one cache line each */
    _Alignas(64) _Atomic uintptr_t fn;
    _Atomic uintptr_t args;
    _Atomic int64_t n;
    _Alignas(64) _Atomic int64_t done; /* chunks finished in the current job */
    _Alignas(64) _Atomic uint32_t gen; /* futex word, bumped per job (and on stop) */
    _Atomic int parked;                /* workers in (or entering) futex_wait */
    _Atomic int stop;
    int64_t spin_ns; /* how long an idle worker spins before parking */
    uint32_t seq;    /* caller side: last tag published */
    int nthreads;
    rt_worker_arg warg[];
} rt_team;

static long
rt_futex(_Atomic uint32_t *addr, int op, uint32_t val)
{
    return syscall(SYS_futex, (uint32_t *)addr, op, val, NULL, NULL, 0);
}

/* Claim and run the chunks of range p; 0 when the job is over (the tag moved on). */
static int
rt_drain_range(rt_team *sh, int p, rt_kernel_fn fn, const int64_t *args, int64_t hi,
               uint64_t tag)
{
    _Atomic uint64_t *ctl = &sh->slot[p].ctl;
    uint64_t w = atomic_load_explicit(ctl, memory_order_acquire);
    for (;;) {
        if ((w >> 32) != tag)
            return 0;
        uint32_t rem = (uint32_t)w;
        if (rem == 0)
            return 1;
        if (atomic_compare_exchange_weak_explicit(ctl, &w, w - 1, memory_order_acq_rel,
                                                  memory_order_acquire)) {
            int64_t c = hi - (int64_t)rem; /* ascending within the range */
            fn(args, c, c + 1);
            atomic_fetch_add_explicit(&sh->done, 1, memory_order_release);
            w = atomic_load_explicit(ctl, memory_order_acquire);
        }
    }
}

static void
rt_run_chunks(rt_team *sh)
{
    const int T = sh->nthreads, me = rt_participant < T ? rt_participant : 0;
    uint64_t w = atomic_load_explicit(&sh->slot[me].ctl, memory_order_acquire);
    /* Read before the claiming CAS (release): the caller cannot overwrite the descriptor
     * until our chunk is done, so a successful claim proves these belong to job `tag`. */
    rt_kernel_fn fn = (rt_kernel_fn)atomic_load_explicit(&sh->fn, memory_order_relaxed);
    const int64_t *args =
        (const int64_t *)atomic_load_explicit(&sh->args, memory_order_relaxed);
    int64_t n = atomic_load_explicit(&sh->n, memory_order_relaxed);
    const uint64_t tag = w >> 32;
    if (tag == 0)
        return;
    for (int k = 0; k < T; k++) {
        int p = (me + k) % T;
        if (!rt_drain_range(sh, p, fn, args, (p + 1) * n / T, tag))
            return;
    }
}

/* Wait for a generation other than `last`: spin for spin_ns, then park on the futex. */
static uint32_t
rt_wait_gen(rt_team *sh, uint32_t last)
{
    for (;;) {
        int64_t t0 = rt_now_ns();
        do {
            for (int i = 0; i < 64; i++) {
                uint32_t g = atomic_load_explicit(&sh->gen, memory_order_acquire);
                if (g != last)
                    return g;
                cpu_relax();
            }
        } while (rt_now_ns() - t0 < sh->spin_ns);
        /* Announce before the final check; the caller stores gen then reads parked.
         * Both seq_cst: either we see the new gen or the caller sees us and wakes us. */
        atomic_fetch_add_explicit(&sh->parked, 1, memory_order_seq_cst);
        if (atomic_load_explicit(&sh->gen, memory_order_seq_cst) == last)
            rt_futex(&sh->gen, FUTEX_WAIT_PRIVATE, last); /* returns at once if gen moved */
        atomic_fetch_sub_explicit(&sh->parked, 1, memory_order_seq_cst);
        uint32_t g = atomic_load_explicit(&sh->gen, memory_order_acquire);
        if (g != last)
            return g;
        /* spurious wake-up: spin and park again */
    }
}

static void *
rt_worker_main(void *p)
{
    rt_worker_arg *a = p;
    rt_team *sh = a->sh;
    rt_participant = a->id;
    uint32_t last = 0; /* gen is 0 until the first job or stop */
    for (;;) {
        last = rt_wait_gen(sh, last);
        if (atomic_load_explicit(&sh->stop, memory_order_acquire))
            return NULL;
        rt_run_chunks(sh);
    }
}

/* Caller side of a parallel launch (GIL released). Returns when all n chunks are done. */
static void
rt_team_run(rt_team *sh, rt_kernel_fn fn, const int64_t *args, int64_t n)
{
    atomic_store_explicit(&sh->fn, (uintptr_t)fn, memory_order_relaxed);
    atomic_store_explicit(&sh->args, (uintptr_t)args, memory_order_relaxed);
    atomic_store_explicit(&sh->n, n, memory_order_relaxed);
    atomic_store_explicit(&sh->done, 0, memory_order_relaxed);
    uint32_t tag = ++sh->seq;
    if (tag == 0) /* gen 0 is the workers' initial `last` */
        tag = ++sh->seq;
    for (int p = 0; p < sh->nthreads; p++) {
        int64_t len = (p + 1) * n / sh->nthreads - p * n / sh->nthreads;
        atomic_store_explicit(&sh->slot[p].ctl, ((uint64_t)tag << 32) | (uint64_t)len,
                              memory_order_release);
    }
    atomic_store_explicit(&sh->gen, tag, memory_order_seq_cst);
    int parked = atomic_load_explicit(&sh->parked, memory_order_seq_cst);
    if (parked > 0) {
        /* Only as many as can get a chunk; the caller takes one itself. */
        int64_t want = n - 1 < parked ? n - 1 : parked;
        rt_futex(&sh->gen, FUTEX_WAKE_PRIVATE, (uint32_t)want);
    }
    rt_run_chunks(sh);
    /* Remaining chunks are running on workers: spin, yielding the CPU if it takes long. */
    int64_t t0 = 0;
    unsigned spins = 0;
    while (atomic_load_explicit(&sh->done, memory_order_acquire) < n) {
        cpu_relax();
        if ((++spins & 1023) == 0) {
            int64_t t = rt_now_ns();
            if (t0 == 0)
                t0 = t;
            else if (t - t0 > 200000)
                sched_yield();
        }
    }
}

typedef struct {
    PyObject_HEAD
    rt_team *sh;
    pthread_t *threads; /* nthreads - 1 workers */
    int nthreads;
    int nstarted;
    int closed;
    int busy; /* a launch is in flight (GIL released); guarded by the GIL */
    unsigned long epoch;
} TeamObject;

static PyTypeObject TeamType;

static void
rt_team_shutdown(TeamObject *self)
{
    if (self->closed)
        return;
    self->closed = 1;
    if (self->sh == NULL)
        return;
    if (self->epoch == rt_fork_epoch) {
        atomic_store_explicit(&self->sh->stop, 1, memory_order_seq_cst);
        atomic_fetch_add_explicit(&self->sh->gen, 1, memory_order_seq_cst);
        rt_futex(&self->sh->gen, FUTEX_WAKE_PRIVATE, INT_MAX);
        /* Workers never take the GIL, so joining with it held cannot deadlock. */
        for (int i = 0; i < self->nstarted; i++)
            pthread_join(self->threads[i], NULL);
    }
    /* else: a forked child; the workers exist only in the parent. */
    self->nstarted = 0;
}

/* Team(nthreads, spin_us=50.0) */
static PyObject *
team_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"nthreads", "spin_us", NULL};
    int nthreads;
    double spin_us = 50.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "i|d:Team", kwlist, &nthreads, &spin_us))
        return NULL;
    if (nthreads < 1 || nthreads > 1024) {
        PyErr_Format(PyExc_ValueError, "Team: nthreads must be in [1, 1024], got %d", nthreads);
        return NULL;
    }
    if (!(spin_us >= 0.0 && spin_us <= 1e6)) {
        PyErr_SetString(PyExc_ValueError, "Team: spin_us must be in [0, 1e6]");
        return NULL;
    }
    TeamObject *self = (TeamObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->nthreads = nthreads;
    self->epoch = rt_fork_epoch;
    void *mem = NULL;
    size_t sz = sizeof(rt_team) + (size_t)nthreads * sizeof(rt_worker_arg);
    if (posix_memalign(&mem, 64, sz) != 0) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    memset(mem, 0, sz);
    rt_team *sh = mem;
    void *slots;
    if (posix_memalign(&slots, 64, (size_t)nthreads * sizeof(rt_slot)) != 0) {
        free(mem);
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    sh->slot = slots;
    for (int p = 0; p < nthreads; p++)
        atomic_init(&sh->slot[p].ctl, 0);
    atomic_init(&sh->fn, 0);
    atomic_init(&sh->args, 0);
    atomic_init(&sh->n, 0);
    atomic_init(&sh->done, 0);
    atomic_init(&sh->gen, 0);
    atomic_init(&sh->parked, 0);
    atomic_init(&sh->stop, 0);
    sh->spin_ns = (int64_t)(spin_us * 1000.0);
    sh->seq = 0;
    sh->nthreads = nthreads;
    self->sh = sh;
    if (nthreads > 1) {
        self->threads = PyMem_Calloc((size_t)nthreads - 1, sizeof(pthread_t));
        if (self->threads == NULL) {
            Py_DECREF(self);
            return PyErr_NoMemory();
        }
        /* Workers inherit the creator's signal mask: block everything so signals (SIGINT)
         * keep going to the Python main thread. */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        int err = 0;
        for (int i = 1; i < nthreads; i++) {
            sh->warg[i].sh = sh;
            sh->warg[i].id = i;
            err = pthread_create(&self->threads[i - 1], NULL, rt_worker_main, &sh->warg[i]);
            if (err != 0)
                break;
            self->nstarted++;
        }
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (err != 0) {
            Py_DECREF(self); /* dealloc stops and joins the ones that started */
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    }
    return (PyObject *)self;
}

static void
team_dealloc(TeamObject *self)
{
    rt_team_shutdown(self);
    if (self->sh != NULL)
        free(self->sh->slot);
    free(self->sh);
    PyMem_Free(self->threads);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
team_close(TeamObject *self, PyObject *unused)
{
    if (self->busy && self->epoch == rt_fork_epoch) { /* a forked child may inherit busy */
        PyErr_SetString(PyExc_RuntimeError, "team is running a launch on another thread");
        return NULL;
    }
    rt_team_shutdown(self);
    Py_RETURN_NONE;
}

static PyObject *
team_parked_workers(TeamObject *self, PyObject *unused)
{
    if (self->closed || self->sh == NULL)
        return PyLong_FromLong(0);
    return PyLong_FromLong(atomic_load(&self->sh->parked));
}

static PyObject *
team_get_nthreads(TeamObject *self, void *c)
{
    return PyLong_FromLong(self->nthreads);
}

static PyObject *
team_get_closed(TeamObject *self, void *c)
{
    return PyBool_FromLong(self->closed);
}

static PyObject *
team_get_spin_us(TeamObject *self, void *c)
{
    return PyFloat_FromDouble(self->sh ? (double)self->sh->spin_ns / 1000.0 : 0.0);
}

static PyMethodDef team_methods[] = {
    {"close", (PyCFunction)team_close, METH_NOARGS, "close(): stop and join workers (idempotent)"},
    {"parked_workers", (PyCFunction)team_parked_workers, METH_NOARGS,
     "number of workers currently parked on the futex (diagnostics)"},
    {NULL},
};

static PyGetSetDef team_getset[] = {
    {"nthreads", (getter)team_get_nthreads, NULL, "participants, the caller included", NULL},
    {"closed", (getter)team_get_closed, NULL, "True after close()", NULL},
    {"spin_us", (getter)team_get_spin_us, NULL, "idle spin before a worker parks", NULL},
    {NULL},
};

static PyTypeObject TeamType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fucina.runtime._rt.Team",
    .tp_basicsize = sizeof(TeamObject),
    .tp_dealloc = (destructor)team_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Team(nthreads, spin_us=50.0): the caller plus nthreads-1 persistent workers\n"
              "(SPEC R-3). Idle workers spin for spin_us, then park on a futex.",
    .tp_methods = team_methods,
    .tp_getset = team_getset,
    .tp_new = team_new,
};

/* ------------------------------------------------------------------------------------------ */
/* launch                                                                                      */
/* ------------------------------------------------------------------------------------------ */

/* launch(team_or_None, addr, n_chunks, cost, *args) */
static PyObject *
rt_launch(PyObject *mod, PyObject *const *a, Py_ssize_t nargs)
{
    if (nargs < 4) {
        PyErr_SetString(PyExc_TypeError, "launch(team_or_None, addr, n_chunks, cost, *args)");
        return NULL;
    }
    Py_ssize_t nk = nargs - 4;
    if (nk > RT_MAX_ARGS) {
        PyErr_Format(PyExc_TypeError, "launch() takes at most %d kernel args, got %zd",
                     RT_MAX_ARGS, nk);
        return NULL;
    }
    TeamObject *team = NULL;
    if (a[0] != Py_None) {
        if (!PyObject_TypeCheck(a[0], &TeamType)) {
            PyErr_Format(PyExc_TypeError, "launch(): team must be a Team or None, not %.100s",
                         Py_TYPE(a[0])->tp_name);
            return NULL;
        }
        team = (TeamObject *)a[0];
    }
    int64_t addr, n_chunks, cost;
    if (rt_as_bits64(a[1], &addr) < 0)
        return NULL;
    if (addr == 0) {
        PyErr_SetString(PyExc_ValueError, "launch(): kernel address is 0");
        return NULL;
    }
    if (rt_as_nonneg64(a[2], &n_chunks, "launch(): n_chunks") < 0 ||
        rt_as_nonneg64(a[3], &cost, "launch(): cost") < 0)
        return NULL;
    if (n_chunks > (int64_t)UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "launch(): n_chunks must be < 2**32");
        return NULL;
    }
    int64_t argv[RT_MAX_ARGS];
    /* Unused slots read as 0, so trailing optional kernel args are well defined. */
    memset(argv + nk, 0, (size_t)(RT_MAX_ARGS - nk) * sizeof(int64_t));
    for (Py_ssize_t i = 0; i < nk; i++) {
        if (rt_as_bits64(a[4 + i], &argv[i]) < 0) {
            if (PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_TypeError, "launch(): kernel arg %zd must be an int, not %.100s",
                             i, Py_TYPE(a[4 + i])->tp_name);
            }
            return NULL;
        }
    }
    if (team != NULL && team->closed) {
        PyErr_SetString(PyExc_RuntimeError, "team closed");
        return NULL;
    }
    if (n_chunks == 0)
        Py_RETURN_NONE;
    rt_kernel_fn fn = (rt_kernel_fn)(uintptr_t)addr;

    if (team == NULL || team->nthreads == 1 || n_chunks <= 1 || cost < rt_inline_threshold ||
        team->busy || team->epoch != rt_fork_epoch) {
        /* Inline. A busy team (launch from a second Python thread) or a forked child's copy
         * also lands here: same chunks, same results, just no fan-out. */
        if (cost >= rt_gil_threshold) {
            Py_BEGIN_ALLOW_THREADS
            fn(argv, 0, n_chunks);
            Py_END_ALLOW_THREADS
        }
        else {
            fn(argv, 0, n_chunks);
        }
        Py_RETURN_NONE;
    }
    team->busy = 1;
    Py_INCREF(team); /* our argument ref is borrowed; own one while the GIL is released */
    Py_BEGIN_ALLOW_THREADS
    rt_team_run(team->sh, fn, argv, n_chunks);
    Py_END_ALLOW_THREADS
    team->busy = 0;
    Py_DECREF(team);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------ */
/* plans: a recorded sequence of launches replayed in one call                                 */
/* ------------------------------------------------------------------------------------------ */

/* A plan is an int64 array of entries [fn, nargs, chunks_a, chunks_b, cost_a, cost_b,
 * args_a[nargs], args_b[nargs]]; at position x every value is a + b*x (two's-complement
 * wraparound, so addresses and float bit patterns with b = 0 pass through untouched). Each
 * entry then runs exactly as launch() would run it: inline unless it has more than one chunk
 * and its cost reaches the inline threshold, else over the team. */
#define RT_PLAN_HEAD 6

static inline int64_t
rt_affine(const int64_t *ab, Py_ssize_t stride, int64_t x)
{
    return (int64_t)((uint64_t)ab[0] + (uint64_t)ab[stride] * (uint64_t)x);
}

/* run_plan(team_or_None, plan, x) */
static PyObject *
rt_run_plan(PyObject *mod, PyObject *const *a, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "run_plan(team_or_None, plan, x)");
        return NULL;
    }
    TeamObject *team = NULL;
    if (a[0] != Py_None) {
        if (!PyObject_TypeCheck(a[0], &TeamType)) {
            PyErr_Format(PyExc_TypeError, "run_plan(): team must be a Team or None, not %.100s",
                         Py_TYPE(a[0])->tp_name);
            return NULL;
        }
        team = (TeamObject *)a[0];
        if (team->closed) {
            PyErr_SetString(PyExc_RuntimeError, "team closed");
            return NULL;
        }
    }
    int64_t x;
    if (rt_as_bits64(a[2], &x) < 0)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(a[1], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const int64_t *p = (const int64_t *)view.buf;
    Py_ssize_t n = view.len / (Py_ssize_t)sizeof(int64_t);
    /* check the whole plan at this x before running any of it */
    const char *bad = NULL;
    if (view.len % (Py_ssize_t)sizeof(int64_t) != 0)
        bad = "plan length is not a multiple of 8 bytes";
    for (Py_ssize_t i = 0; bad == NULL && i < n;) {
        if (n - i < RT_PLAN_HEAD) {
            bad = "plan ends inside an entry header";
            break;
        }
        int64_t k = p[i + 1];
        if (p[i] == 0)
            bad = "plan entry has kernel address 0";
        else if (k < 0 || k > RT_MAX_ARGS)
            bad = "plan entry has a bad argument count";
        else if (n - i < RT_PLAN_HEAD + 2 * k)
            bad = "plan ends inside an entry's arguments";
        else {
            int64_t chunks = rt_affine(p + i + 2, 1, x), cost = rt_affine(p + i + 4, 1, x);
            if (chunks < 0 || chunks > (int64_t)UINT32_MAX || cost < 0)
                bad = "plan entry has chunks outside [0, 2**32) or a negative cost at this x";
        }
        i += RT_PLAN_HEAD + 2 * (k < 0 ? 0 : k);
    }
    if (bad != NULL) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "run_plan(): %s", bad);
        return NULL;
    }
    int fan = team != NULL && team->nthreads > 1 && !team->busy && team->epoch == rt_fork_epoch;
    if (fan) {
        team->busy = 1;
        Py_INCREF(team);
    }
    Py_BEGIN_ALLOW_THREADS
    int64_t argv[RT_MAX_ARGS];
    for (Py_ssize_t i = 0; i < n;) {
        rt_kernel_fn fn = (rt_kernel_fn)(uintptr_t)p[i];
        int64_t k = p[i + 1];
        int64_t chunks = rt_affine(p + i + 2, 1, x), cost = rt_affine(p + i + 4, 1, x);
        const int64_t *ab = p + i + RT_PLAN_HEAD;
        for (int64_t j = 0; j < k; j++)
            argv[j] = rt_affine(ab + j, k, x);
        for (int64_t j = k; j < RT_MAX_ARGS; j++)
            argv[j] = 0;
        if (chunks > 0) {
            if (fan && chunks > 1 && cost >= rt_inline_threshold)
                rt_team_run(team->sh, fn, argv, chunks);
            else
                fn(argv, 0, chunks);
        }
        i += RT_PLAN_HEAD + 2 * k;
    }
    Py_END_ALLOW_THREADS
    if (fan) {
        team->busy = 0;
        Py_DECREF(team);
    }
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *
rt_set_threshold(int64_t *slot, PyObject *arg, const char *what)
{
    int64_t v;
    if (rt_as_nonneg64(arg, &v, what) < 0)
        return NULL;
    int64_t old = *slot;
    *slot = v;
    return PyLong_FromLongLong(old);
}

static PyObject *
rt_set_inline_threshold(PyObject *mod, PyObject *arg)
{
    return rt_set_threshold(&rt_inline_threshold, arg, "inline threshold");
}

static PyObject *
rt_get_inline_threshold(PyObject *mod, PyObject *unused)
{
    return PyLong_FromLongLong(rt_inline_threshold);
}

static PyObject *
rt_set_gil_threshold(PyObject *mod, PyObject *arg)
{
    return rt_set_threshold(&rt_gil_threshold, arg, "GIL threshold");
}

static PyObject *
rt_get_gil_threshold(PyObject *mod, PyObject *unused)
{
    return PyLong_FromLongLong(rt_gil_threshold);
}

/* ------------------------------------------------------------------------------------------ */
/* Built-in kernels (tests and measurements), same signature as the JIT's                      */
/* ------------------------------------------------------------------------------------------ */

static void
k_noop(const int64_t *a, int64_t c0, int64_t c1)
{
    (void)a;
    (void)c0;
    (void)c1;
}

/* a = [int64 *out, chunk, n]: out[i] = i */
static void
k_fill_index(const int64_t *a, int64_t c0, int64_t c1)
{
    int64_t *out = (int64_t *)(uintptr_t)a[0];
    const int64_t cs = a[1], n = a[2];
    for (int64_t c = c0; c < c1; c++) {
        int64_t lo = c * cs, hi = lo + cs < n ? lo + cs : n;
        for (int64_t i = lo; i < hi; i++)
            out[i] = i;
    }
}

/* a = [int64 *out, busy microseconds per chunk (optional)]: out[c] = participant id */
static void
k_thread_id(const int64_t *a, int64_t c0, int64_t c1)
{
    int64_t *out = (int64_t *)(uintptr_t)a[0];
    for (int64_t c = c0; c < c1; c++) {
        int64_t end = rt_now_ns() + a[1] * 1000;
        while (rt_now_ns() < end)
            cpu_relax();
        out[c] = rt_participant;
    }
}

/* a = [float *src, float *dst, n, chunk, bits(scale)]: dst[i] = src[i] * scale */
static void
k_scale_f32(const int64_t *a, int64_t c0, int64_t c1)
{
    const float *src = (const float *)(uintptr_t)a[0];
    float *dst = (float *)(uintptr_t)a[1];
    const int64_t n = a[2], cs = a[3];
    uint32_t bits = (uint32_t)a[4];
    float s;
    memcpy(&s, &bits, sizeof s);
    int64_t lo = c0 * cs, hi = c1 * cs < n ? c1 * cs : n;
    for (int64_t i = lo; i < hi; i++)
        dst[i] = src[i] * s;
}

/* a = [int64 *out, busy us per chunk]: out[2c] = participant, out[2c+1] = CLOCK_MONOTONIC ns at
 * the chunk's start (wake-up latency measurements) */
static void
k_stamp(const int64_t *a, int64_t c0, int64_t c1)
{
    int64_t *out = (int64_t *)(uintptr_t)a[0];
    for (int64_t c = c0; c < c1; c++) {
        int64_t t = rt_now_ns();
        out[2 * c] = rt_participant;
        out[2 * c + 1] = t;
        while (rt_now_ns() < t + a[1] * 1000)
            cpu_relax();
    }
}

/* a = [int64 *out, x1..x31]: out[i] = a[i + 1] for all 31 slots (argument conversion tests) */
static void
k_copy_args(const int64_t *a, int64_t c0, int64_t c1)
{
    int64_t *out = (int64_t *)(uintptr_t)a[0];
    if (c0 == 0 && c1 > 0)
        for (int i = 1; i < RT_MAX_ARGS; i++)
            out[i - 1] = a[i];
}

/* a = [microseconds per chunk]: busy-wait (keeps the CPU, like real work) */
static void
k_sleep_us(const int64_t *a, int64_t c0, int64_t c1)
{
    for (int64_t c = c0; c < c1; c++) {
        int64_t end = rt_now_ns() + a[0] * 1000;
        while (rt_now_ns() < end)
            cpu_relax();
    }
}

static const struct {
    const char *name;
    rt_kernel_fn fn;
} rt_test_kernels[] = {
    {"noop", k_noop},
    {"fill_index", k_fill_index},
    {"thread_id", k_thread_id},
    {"scale_f32", k_scale_f32},
    {"sleep_us", k_sleep_us},
    {"copy_args", k_copy_args},
    {"stamp", k_stamp},
};

static PyObject *
rt_test_kernel_addr(PyObject *mod, PyObject *name)
{
    if (!PyUnicode_Check(name)) {
        PyErr_SetString(PyExc_TypeError, "test_kernel_addr(name: str)");
        return NULL;
    }
    for (size_t i = 0; i < sizeof rt_test_kernels / sizeof rt_test_kernels[0]; i++)
        if (PyUnicode_CompareWithASCIIString(name, rt_test_kernels[i].name) == 0)
            return PyLong_FromVoidPtr((void *)(uintptr_t)rt_test_kernels[i].fn);
    PyErr_Format(PyExc_KeyError, "no built-in test kernel %R", name);
    return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* Module                                                                                      */
/* ------------------------------------------------------------------------------------------ */

static PyMethodDef rt_methods[] = {
    {"launch", (PyCFunction)(void (*)(void))rt_launch, METH_FASTCALL,
     "launch(team_or_None, addr, n_chunks, cost, *args): run kernel `addr` over chunks\n"
     "[0, n_chunks); args (<= 32 ints) are passed as an int64 array. cost (bytes touched)\n"
     "below the inline threshold runs on the caller without waking the team."},
    {"run_plan", (PyCFunction)(void (*)(void))rt_run_plan, METH_FASTCALL,
     "run_plan(team_or_None, plan, x): run a recorded plan (an int64 buffer of entries\n"
     "[fn, nargs, chunks a, b, cost a, b, args a[nargs], args b[nargs]]) with every value\n"
     "a + b*x, each entry as launch() would run it, in one call without the GIL"},
    {"borrow", (PyCFunction)rt_borrow, METH_O,
     "borrow(obj) -> Buffer: zero-copy, never pooled; writable iff obj's buffer is"},
    {"test_kernel_addr", (PyCFunction)rt_test_kernel_addr, METH_O,
     "address of a built-in kernel: noop, fill_index, thread_id, scale_f32, sleep_us,\n"
     "copy_args, stamp"},
    {"set_inline_threshold", (PyCFunction)rt_set_inline_threshold, METH_O,
     "set_inline_threshold(bytes) -> previous value"},
    {"get_inline_threshold", (PyCFunction)rt_get_inline_threshold, METH_NOARGS, NULL},
    {"set_gil_threshold", (PyCFunction)rt_set_gil_threshold, METH_O,
     "set_gil_threshold(bytes) -> previous value"},
    {"get_gil_threshold", (PyCFunction)rt_get_gil_threshold, METH_NOARGS, NULL},
    {NULL},
};

static struct PyModuleDef rt_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "fucina.runtime._rt",
    .m_doc = "Fucina C runtime: buffer pool, buffers, worker team, kernel launch.",
    .m_size = -1,
    .m_methods = rt_methods,
};

static void
rt_atfork_child(void)
{
    rt_fork_epoch++;
}

PyMODINIT_FUNC
PyInit__rt(void)
{
    if (PyType_Ready(&BufferType) < 0 || PyType_Ready(&PoolType) < 0 ||
        PyType_Ready(&TeamType) < 0)
        return NULL;
    static int atfork_done = 0;
    if (!atfork_done) {
        if (pthread_atfork(NULL, NULL, rt_atfork_child) != 0) {
            PyErr_SetString(PyExc_RuntimeError, "pthread_atfork failed");
            return NULL;
        }
        atfork_done = 1;
    }
    PyObject *m = PyModule_Create(&rt_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Buffer", (PyObject *)&BufferType) < 0 ||
        PyModule_AddObjectRef(m, "Pool", (PyObject *)&PoolType) < 0 ||
        PyModule_AddObjectRef(m, "Team", (PyObject *)&TeamType) < 0 ||
        PyModule_AddIntConstant(m, "MAX_ARGS", RT_MAX_ARGS) < 0 ||
        PyModule_AddIntConstant(m, "ALIGNMENT", RT_ALIGN) < 0 ||
        PyModule_AddIntConstant(m, "DEFAULT_INLINE_THRESHOLD", RT_DEFAULT_INLINE_THRESHOLD) < 0 ||
        PyModule_AddIntConstant(m, "DEFAULT_GIL_THRESHOLD", RT_DEFAULT_GIL_THRESHOLD) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
