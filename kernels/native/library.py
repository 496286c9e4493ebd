"""The worker's native CPU kernels: C sources beside this module (kernels/native/*.c), compiled
once per host into one shared library and called through ctypes.

    lib = native_lib.load()   # a ctypes.CDLL, or None where no C compiler or no library is to be had

The interface is declared once, in pagedserve_cpu.h (every exported function and struct); SIGNATURES
and RESTYPES below, and the structures and dtype codes in abi.py, are its ctypes side, checked
against the header by tests/kernels/test_native_header.py. A new function: its prototype in the
header, its argument types here.

Why C: a decode step of a small model on the CPU is thousands of tiny torch ops (RMSNorm, RoPE, the
K/V write and gather, SiLU-mul), each paying Python and dispatch costs larger than its arithmetic.
One C call per fused operation does the same work in one pass over the data. Every kernel has its
torch path beside it (the reference in tests and the fallback here), and ops.py picks the kernel
only for what it supports.

Build: `cc -O3 -march=native -fopenmp -ffp-contract=off` (contraction off: a product rounded before
the add, as torch's separate mul and add round), into
<PAGEDSERVE_CACHE>/native/<key>/libpagedserve_cpu.so. The key hashes the sources, the flags, the
compiler's version and the CPU's feature flags, so an edited source, another compiler or another
CPU builds anew. It is written under a temporary name and renamed into place, so processes that
build at the same time (tensor-parallel ranks) never load half a file. Parallel loops use OpenMP;
the library links libgomp.so.1 by name, which resolves to the copy torch has already loaded, so the
kernels share torch's threads (and torch.set_num_threads) instead of starting a second pool.

Per-host parameters (the few-rows linear kernel's prefetch distance) are measured once after the
first build and kept beside the library: tuning.py.

PAGEDSERVE_KERNELS=reference or triton, or PAGEDSERVE_NATIVE=0, or a failed build: load() returns None and
the torch paths run; a failed build is logged once (native_kernels_unavailable) with the
compiler's message.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

SOURCE_DIR = Path(__file__).parent
LIBRARY_NAME = "libpagedserve_cpu.so"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC",
          "-std=c11", "-Wall")
NATIVE_ENV = "PAGEDSERVE_NATIVE"

_log = logging.getLogger(__name__)

P, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
SIGNATURES = {  # exported function -> argument types, as pagedserve_cpu.h declares them (P: any pointer)
    "add_rms_norm": (P, P, P, P, I64, I64, F32, I32, I32),
    "rotary_write_kv": (P, P, P, P, P, P, I64, I64, I64, I64, I64, I64, I32, I32),
    "silu_mul": (P, P, I64, I64, I64, I32),
    "decode_run_steps": (P, P, I64, P, P, P),
    "greedy_rows": (P, I64, I64, I64, I32, P, P),
    "linear_rows_bf16": (P, P, P, P, I64, I64, I64),
    "linear_rows_available": (),
    "linear_rows_f32": (P, P, P, P, I64, I64, I64),
    "linear_rows_f32_available": (),
    "linear_rows_set_prefetch": (I64,),
    "linear_rows_prefetch": (),
    "panel_linear_bf16": (P, P, P, P, I64, I64, I64),
    "panel_linear_available": (),
    "panel_linear_set_prefetch": (I64, I64),
    "panel_linear_prefetch": (I64,),
    "block_quant_rows": (P, P, P, P, P, I64, I64, I64, I32),
    "block_quant_rows_available": (),
    "block_quant_rows_bf16": (P, P, P, P, P, I64, I64, I64, I32),
    "block_quant_rows_bf16_available": (),
    "block_quant_dequantize": (P, P, P, P, I64, I64, I32, I32),
    "block_quant_set_prefetch": (I64,),
    "block_quant_prefetch": (),
    "decode_layer": (P, P, P, P, I32, P, P),
    "decode_layers": (P, I64, P, P, P, P, P),
    "decode_layers_overlapped": (),
    "decode_step": (P, I64, P, P, P, I64, P, F32, P, P, P, P),
    "paged_decode_attention": (P, I64, P, I64, P, P, P, I64, P, P, P, I64, I64, I64, I64, I64, F32, I32, F32, I32,
                               I32),
    "prefill_attention_available": (),
    "paged_prefill_attention": (P, I64, P, I64, P, P, P, I64, P, P, P, I64, I64, I64, I64, I64, F32, I32, F32),
}
RESTYPES = {"linear_rows_available": I32, "linear_rows_f32_available": I32, "linear_rows_prefetch": I64,
            "panel_linear_available": I32,
            "panel_linear_prefetch": I64, "block_quant_rows_available": I32, "block_quant_rows_bf16_available": I32,
            "block_quant_dequantize": I32, "block_quant_prefetch": I64, "decode_step": I32,
            "decode_layers_overlapped": I64, "decode_run_steps": I64, "prefill_attention_available": I32, "paged_prefill_attention": I32}  # the others return void


class NativeBuildError(RuntimeError):
    pass


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.c"))


def _cpu_flags() -> str:
    from pagedserve.cpu_features import cpu_flags

    return " ".join(sorted(cpu_flags()))


def build_key(cc: str) -> str:
    digest = hashlib.sha256()
    for path in sources() + sorted(SOURCE_DIR.glob("*.h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest.update("\0".join([*CFLAGS, version, _cpu_flags()]).encode())
    return digest.hexdigest()[:20]


def library_path(cc: str) -> Path:
    from pagedserve.cache_root import cache_dir

    return cache_dir() / "native" / build_key(cc) / LIBRARY_NAME


def build(cc: str, target: Path) -> Path:
    """Compiles the sources into target (atomically); returns target. NativeBuildError on failure."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run([cc, *CFLAGS, "-I", str(SOURCE_DIR), *map(str, sources()), "-o", temporary, "-lm"],
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise NativeBuildError(f"{cc} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return target


def is_enabled() -> bool:
    """Not with PAGEDSERVE_NATIVE=0, and only under PAGEDSERVE_KERNELS=auto (reference and triton
    name the paths they want)."""
    environ = os.environ
    return environ.get(NATIVE_ENV, "1") != "0" and environ.get("PAGEDSERVE_KERNELS", "auto") == "auto"


@cache
def _load_cached() -> ctypes.CDLL | None:
    import torch  # noqa: F401  (libgomp.so.1 must be torch's copy, loaded first)

    cc = compiler()
    if cc is None:
        _log.warning("native_kernels_unavailable: no C compiler (cc, gcc or clang) on PATH; "
                     "the torch paths run")
        return None
    try:
        lib = ctypes.CDLL(str(build(cc, library_path(cc))))
    except (NativeBuildError, OSError, subprocess.SubprocessError) as error:
        _log.warning("native_kernels_unavailable: %s; the torch paths run", error)
        return None
    bind_signatures(lib)
    from pagedserve.kernels.native import tuning

    tuning.apply(lib, Path(lib._name).parent)
    return lib


def bind_signatures(lib: ctypes.CDLL) -> None:
    """Every kernel's argument and return types on lib, from SIGNATURES and RESTYPES (a library
    built from these sources, this host's or one built for another CPU in a test)."""
    for name, argtypes in SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = RESTYPES.get(name)


def has_kernel(lib: ctypes.CDLL, kernel: str) -> bool:
    """Whether lib's `<kernel>_available()` says this build has the kernel (those that need AVX-512 or
    its BF16 extension), asked once per library and kept on it."""
    flag = getattr(lib, f"_pagedserve_{kernel}", None)
    if flag is None:
        flag = bool(getattr(lib, f"{kernel}_available")())
        setattr(lib, f"_pagedserve_{kernel}", flag)
    return flag


def load() -> ctypes.CDLL | None:
    """The compiled library (built on first use), or None where disabled or unavailable."""
    return _load_cached() if is_enabled() else None
