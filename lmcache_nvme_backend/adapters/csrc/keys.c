/* lmcache_nvme_backend.adapters._keys: the multiprocess server's key strings, a list per call.
 *
 * Every chunk stored, loaded, looked up and deleted through the L2 adapter has a key string
 * (object_keys.py: model@0xRANK@GROUP@HASH, plus @salt when salted) and a namespace (the
 * model, plus @salt).  Formatting them with Python's % operator costs the interpreter about
 * 5,000 instructions a key (the attribute reads, two integer formats, bytes.hex, the
 * tuple), as much as a tenth of everything it does for a 2 MiB chunk; this does the same
 * in one call per list.
 *
 *   columns(keys, namespaces) -> (names, namespaces or None), or None
 *
 * object_keys.py holds the definition of the format; this follows it byte for byte for
 * the keys it takes (exactly str model names and salts in ASCII, exactly int ranks and
 * groups from 0 to 2**64 - 1, exactly bytes hashes) and answers None for a list with any
 * other key, which object_keys.py then formats itself.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static PyObject *attr_model, *attr_rank, *attr_group, *attr_hash, *attr_salt;

static const char HEX[] = "0123456789abcdef";

/* Lowercase hex digits of v (at least `min_digits`, zero-padded) at out; their number. */
static Py_ssize_t put_hex(char *out, unsigned long long v, int min_digits) {
    char digits[16];
    int n = 0;
    do {
        digits[n++] = HEX[v & 15];
        v >>= 4;
    } while (v);
    while (n < min_digits) digits[n++] = '0';
    for (int i = 0; i < n; i++) out[i] = digits[n - 1 - i];
    return n;
}

/* An exactly-int attribute as an unsigned 64-bit value: 1, 0 (not one: the Python path),
 * -1 (an error). */
static int unsigned_field(PyObject *value, unsigned long long *out) {
    if (!PyLong_CheckExact(value)) return 0;
    *out = PyLong_AsUnsignedLongLong(value);
    if (*out == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
        PyErr_Clear(); /* negative or too big: the Python path formats it */
        return 0;
    }
    return 1;
}

static int ascii_str(PyObject *value) {
    return PyUnicode_CheckExact(value) && PyUnicode_IS_ASCII(value);
}

