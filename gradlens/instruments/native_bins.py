"""A compiled loop for :class:`~gradlens.instruments.hist2d.GradHist2d` on the CPU: each
per-sample gradient element formed, binned and counted in one pass, without a tensor per element.

The 2D histogram pairs every element g_n,j with its own parameter bin, so unlike the 1D one it
must touch every element; in torch that is several passes over a materialised chunk (the
product, the bin arithmetic, the combined index, the cast, ``bincount``). Here one C loop does
all of it per element: ``x = delta[n, o] * a[n, i]`` (rank-one layers: the very float product
autograd's per-sample gradient holds; or ``x`` read from a materialised chunk), its gradient bin by
:func:`~gradlens.instruments.binning.bin_of`'s rule in ``x``'s dtype (the same float operations:
``(x - lo) * s`` or, when 0 is an edge, ``x * s`` plus the zero edge's index; NaN in the last
bin), the parameter bin's offset ``param_bin * grad_bins`` (computed once per window) added, and
the count incremented in place; the clamped elements (below ``lo``, above ``hi``, NaN) are
counted in the same pass.

The loop is C source compiled once per machine with the system C compiler (``cc``, or ``$CC``)
into a shared library cached under ``$GRADLENS_CACHE`` (default ``~/.cache/gradlens``) and loaded
with ``ctypes``; a cached library that another user owns or may write (or whose folder they may
write) is never loaded: the loop is then built afresh in a private temporary folder. Where there
is no compiler (or ``GRADLENS_NATIVE=0``), :func:`available` is
False and GradHist2d counts with torch (:func:`~gradlens.instruments.binning.count_2d`): the same
counts, slower. Float32 and float64 only; contiguous inputs (the callers make them so).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import torch
from torch import Tensor

from gradlens.instruments.binning import _affine

__all__ = ["available", "count_dense", "count_outer", "usable"]

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>

#define BLOCK 256
#define COPIES_MAX_BINS 4096

/* x86-64: the index loop also in an AVX2 version, chosen at load by the CPU (GL_CLONES is set
   where the compiler supports it; the build retries without it). */
#ifdef GL_CLONES
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

/* One block of m elements x = d * xs[i] (d = 1: the elements themselves; 1 * x is x, NaN and
   -0 included): idx[i] = OFF + bin of x by bin_of's rule, in x's dtype T: u = (x - lo_sub) * s
   (lo_sub = 0 where 0 is an edge: x - 0 is x), floor(u) + zz clamped to [0, bins - 1] through
   u's clamp to [lo_u, hi_m] = [-zz, bins - 1 - zz] (exact integers; NaN to hi_m: the last bin);
   cl[0] += #{x < lo}, cl[1] += #{not x <= hi} (above hi, or NaN). Branch-free, so that the
   compiler vectorises it. OFF: of[i] (2D: the parameter bin's offset) or 0 (1D). */
#define INDEX(T, NAME, OFF)                                                                    \
CLONES static void NAME(const T *restrict xs, const T d, const int32_t *restrict of,                   \
                 int32_t *restrict idx, const int64_t m, const T lo, const T hi, const T lo_sub,\
                 const T s, const T lo_u, const T hi_m, const int32_t zz, int64_t *cl) {        \
    int32_t below = 0, above = 0;                                                              \
    for (int64_t i = 0; i < m; i++) {                                                          \
        const T x = d * xs[i];                                                                 \
        T u = (x - lo_sub) * s;                                                                \
        u = u < hi_m ? u : hi_m;                                                               \
        u = u < lo_u ? lo_u : u;                                                               \
        int32_t k = (int32_t)u;                                                                \
        k -= ((T)k > u);                                                                       \
        idx[i] = OFF + k + zz;                                                                 \
        below += x < lo;                                                                       \
        above += !(x <= hi);                                                                   \
    }                                                                                          \
    cl[0] += below;                                                                            \
    cl[1] += above;                                                                            \
}

/* The constants of bin_of's rule in T (as torch's float operations use them); 1D (no
   offsets, few bins): four interleaved copies of the counts, so that a run of elements in one
   bin does not wait on its own increments (folded into counts at the end). */
#define SETUP(T)                                                                               \
    const T lo = (T)lo_d, hi = (T)hi_d, s = (T)s_d, lo_sub = zero ? (T)0 : (T)lo_d;            \
    const int32_t zz = zero ? (int32_t)z : 0;                                                  \
    const T lo_u = (T)(-zz), hi_m = (T)(bins - 1 - zz);                                        \
    int32_t idx[BLOCK];                                                                        \
    int64_t *sub = (!off && bins <= COPIES_MAX_BINS) ? calloc(4 * bins, sizeof(int64_t)) : 0;  \
    cl[0] = cl[1] = 0;

#define TALLY                                                                                  \
    if (sub) {                                                                                 \
        int64_t j = 0;                                                                         \
        for (; j + 4 <= m; j += 4) {                                                           \
            sub[idx[j]]++;                                                                     \
            sub[bins + idx[j + 1]]++;                                                          \
            sub[2 * bins + idx[j + 2]]++;                                                      \
            sub[3 * bins + idx[j + 3]]++;                                                      \
        }                                                                                      \
        for (; j < m; j++) sub[idx[j]]++;                                                      \
    } else {                                                                                   \
        for (int64_t j = 0; j < m; j++) counts[idx[j]]++;                                      \
    }

#define FOLD                                                                                   \
    if (sub) {                                                                                 \
        for (int64_t k = 0; k < bins; k++)                                                     \
            counts[k] += sub[k] + sub[bins + k] + sub[2 * bins + k] + sub[3 * bins + k];       \
        free(sub);                                                                             \
    }

/* gl_rows: rows r (all R = B * O, or the R listed in rows) of the products
   delta[r] * a[r / O, :], entry (r % O, i) at offset off[(r % O) * I + i] (off NULL: 0).
   gl_dense: the B rows of x [B, D], entry j at offset off[j] (NULL: 0).
   Both: counts[offset + bin]++, cl[0] = #{x < lo}, cl[1] = #{not x <= hi}. */
#define KERNELS(T, SFX)                                                                        \
INDEX(T, index2_##SFX, of[i])                                                                  \
INDEX(T, index1_##SFX, 0)                                                                      \
void gl_rows_##SFX(const T *delta, const T *a, const int32_t *off, const int64_t *rows,        \
                   int64_t R, int64_t O, int64_t I, double lo_d, double hi_d, double s_d,       \
                   int64_t zero, int64_t z, int64_t bins, int64_t *counts, int64_t *cl) {       \
    SETUP(T)                                                                                   \
    for (int64_t q = 0; q < R; q++) {                                                          \
        const int64_t r = rows ? rows[q] : q, n = r / O, o = r % O;                            \
        const T d = delta[r];                                                                  \
        for (int64_t i0 = 0; i0 < I; i0 += BLOCK) {                                            \
            const int64_t m = I - i0 < BLOCK ? I - i0 : BLOCK;                                 \
            if (off)                                                                           \
                index2_##SFX(a + n * I + i0, d, off + o * I + i0, idx, m, lo, hi, lo_sub, s,    \
                             lo_u, hi_m, zz, cl);                                              \
            else                                                                               \
                index1_##SFX(a + n * I + i0, d, off, idx, m, lo, hi, lo_sub, s, lo_u, hi_m,     \
                             zz, cl);                                                          \
            TALLY                                                                              \
        }                                                                                      \
    }                                                                                          \
    FOLD                                                                                       \
}                                                                                              \
void gl_dense_##SFX(const T *x, const int32_t *off, int64_t B, int64_t D, double lo_d,         \
                    double hi_d, double s_d, int64_t zero, int64_t z, int64_t bins,             \
                    int64_t *counts, int64_t *cl) {                                            \
    SETUP(T)                                                                                   \
    for (int64_t n = 0; n < B; n++) {                                                          \
        for (int64_t i0 = 0; i0 < D; i0 += BLOCK) {                                            \
            const int64_t m = D - i0 < BLOCK ? D - i0 : BLOCK;                                 \
            if (off)                                                                           \
                index2_##SFX(x + n * D + i0, (T)1, off + i0, idx, m, lo, hi, lo_sub, s, lo_u,  \
                             hi_m, zz, cl);                                                    \
            else                                                                               \
                index1_##SFX(x + n * D + i0, (T)1, off, idx, m, lo, hi, lo_sub, s, lo_u, hi_m,  \
                             zz, cl);                                                          \
            TALLY                                                                              \
        }                                                                                      \
    }                                                                                          \
    FOLD                                                                                       \
}

KERNELS(float, f32)
KERNELS(double, f64)
"""