/* One key's string (and namespace when ns_out): 1, 0 (the Python path), -1 (an error). */
static int format_key(PyObject *key, PyObject **name_out, PyObject **ns_out) {
    PyObject *model = NULL, *rank = NULL, *group = NULL, *hash = NULL, *salt = NULL;
    int verdict = -1;
    unsigned long long rank_v, group_v;
    if ((model = PyObject_GetAttr(key, attr_model)) == NULL ||
        (rank = PyObject_GetAttr(key, attr_rank)) == NULL ||
        (group = PyObject_GetAttr(key, attr_group)) == NULL ||
        (hash = PyObject_GetAttr(key, attr_hash)) == NULL ||
        (salt = PyObject_GetAttr(key, attr_salt)) == NULL)
        goto done;
    verdict = 0;
    if (!ascii_str(model) || !ascii_str(salt) || !PyBytes_CheckExact(hash)) goto done;
    if ((verdict = unsigned_field(rank, &rank_v)) != 1) goto done;
    if ((verdict = unsigned_field(group, &group_v)) != 1) goto done;
    verdict = -1;
    Py_ssize_t model_len = PyUnicode_GET_LENGTH(model), salt_len = PyUnicode_GET_LENGTH(salt);
    Py_ssize_t hash_len = PyBytes_GET_SIZE(hash);
    if (hash_len > (PY_SSIZE_T_MAX - model_len - salt_len - 64) / 2) {
        PyErr_NoMemory();
        goto done;
    }
    /* model @ 0x + 8..16 digits @ 1..16 digits @ hash hex [@ salt] */
    Py_ssize_t most = model_len + 1 + 18 + 1 + 16 + 1 + 2 * hash_len + 1 + salt_len;
    char stack[512];
    char *buf = most <= (Py_ssize_t)sizeof(stack) ? stack : PyMem_Malloc((size_t)most);
    if (buf == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    char *p = buf;
    memcpy(p, PyUnicode_1BYTE_DATA(model), (size_t)model_len);
    p += model_len;
    *p++ = '@';
    *p++ = '0';
    *p++ = 'x';
    p += put_hex(p, rank_v, 8); /* %#010x: "0x" and at least 8 digits */
    *p++ = '@';
    p += put_hex(p, group_v, 1);
    *p++ = '@';
    const unsigned char *h = (const unsigned char *)PyBytes_AS_STRING(hash);
    for (Py_ssize_t i = 0; i < hash_len; i++) {
        *p++ = HEX[h[i] >> 4];
        *p++ = HEX[h[i] & 15];
    }
    Py_ssize_t unsalted = p - buf;
    if (salt_len) {
        *p++ = '@';
        memcpy(p, PyUnicode_1BYTE_DATA(salt), (size_t)salt_len);
        p += salt_len;
    }
    PyObject *name = PyUnicode_New(p - buf, 127);
    if (name != NULL) memcpy(PyUnicode_1BYTE_DATA(name), buf, (size_t)(p - buf));
    if (buf != stack) PyMem_Free(buf);
    if (name == NULL) goto done;
    if (ns_out != NULL) {
        PyObject *ns = model;
        if (salt_len) {
            /* model @ salt: the name without its rank, group and hash */
            ns = PyUnicode_New(model_len + 1 + salt_len, 127);
            if (ns == NULL) {
                Py_DECREF(name);
                goto done;
            }
            Py_UCS1 *q = PyUnicode_1BYTE_DATA(ns);
            memcpy(q, PyUnicode_1BYTE_DATA(model), (size_t)model_len);
            q[model_len] = '@';
            memcpy(q + model_len + 1, PyUnicode_1BYTE_DATA(name) + unsalted + 1,
                   (size_t)salt_len);
        } else {
            Py_INCREF(ns);
        }
        *ns_out = ns;
    }
    *name_out = name;
    verdict = 1;
done:
    Py_XDECREF(model);
    Py_XDECREF(rank);
    Py_XDECREF(group);
    Py_XDECREF(hash);
    Py_XDECREF(salt);
    return verdict;
}

static PyObject *py_columns(PyObject *mod, PyObject *args) {
    PyObject *keys, *names = NULL, *namespaces = NULL, *fast = NULL;
    int want_namespaces, verdict = -1;
    if (!PyArg_ParseTuple(args, "Op", &keys, &want_namespaces)) return NULL;
    fast = PySequence_Fast(keys, "keys must be a sequence");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    if ((names = PyList_New(n)) == NULL) goto fail;
    if (want_namespaces && (namespaces = PyList_New(n)) == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name, *ns;
        verdict = format_key(items[i], &name, want_namespaces ? &ns : NULL);
        if (verdict != 1) goto fail; /* 0: a key for the Python path, so is the whole list */
        PyList_SET_ITEM(names, i, name);
        if (want_namespaces) PyList_SET_ITEM(namespaces, i, ns);
    }
    Py_DECREF(fast);
    if (!want_namespaces) namespaces = Py_NewRef(Py_None);
    return Py_BuildValue("(NN)", names, namespaces);
fail:
    Py_XDECREF(fast);
    Py_XDECREF(names);
    Py_XDECREF(namespaces);
    if (verdict == 0) Py_RETURN_NONE;
    return NULL;
}

static PyMethodDef module_methods[] = {
    {"columns", py_columns, METH_VARARGS,
     "columns(keys, namespaces) -> (names, namespaces or None), or None: the key strings "
     "(and namespaces) of LMCache ObjectKeys as object_keys.py formats them; None when a "
     "key is one only object_keys.py formats."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_keys",
    "The L2 adapter's key strings and namespaces, a list per call.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__keys(void) {
    if ((attr_model = PyUnicode_InternFromString("model_name")) == NULL ||
        (attr_rank = PyUnicode_InternFromString("kv_rank")) == NULL ||
        (attr_group = PyUnicode_InternFromString("object_group_id")) == NULL ||
        (attr_hash = PyUnicode_InternFromString("chunk_hash")) == NULL ||
        (attr_salt = PyUnicode_InternFromString("cache_salt")) == NULL)
        return NULL;
    return PyModule_Create(&module_def);
}