#: compiler flags: no contraction of a * b + c into one rounding, no fast-math (the bins must be
#: those of torch's float operations, bit for bit)
_FLAGS = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math"]

_lib = None  # the loaded library, False once building or loading failed
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def _private(path: pathlib.Path) -> bool:
    """Whether ``path`` and its folder belong to this user and no one else may write them (a
    cached library another user could have replaced is not loaded: it would run their code)."""
    if not hasattr(os, "getuid"):
        return True  # (no POSIX owners: the user's own profile folder)
    for p in (path, path.parent):
        st = p.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            return False
    return True


def _build() -> ctypes.CDLL | None:
    """Compile (once per source and machine, cached) and load the library; None if impossible."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return None
    tag = hashlib.sha1("\n".join([_SOURCE, *_FLAGS, cc, platform.machine()]).encode()).hexdigest()[:16]
    cache = pathlib.Path(os.environ.get("GRADLENS_CACHE") or pathlib.Path.home() / ".cache" / "gradlens")
    lib, aside = cache / f"hist2d_{tag}.so", None
    if lib.exists() and not _private(lib):  # loading a library runs its code: only our own
        cache = aside = pathlib.Path(tempfile.mkdtemp(prefix="gradlens-"))  # built afresh, private
        lib = cache / f"hist2d_{tag}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, then moved: atomic
            src, out = pathlib.Path(tmp) / "hist2d.c", pathlib.Path(tmp) / "hist2d.so"
            src.write_text(_SOURCE)
            tries = [["-DGL_CLONES"], []] if platform.machine() in ("x86_64", "AMD64") else [[]]
            for extra in tries:  # AVX2 clones where the compiler makes them, else plain
                done = subprocess.run([cc, *_FLAGS, *extra, "-o", str(out), str(src)], capture_output=True,
                                      timeout=120)
                if done.returncode == 0 and out.exists():
                    break
            else:
                return None
            os.replace(out, lib)
    dll = ctypes.CDLL(str(lib))
    if aside is not None:  # (loaded: the file is no longer needed)
        shutil.rmtree(aside, ignore_errors=True)
    i64, dbl, ptr = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p
    for sfx in _SUFFIX.values():
        f = getattr(dll, f"gl_rows_{sfx}")
        f.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, dbl, dbl, dbl, i64, i64, i64, ptr, ptr]
        f.restype = None
        f = getattr(dll, f"gl_dense_{sfx}")
        f.argtypes = [ptr, ptr, i64, i64, dbl, dbl, dbl, i64, i64, i64, ptr, ptr]
        f.restype = None
    return dll


def available() -> bool:
    """Whether the compiled loop can be used (built and loaded on first call; False where there
    is no C compiler, it failed, or the environment sets ``GRADLENS_NATIVE=0``)."""
    global _lib
    if os.environ.get("GRADLENS_NATIVE", "1") == "0":
        return False
    if _lib is None:
        try:
            _lib = _build() or False
        except (OSError, subprocess.SubprocessError):
            _lib = False
    return _lib is not False


def usable(*tensors: Tensor) -> bool:
    """The loop serves these tensors: CPU, all float32 or all float64, and it is available."""
    dt = tensors[0].dtype
    return (dt in _SUFFIX and all(t.device.type == "cpu" and t.dtype == dt for t in tensors)
            and available())


def _args(lo: float, hi: float, bins: int) -> tuple:
    s, z = _affine(lo, hi, bins)
    return (lo, hi, s, 0 if z is None else 1, 0 if z is None else int(z), bins)


def _check(counts: Tensor, offsets: Tensor | None, bins: int) -> None:
    if not (counts.dtype == torch.int64 and counts.is_contiguous() and counts.device.type == "cpu"):
        raise ValueError("counts must be a contiguous int64 CPU tensor")
    if offsets is not None and offsets.dtype != torch.int32:
        raise ValueError(f"offsets must be int32, got {offsets.dtype}")
    if offsets is None and counts.numel() != bins:
        raise ValueError(f"counts must have {bins} entries without offsets, got {counts.numel()}")


def count_outer(counts: Tensor, delta: Tensor, a: Tensor, lo: float, hi: float, bins: int,
                offsets: Tensor | None = None, rows: Tensor | None = None) -> tuple[int, int]:
    """``counts`` += the histogram of the products ``delta[n, o] * a[n, i]`` (``delta [B, O]``,
    ``a [B, I]``, one dtype) over all rows ``r = n * O + o``, or those in ``rows`` (int64):
    1D (``offsets`` None, ``counts [bins]``) or 2D (entry (o, i) in row ``offsets[o, i] // bins``
    of ``counts [P * bins]``; ``offsets [O, I]`` int32 ``param_bin * bins``, in
    ``[0, P * bins - bins]``). Returns ``(below lo, above hi or NaN)`` products. Only where
    :func:`usable`."""
    _check(counts, offsets, bins)
    delta, a = delta.contiguous(), a.contiguous()
    b, o = delta.shape
    i = a.shape[1]
    if a.shape[0] != b or (offsets is not None and offsets.numel() != o * i):
        raise ValueError(f"shapes do not match: delta {tuple(delta.shape)}, a {tuple(a.shape)}"
                         + ("" if offsets is None else f", offsets {tuple(offsets.shape)}"))
    off = None if offsets is None else offsets.contiguous()
    if rows is None:
        n = b * o
    else:
        rows = rows.to(torch.int64).contiguous()
        n = rows.numel()
    cl = torch.zeros(2, dtype=torch.int64)
    fn = _fn("gl_rows", delta.dtype)
    fn(delta.data_ptr(), a.data_ptr(), _ptr(off), _ptr(rows), n, o, i, *_args(lo, hi, bins),
       counts.data_ptr(), cl.data_ptr())
    return int(cl[0]), int(cl[1])


def count_dense(counts: Tensor, x: Tensor, lo: float, hi: float, bins: int,
                offsets: Tensor | None = None) -> tuple[int, int]:
    """``counts`` += the histogram of ``x [b, *param]``: 1D (``offsets`` None, ``counts [bins]``)
    or 2D (entry j of every sample in row ``offsets[j] // bins``; ``offsets [*param]`` int32
    ``param_bin * bins``). Returns ``(below lo, above hi or NaN)`` elements. Only where
    :func:`usable`."""
    _check(counts, offsets, bins)
    x = x.contiguous()
    b = x.shape[0] if x.dim() else 1
    d = x.numel() // b if b else 0
    off = None if offsets is None else offsets.contiguous()
    if off is not None and x.numel() != b * off.numel():
        raise ValueError(f"shapes do not match: x {tuple(x.shape)}, offsets {tuple(off.shape)}")
    cl = torch.zeros(2, dtype=torch.int64)
    fn = _fn("gl_dense", x.dtype)
    fn(x.data_ptr(), _ptr(off), b, d, *_args(lo, hi, bins), counts.data_ptr(), cl.data_ptr())
    return int(cl[0]), int(cl[1])


def _fn(name: str, dtype: torch.dtype):
    if dtype not in _SUFFIX or not available():
        raise RuntimeError(f"the compiled histogram loop does not serve {dtype} here (see native_bins.usable)")
    return getattr(_lib, f"{name}_{_SUFFIX[dtype]}")


def _ptr(t: Tensor | None):
    return None if t is None else t.data_ptr()
