"""Run a `mx.fast.metal_kernel` source on the Linux CPU with Metal threadgroup/SIMD semantics.

`run_metal_kernel` writes the kernel function exactly as MLX 0.32 does
(mlx/backend/common/metal_kernel.cpp), compiles it with clang against
metal_shim.h (Metal stdlib + MLX utils subset) and runtime.c (coroutine scheduler), and runs it in
a process of its own (runner.c, spawned; a forked child where there is no memfd) so that a fault
(guard page hit, stack overflow) or a hang becomes a SimulatorError instead of killing the test
run. See README.md.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

HERE = Path(__file__).resolve().parent
SHIM = HERE / "metal_shim.h"
RUNTIME = HERE / "runtime.c"
RUNNER = HERE / "runner.c"
CACHE_DIR = Path(tempfile.gettempdir()) / f"colibri_msl_cache_{os.getuid()}"
PAGE = mmap.PAGESIZE
CANARY = 0xA5
MAX_CONSTANT_ARRAY_SIZE = 8  # MLX: inputs with fewer elements go to the constant address space

# Flags: SYCL-device address-space rules (see metal_shim.h) and native __fp16 arithmetic.
CLANG_FLAGS = [
    "-std=c++17", "-O2", "-fPIC", "-shared", "-fno-exceptions", "-fno-rtti",
    "-Xclang", "-fsycl-is-device",
    "-Xclang", "-fnative-half-type", "-Xclang", "-fnative-half-arguments-and-returns",
    "-Wno-unknown-attributes", "-Wno-ignored-attributes", "-Wno-unused-value",
    "-ffp-contract=off",
    "-fstack-clash-protection",  # big frames probe every page, so they hit the stack guard page
]

# Sanitizer build ($COLIBRI_MSL_SANITIZE: "address", "undefined" or both, comma-separated): the
# kernels, the shim, runtime.c and the runner are built with them, and any report fails the launch.
SANITIZE_ENV = "COLIBRI_MSL_SANITIZE"
_SANITIZERS = ("address", "undefined")


def sanitizers() -> tuple[str, ...]:
    names = tuple(n.strip() for n in os.environ.get(SANITIZE_ENV, "").split(",") if n.strip())
    bad = [n for n in names if n not in _SANITIZERS]
    if bad:
        raise SimulatorError(f"{SANITIZE_ENV}: unknown sanitizer {bad[0]!r} (use {', '.join(_SANITIZERS)})")
    return names


def _sanitize_flags() -> list[str]:
    names = sanitizers()
    if not names:
        return []
    # 256 KiB coroutine stacks: ASan's redzones make frames several times larger.
    return [f"-fsanitize={','.join(names)}", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer",
            "-DMSL_STACK_BYTES=262144"]


# What the sanitizers' runtimes are told: stop at the first report; no leak check (the runner
# exits without freeing, on purpose); the simulator's own SIGSEGV handler reports guard-page hits.
_SANITIZER_ENV = {
    "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:allow_user_segv_handler=1:detect_stack_use_after_return=0",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
}

METAL_ATTRIBUTES = [  # (name, type, C++ expression) in MLX's order
    ("dispatch_quadgroups_per_threadgroup", "uint", "(msl_dispatch.tg[0]*msl_dispatch.tg[1]*msl_dispatch.tg[2]+3)/4"),
    ("dispatch_simdgroups_per_threadgroup", "uint", "(msl_dispatch.tg[0]*msl_dispatch.tg[1]*msl_dispatch.tg[2]+31)/32"),
    ("dispatch_threads_per_threadgroup", "uint3", "msl_u3(msl_dispatch.tg)"),
    ("grid_origin", "uint3", "uint3(0)"),
    ("grid_size", "uint3", "msl_u3(msl_dispatch.grid)"),
    ("quadgroup_index_in_threadgroup", "uint", "msl_current_info()->index_in_tg/4"),
    ("quadgroups_per_threadgroup", "uint", "(msl_dispatch.threads_in_tg+3)/4"),
    ("simdgroup_index_in_threadgroup", "uint", "msl_current_info()->simd_group"),
    ("simdgroups_per_threadgroup", "uint", "msl_dispatch.simdgroups_in_tg"),
    ("thread_execution_width", "uint", "32u"),
    ("thread_index_in_quadgroup", "uint", "msl_current_info()->index_in_tg%4"),
    ("thread_index_in_simdgroup", "uint", "msl_current_info()->simd_lane"),
    ("thread_index_in_threadgroup", "uint", "msl_current_info()->index_in_tg"),
    ("thread_position_in_grid", "uint3", "msl_u3(msl_current_info()->tpig)"),
    ("thread_position_in_threadgroup", "uint3", "msl_u3(msl_current_info()->tptg)"),
    ("threadgroup_position_in_grid", "uint3", "msl_u3(msl_current_info()->tgpig)"),
    ("threadgroups_per_grid", "uint3", "msl_u3(msl_dispatch.tgs_per_grid)"),
    ("threads_per_grid", "uint3", "msl_u3(msl_dispatch.grid)"),
    ("threads_per_simdgroup", "uint", "32u"),
    ("threads_per_threadgroup", "uint3", "msl_u3(msl_dispatch.tg_actual)"),
]

# numpy dtype -> MLX type string (mlx/backend/common/compiled.cpp get_type_string)
_TYPE_STRINGS = {
    np.dtype(np.float32): "float", np.dtype(np.float16): "float16_t", np.dtype(np.float64): "double",
    np.dtype(np.bool_): "bool", np.dtype(np.int8): "int8_t", np.dtype(np.int16): "int16_t",
    np.dtype(np.int32): "int32_t", np.dtype(np.int64): "int64_t", np.dtype(np.uint8): "uint8_t",
    np.dtype(np.uint16): "uint16_t", np.dtype(np.uint32): "uint32_t", np.dtype(np.uint64): "uint64_t",
}
BFLOAT16 = "bfloat16"  # output dtype for bfloat16_t (also mx.bfloat16); inputs: as_bfloat16(bits) or mx arrays

# Metal vector constructors (float4(a, b, c, d), float4(half4_value)) are not C++; they are
# rewritten into a call of the shim's msl_vec_make. The `(?<![\w.])` keeps ushort2 from matching short2.
_VEC_CTOR = re.compile(
    r"(?<![\w.])((?:float|half|int|uint|short|ushort|char|uchar|long|ulong)[234])\s*\(")
# A function-local `threadgroup T name[...];` becomes per-threadgroup static storage.
_TG_DECL = re.compile(r"(?<![\w])threadgroup(\s+[\w:<>, ]+?\s+\w+\s*(?:\[[^\]\n]*\]\s*)*;)")


class SimulatorError(RuntimeError):
    """The kernel failed to compile, deadlocked, diverged, faulted or left outputs unwritten."""


@dataclass(frozen=True)
class Compiler:
    """The clang++ that builds the kernels, the shim and the runtime (all three, so that their
    calling conventions agree: LLVM 15 changed how a half travels to its conversion calls)."""
    path: str
    version: str  # the first line of `--version`

    @property
    def name(self) -> str:
        return Path(self.path).name

    def describe(self) -> str:
        return f"{self.name} ({self.version})"


CLANG_ENV = "COLIBRI_MSL_CLANG"
_VERSIONED = re.compile(r"clang\+\+-(\d+)$")


def installed_compilers() -> list[str]:
    """clang++ executables on PATH: the plain one first, then `clang++-N`, newest first."""
    found: dict[int, str] = {}
    for d in os.environ.get("PATH", "").split(os.pathsep):
        try:
            names = os.listdir(d or ".")
        except OSError:
            continue
        for n in names:
            m = _VERSIONED.match(n)
            if m and int(m.group(1)) not in found and os.access(os.path.join(d, n), os.X_OK):
                found[int(m.group(1))] = os.path.join(d, n)
    plain = shutil.which("clang++")
    return ([plain] if plain else []) + [found[k] for k in sorted(found, reverse=True)]


def _probe(exe: str) -> Compiler:
    res = subprocess.run([exe, "--version"], capture_output=True, text=True)
    first = (res.stdout or res.stderr).splitlines()[0] if res.returncode == 0 else ""
    if not re.search(r"clang version \d+\.", first):
        raise SimulatorError(f"{exe} is not a clang++ ({first or res.stderr.strip()!r})")
    return Compiler(exe, first.strip())


_COMPILER: Compiler | SimulatorError | None = None


def compiler() -> Compiler:
    """The compiler in use: $COLIBRI_MSL_CLANG (a name on PATH or a path) when set, else plain
    `clang++`, else the newest versioned `clang++-N`. Raises SimulatorError when there is none."""
    global _COMPILER
    if _COMPILER is None:
        want = os.environ.get(CLANG_ENV, "").strip()
        try:
            if want:
                exe = shutil.which(want)
                if exe is None:
                    raise SimulatorError(f"{CLANG_ENV}={want} is not an executable on PATH")
            else:
                exes = installed_compilers()
                if not exes:
                    raise SimulatorError("no clang++ is installed (apt-get install -y clang)")
                exe = exes[0]
            _COMPILER = _probe(exe)
        except SimulatorError as e:
            _COMPILER = e
    if isinstance(_COMPILER, SimulatorError):
        raise _COMPILER
    return _COMPILER


def unavailable_reason() -> str | None:
    """Why the simulator cannot run here, or None when it can."""
    try:
        compiler()
    except SimulatorError as e:
        return str(e)
    return None


def _clang() -> str:
    return compiler().path


def _is_bfloat16(dtype) -> bool:
    if isinstance(dtype, str):
        return dtype in ("bfloat16", "bfloat16_t")
    if type(dtype).__module__.startswith("mlx"):
        return str(dtype).rsplit(".", 1)[-1] == "bfloat16"
    return np.dtype(dtype).name == "bfloat16"


def _numpy_dtype(dtype) -> np.dtype:
    """numpy dtype for a numpy/MLX dtype (MLX dtypes by name: mlx.core.float32 -> float32)."""
    if type(dtype).__module__.startswith("mlx"):
        return np.dtype(str(dtype).rsplit(".", 1)[-1])
    return np.dtype(dtype)


def as_bfloat16(bits: np.ndarray) -> np.ndarray:
    """Mark a uint16 array of bfloat16 bit patterns as a bfloat16_t kernel input."""
    bits = np.require(bits, dtype=np.uint16, requirements="C")
    return bits.view(_Bf16Array)


def _type_string(dtype) -> str:
    if _is_bfloat16(dtype):
        return "bfloat16_t"
    try:
        return _TYPE_STRINGS[_numpy_dtype(dtype)]
    except (KeyError, TypeError):
        raise SimulatorError(f"unsupported dtype {dtype!r} (no Metal type string)") from None


def _storage_dtype(dtype) -> np.dtype:
    return np.dtype(np.uint16) if _is_bfloat16(dtype) else _numpy_dtype(dtype)


def rewrite_for_clang(text: str) -> str:
    """Source-level adaptations of Metal syntax that clang's C++ cannot express (see README)."""
    text = _VEC_CTOR.sub(lambda m: f"::metal::msl_vec_make<{m.group(1)}>(", text)
    return _TG_DECL.sub(lambda m: "MSL_TGMEM threadgroup" + m.group(1), text)


@dataclass(frozen=True)
class _Arg:
    """One kernel buffer argument."""
    name: str
    decl: str  # the parameter as MLX writes it, without [[buffer(i)]]
    ctype: str  # pointee type for the call expression
    space: str  # "constant" or "device"
    is_ref: bool


def _template_value(value) -> tuple[str, str]:
    if isinstance(value, bool):
        return "bool", str(int(value))  # MLX streams bools as 0/1
    if isinstance(value, (int, np.integer)):
        return "int", str(int(value))
    return "typename", _type_string(value)


def generate_source(name, input_names, output_names, source, header, inputs, output_dtypes,
                    template=None, atomic_outputs=False):
    """The kernel source MLX 0.32 would compile, plus an extern "C" entry for the simulator.

    Returns (metal_source, cpp_source, buffer_args)."""
    args: list[_Arg] = []
    kernel_name = "custom_kernel_" + name
    lines: list[str] = []
    tdef = ""
    if template:
        kinds = [_template_value(v) for _, v in template]
        lines.append("template <" + ", ".join(f"{k} {n}" for (n, _), (k, _) in zip(template, kinds)) + ">")
        tdef = "<" + ", ".join(v for _, v in kinds) + ">"
        thash = tdef.replace("<", "_").replace(">", "_").replace(", ", "_")[:-1]
        kernel_name += "_" + thash
    for arr in inputs:
        kernel_name += "_" + _type_string(arr.dtype if not isinstance(arr, _Bf16Array) else BFLOAT16)
        kernel_name += "s" if arr.ndim == 0 else ("c" if arr.size < MAX_CONSTANT_ARRAY_SIZE else "")
    for dt in output_dtypes:
        kernel_name += "_" + _type_string(dt)
    params: list[str] = []
    for nm, arr in zip(input_names, inputs):
        tstr = _type_string(BFLOAT16 if isinstance(arr, _Bf16Array) else arr.dtype)
        space = "constant" if arr.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if arr.ndim == 0 else "*"
        args.append(_Arg(nm, f"const {space} {tstr}{ref} {nm}", tstr, space, arr.ndim == 0))
        if arr.ndim > 0:
            if nm + "_shape" in source:
                args.append(_Arg(nm + "_shape", f"const constant int* {nm}_shape", "int", "constant", False))
            if nm + "_strides" in source:
                args.append(_Arg(nm + "_strides", f"const constant int64_t* {nm}_strides", "int64_t", "constant", False))
            if nm + "_ndim" in source:
                args.append(_Arg(nm + "_ndim", f"const constant int& {nm}_ndim", "int", "constant", True))
    for nm, dt in zip(output_names, output_dtypes):
        tstr = _type_string(dt)
        if atomic_outputs:
            tstr = f"atomic<{tstr}>"
        args.append(_Arg(nm, f"device {tstr}* {nm}", tstr, "device", False))
    for i, a in enumerate(args):
        params.append(f"  {a.decl} [[buffer({i})]]")
    attrs = [(n, t, e) for n, t, e in METAL_ATTRIBUTES if n in source]
    params += [f"  {t} {n} [[{n}]]" for n, t, _ in attrs]
    lines.append(f"[[kernel]] void {kernel_name}(")
    metal_source = header + "\n".join(lines) + "\n" + ",\n".join(params) + ") {\n" + source + "\n}\n"
    function_source = metal_source  # the entry below instantiates the template (clang rejects host_name)
    if template:
        metal_source += (f'\ntemplate [[host_name("{kernel_name}")]] [[kernel]] '
                         f"decltype({kernel_name}{tdef}) {kernel_name}{tdef};\n")
    call = []
    for i, a in enumerate(args):
        ptr = f"(const {a.space} {a.ctype}*)msl_buffers[{i}]" if a.space == "constant" or a.name in input_names \
            else f"({a.space} {a.ctype}*)msl_buffers[{i}]"
        call.append(f"*{ptr}" if a.is_ref else ptr)
    call += [e for _, _, e in attrs]
    entry = (
        "\nstatic inline uint3 msl_u3(const uint32_t* v) { return uint3{v[0], v[1], v[2]}; }\n"
        'extern "C" void msl_kernel_entry(void** msl_buffers) {\n'
        f"  {kernel_name}{tdef}(\n    " + ",\n    ".join(call) + ");\n}\n")
    cpp_source = '#include "metal_shim.h"\n#line 1 "kernel.metal"\n' + rewrite_for_clang(function_source) + entry
    return metal_source, cpp_source, args


class _Bf16Array(np.ndarray):
    """uint16 storage that the signature declares as bfloat16_t."""


def _as_input_array(x) -> np.ndarray:
    if isinstance(x, bool):
        return np.asarray(x, dtype=np.bool_)
    if isinstance(x, int):
        return np.asarray(x, dtype=np.int32)
    if isinstance(x, float):
        return np.asarray(x, dtype=np.float32)
    if isinstance(x, _Bf16Array):
        return np.require(x, requirements="C").view(_Bf16Array)
    if type(x).__module__.startswith("mlx"):  # an mx.array
        import mlx.core as mx
        if x.dtype == mx.bfloat16:
            return np.array(x.view(mx.uint16)).view(_Bf16Array)
        return np.array(x)
    arr = np.asarray(x)
    arr = np.require(arr, requirements="C")  # (np.ascontiguousarray would turn 0-d into 1-d)
    if arr.dtype.name == "bfloat16":
        return arr.view(np.uint16).view(_Bf16Array)
    return arr


def _tool_hash() -> str:
    h = hashlib.sha256()
    for p in (SHIM, RUNTIME, Path(__file__)):
        h.update(p.read_bytes())
    h.update(" ".join(CLANG_FLAGS).encode())
    h.update(compiler().path.encode() + compiler().version.encode() + " ".join(_sanitize_flags()).encode())
    return h.hexdigest()[:16]


def _compiled_c(source: Path, name: str, suffix: str, flags=(), libs=()) -> Path:
    """``source`` (C) compiled once with ``flags`` (and ``libs`` after it) into the cache, keyed
    by its text and the compiler."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    cc = compiler()
    flags = (*flags, *_sanitize_flags())
    key = hashlib.sha256(source.read_bytes() + cc.path.encode() + cc.version.encode()
                         + " ".join(flags + tuple(libs)).encode()).hexdigest()[:16]
    out = CACHE_DIR / f"{name}_{key}{suffix}"
    if not out.exists():
        tmp = CACHE_DIR / f"{out.name}.{os.getpid()}.tmp"
        res = subprocess.run([cc.path, "-x", "c", "-std=gnu11", "-O2", *flags, str(source), "-o", str(tmp), *libs],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise SimulatorError(f"{source.name} failed to compile with {cc.describe()}:\n{res.stderr}")
        os.replace(tmp, out)
    return out


def _runtime_object() -> Path:
    return _compiled_c(RUNTIME, "runtime", ".o", flags=("-fPIC", "-c"))


def _runner() -> Path:
    """The msl_runner executable (runner.c), compiled once and cached like the kernels."""
    return _compiled_c(RUNNER, "msl_runner", "", libs=("-ldl",))


_CLANG_AS_NAMES = {"'__global'": "'device'", "'__private'": "'constant'", "'__local'": "'threadgroup'",
                   "__global ": "device ", "__private ": "constant ", "__local ": "threadgroup "}


def _metal_spelling(msg: str) -> str:
    for k, v in _CLANG_AS_NAMES.items():
        msg = msg.replace(k, v)
    return re.sub(r"::metal::msl_vec_make<(\w+)>\(", r"\1(", msg)


_METAL_HEADERS = ("metal_stdlib", "metal_math", "metal_simdgroup", "metal_atomic", "metal_integer",
                  "metal_compute", "metal_common", "metal_relational", "metal_geometric")


def _stub_include_dir() -> Path:
    """`#include <metal_stdlib>` etc. in a kernel header resolve to empty files (the shim has them)."""
    inc = CACHE_DIR / "include"
    inc.mkdir(parents=True, exist_ok=True)
    for h in _METAL_HEADERS:
        if not (inc / h).exists():
            tmp = inc / f"{h}.{os.getpid()}.tmp"
            tmp.write_text("#pragma once\n#include \"metal_shim.h\"\n")
            os.replace(tmp, inc / h)
    return inc


def compile_kernel(cpp_source: str) -> Path:
    """Compile (cached by source hash) to a shared library; SimulatorError carries clang's message."""
    key = hashlib.sha256((_tool_hash() + cpp_source).encode()).hexdigest()[:24]
    lib = CACHE_DIR / f"kernel_{key}.so"
    if lib.exists():
        return lib
    runtime_obj = _runtime_object()
    src = CACHE_DIR / f"kernel_{key}.{os.getpid()}.cpp"  # per process: parallel test runs
    src.write_text(cpp_source)
    tmp = lib.with_suffix(f".{os.getpid()}.tmp.so")
    cmd = [_clang(), *CLANG_FLAGS, *_sanitize_flags(), "-I", str(HERE), "-I", str(_stub_include_dir()), str(src),
           str(runtime_obj), "-o", str(tmp), "-lm"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SimulatorError(f"kernel failed to compile ({src}):\n{_metal_spelling(res.stderr)}")
    os.replace(tmp, lib)
    return lib


class _MslError(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int32), ("buffer", ctypes.c_int32), ("offset", ctypes.c_int64),
                ("message", ctypes.c_char * 2048)]


# Buffers in memfds, so a spawned msl_runner maps the driver's memory (Linux); elsewhere
# anonymous shared memory a forked child sees.
_MEMFD = hasattr(os, "memfd_create")


class _GuardedBuffer:
    """Shared memory (a memfd, or anonymous and fork-visible) whose data ends right before a
    PROT_NONE page.

    The bytes between the aligned end of the data and the guard page are canaries."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        padded = max(16, -(-nbytes // 16) * 16)
        data_pages = -(-padded // PAGE)
        self.fd = -1
        if _MEMFD:
            self.fd = os.memfd_create("msl_buffer")
            os.ftruncate(self.fd, (data_pages + 2) * PAGE)
        self.map = mmap.mmap(self.fd, (data_pages + 2) * PAGE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.start_offset = PAGE + data_pages * PAGE - padded
        self.address = base + self.start_offset
        self.map[:] = bytes([CANARY]) * len(self.map)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        for off in (0, (data_pages + 1) * PAGE):
            if libc.mprotect(base + off, PAGE, 0) != 0:
                raise OSError(ctypes.get_errno(), "mprotect failed")
        self._base = base
        self._data_pages = data_pages

    def view(self) -> np.ndarray:
        return np.frombuffer(self.map, dtype=np.uint8, count=self.nbytes, offset=self.start_offset)

    def canaries_intact(self) -> int:
        """-1 if intact, else the byte offset (from the data start) of the first clobbered canary."""
        lo = bytes(self.map[PAGE:self.start_offset])
        hi = bytes(self.map[self.start_offset + self.nbytes:(self._data_pages + 1) * PAGE])
        for i, b in enumerate(hi):
            if b != CANARY:
                return self.nbytes + i
        for i, b in enumerate(lo):
            if b != CANARY:
                return i - len(lo)
        return -1

    def close(self):
        libc = ctypes.CDLL(None)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mprotect(self._base, len(self.map), 3)
        try:
            self.map.close()
        except BufferError:
            pass  # a numpy view still exists; the GC frees the mapping later
        if self.fd >= 0:
            os.close(self.fd)                      # the mapping keeps the memory while it lives
            self.fd = -1


_POISON_BYTES = (0xAB, 0x54)  # integer poison per schedule (two, so a 1-byte 0xAB result is no false alarm)
_FLOAT_POISON_BITS = {  # quiet NaNs with payloads no arithmetic produces, one per schedule
    2: (0x7E5A, 0x7E3C), 4: (0x7FC5A5A5, 0x7FC3C3C3), 8: (0x7FF8A5A5A5A5A5A5, 0x7FF8C3C3C3C3C3C3)}
_BF16_POISON_BITS = (0x7FC5, 0x7FC3)


def _poison(dtype, variant: int = 0) -> np.ndarray:
    """One element of poison for run `variant`: a NaN with a payload for floats, 0xAB/0x54 bytes else."""
    if _is_bfloat16(dtype):
        return np.array([_BF16_POISON_BITS[variant]], dtype=np.uint16)
    dt = np.dtype(dtype)
    if dt.kind == "f":
        bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[dt.itemsize]
        return np.array([_FLOAT_POISON_BITS[dt.itemsize][variant]], dtype=bits).view(dt)
    return np.frombuffer(bytes([_POISON_BYTES[variant]]) * dt.itemsize, dtype=dt).copy()


def _run_child(lib: Path, bufs, grid, tg, reverse: int, timeout: float) -> _MslError:
    if sanitizers() and not _MEMFD:
        raise SimulatorError(f"{SANITIZE_ENV} needs the spawned runner (Linux memfds)")
    return (_run_spawned if _MEMFD else _run_forked)(lib, bufs, grid, tg, reverse, timeout)


def _child_status(result: _MslError, status: int, detail: str = "") -> _MslError:
    """``result`` with a child's exit status folded in (``status`` < 0: killed by signal -status)."""
    if status < 0:
        result.code = 2
        result.message = f"child killed by signal {-status}".encode()
    elif status != 0 and result.code == 0:
        result.code = 1
        result.message = f"child exited with status {status}{detail}".encode()[:2000]
    return result


def _run_spawned(lib: Path, bufs, grid, tg, reverse: int, timeout: float) -> _MslError:
    """The launch in a spawned msl_runner (runner.c) on the buffers' memfds."""
    size = ctypes.sizeof(_MslError)
    err_fd = os.memfd_create("msl_error")
    try:
        os.ftruncate(err_fd, size)
        args = [str(_runner()), str(lib), str(reverse), *map(str, grid), *map(str, tg), str(err_fd), str(size)]
        for b in bufs:
            args += [str(b.fd), str(len(b.map)), str(b.start_offset), str(b.nbytes)]
        env = {**os.environ, **_SANITIZER_ENV} if sanitizers() else None
        proc = subprocess.Popen(args, pass_fds=[err_fd] + [b.fd for b in bufs], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise SimulatorError(f"kernel did not finish within {timeout:.0f} s (infinite loop?)") from None
        result = _MslError.from_buffer_copy(os.pread(err_fd, size, 0))
    finally:
        os.close(err_fd)
    detail = stderr.decode(errors="replace").strip()
    report = re.search(r"(ERROR: AddressSanitizer.*|\S*: runtime error: .*)", detail, re.S)
    if report:  # a sanitizer stopped the launch: its report is the error
        result.code = 1
        result.message = f"sanitizer report: {report.group(1)}".encode()[:2000]
    return _child_status(result, proc.returncode, f": {detail}" if detail else "")


def _run_forked(lib: Path, bufs, grid, tg, reverse: int, timeout: float) -> _MslError:
    """The launch in a forked child (no memfd: the buffers are anonymous shared memory)."""
    err_map = mmap.mmap(-1, ctypes.sizeof(_MslError))
    err = _MslError.from_buffer(err_map)
    pid = os.fork()
    if pid == 0:  # child: run the kernel, report through err_map, never return to Python
        code = 1
        try:
            dll = ctypes.CDLL(str(lib))
            ptrs = (ctypes.c_void_p * max(1, len(bufs)))(*[b.address for b in bufs])
            sizes = (ctypes.c_int64 * max(1, len(bufs)))(*[b.nbytes for b in bufs])
            g = (ctypes.c_uint32 * 3)(*grid)
            t = (ctypes.c_uint32 * 3)(*tg)
            dll.msl_run.restype = ctypes.c_int
            rc = dll.msl_run(ptrs, sizes, len(bufs), g, t, reverse, ctypes.byref(err))
            code = 0 if rc == 0 else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise SimulatorError(f"kernel did not finish within {timeout:.0f} s (infinite loop?)")
        time.sleep(0.002)
    result = _MslError()
    ctypes.memmove(ctypes.byref(result), ctypes.byref(err), ctypes.sizeof(_MslError))
    del err
    err_map.close()
    return _child_status(result, -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


def _describe_error(e: _MslError, names: list[str], bufs) -> str:
    msg = e.message.decode(errors="replace")
    if e.code == 2 and e.buffer >= 0:
        nb = bufs[e.buffer].nbytes
        where = (f"{e.offset - nb} bytes past the end" if e.offset >= nb else f"{-e.offset} bytes before the start")
        return f"out-of-bounds access to buffer '{names[e.buffer]}' ({nb} bytes): {where} ({msg})"
    if e.code == 3:
        return f"stack overflow in a kernel thread (64 KiB coroutine stacks) ({msg})"
    if e.code == 2:
        return f"kernel crashed: {msg}"
    return msg


def run_metal_kernel(name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
                     header: str = "", *, inputs: Sequence, output_shapes: Sequence, output_dtypes: Sequence,
                     grid: tuple[int, int, int], threadgroup: tuple[int, int, int], template=None,
                     init_value=None, atomic_outputs: bool = False, allow_unwritten: bool = False,
                     schedules: Sequence[str] = ("forward", "reverse"), timeout: float = 120.0,
                     return_source: bool = False, written_inputs: Sequence[str] = ()) -> list[np.ndarray]:
    """Simulate `mx.fast.metal_kernel(name, input_names, output_names, source, header)(...)`.

    written_inputs: inputs the kernel writes in place (through a cast-away const); their contents
    after the run are returned after the outputs, in that order, and must agree across schedules
    too.

    The kernel runs once per schedule (thread/threadgroup order); outputs must agree bit for bit
    across schedules (a race such as a missing barrier makes them differ) unless atomic_outputs.
    Outputs are NaN/0xAB-poisoned first unless init_value is given; a still-poisoned element is an
    error unless allow_unwritten. bfloat16 outputs come back as uint16 bit patterns. Returns the outputs (and the generated Metal source if return_source).
    """
    if not (len(input_names) == len(inputs)):
        raise SimulatorError(f"[metal_kernel] Expected `inputs` to have size {len(input_names)} but got size {len(inputs)}.")
    if not (len(output_names) == len(output_shapes) == len(output_dtypes)):
        raise SimulatorError("[metal_kernel] output_names, output_shapes and output_dtypes differ in length")
    if not output_names:
        raise SimulatorError("[metal_kernel] Must specify at least one output.")
    arrays = [_as_input_array(x) for x in inputs]
    metal_source, cpp_source, args = generate_source(
        name, list(input_names), list(output_names), source, header, arrays, list(output_dtypes),
        template, atomic_outputs)
    lib = compile_kernel(cpp_source)

    arg_data: dict[str, np.ndarray] = {}
    for nm, arr in zip(input_names, arrays):
        arg_data[nm] = np.require(arr, requirements="C").view(np.ndarray)
        if arr.ndim > 0:
            arg_data[nm + "_shape"] = np.asarray(arr.shape, dtype=np.int32)
            arg_data[nm + "_strides"] = np.asarray([s // arr.itemsize for s in arr.strides], dtype=np.int64)
            arg_data[nm + "_ndim"] = np.asarray(arr.ndim, dtype=np.int32)
    out_dtypes = [_storage_dtype(dt) for dt in output_dtypes]
    out_sizes = [int(np.prod(shape, dtype=np.int64)) for shape in output_shapes]
    grid3 = tuple(int(v) for v in grid)
    tg3 = tuple(int(v) for v in threadgroup)
    if any(v <= 0 for v in tg3) or any(v < 0 for v in grid3):
        raise SimulatorError(f"invalid grid {grid3} / threadgroup {tg3}")

    results = []
    if len(schedules) not in (1, 2) or any(s not in ("forward", "reverse") for s in schedules):
        raise SimulatorError(f"schedules must be one or two of 'forward'/'reverse', got {schedules!r}")
    for variant, schedule in enumerate(schedules):
        bufs = []
        try:
            for a in args:
                if a.name in output_names:
                    continue
                data = arg_data[a.name]
                buf = _GuardedBuffer(data.nbytes)
                buf.view()[:] = data.reshape(-1).view(np.uint8)
                bufs.append(buf)
            out_bufs = []
            for i, dt in enumerate(out_dtypes):
                buf = _GuardedBuffer(out_sizes[i] * dt.itemsize)
                fill = (np.array([init_value]).astype(np.float64).astype(dt) if init_value is not None
                        and not _is_bfloat16(output_dtypes[i]) else _poison(output_dtypes[i], variant))
                if init_value is not None and _is_bfloat16(output_dtypes[i]):
                    fill = _float_to_bf16_bits(np.array([init_value], dtype=np.float32))
                buf.view().view(dt)[:] = fill[0]
                out_bufs.append(buf)
                bufs.append(buf)
            order = [a.name for a in args if a.name not in output_names] + list(output_names)
            # runtime buffer order is the kernel argument order
            by_name = dict(zip(order, bufs))
            ordered = [by_name[a.name] for a in args]
            err = _run_child(lib, ordered, grid3, tg3, 1 if schedule == "reverse" else 0, timeout)
            if err.code != 0:
                raise SimulatorError(f"kernel '{name}' ({schedule} schedule): "
                                     + _describe_error(err, [a.name for a in args], ordered))
            for a, b in zip(args, ordered):
                bad = b.canaries_intact()
                if bad != -1:
                    raise SimulatorError(f"kernel '{name}': out-of-bounds write to buffer '{a.name}' "
                                         f"at byte offset {bad} (buffer is {b.nbytes} bytes)")
            outs = [out_bufs[i].view().view(out_dtypes[i]).copy().reshape(output_shapes[i])
                    for i in range(len(out_bufs))]
            for wname in written_inputs:
                data = arg_data[wname]
                outs.append(by_name[wname].view().copy().view(data.dtype).reshape(data.shape))
        finally:
            for b in bufs:
                b.close()
        results.append(outs)
    if init_value is None and not allow_unwritten:
        _check_written(name, output_names, results, output_dtypes)

    unknown = [w for w in written_inputs if w not in input_names]
    if unknown:
        raise SimulatorError(f"written_inputs {unknown} are not inputs of kernel '{name}'")
    for sched, outs in zip(schedules[1:], results[1:]):
        for wname, a, b in zip(written_inputs, results[0][len(output_names):], outs[len(output_names):]):
            if not np.array_equal(_bytes_per_element(a), _bytes_per_element(b)):
                raise SimulatorError(f"kernel '{name}': written input '{wname}' depends on the thread schedule")
        for oname, a, b, dt0 in zip(output_names, results[0], outs, output_dtypes):
            if atomic_outputs:
                continue  # float atomics legitimately depend on the order
            differs = (_bytes_per_element(a) != _bytes_per_element(b)).any(axis=1)
            if init_value is None and allow_unwritten:  # unwritten elements hold different poisons
                differs &= ~((_bytes_per_element(a) == _poison(dt0, 0).view(np.uint8)).all(axis=1))
            if differs.any():
                idx = int(np.flatnonzero(differs)[0])
                raise SimulatorError(
                    f"kernel '{name}': output '{oname}' depends on the thread schedule "
                    f"({schedules[0]} vs {sched}: element {idx} is {a.reshape(-1)[idx]!r} vs "
                    f"{b.reshape(-1)[idx]!r}) - a race: missing threadgroup_barrier/simdgroup_barrier?")
    outs = results[0]
    return (outs, metal_source) if return_source else outs


def _bytes_per_element(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).reshape(a.size, a.itemsize)


def _float_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _check_written(name, output_names, results, output_dtypes):
    """An element is unwritten if it holds the poison of its run in every run."""
    for k, (oname, dt) in enumerate(zip(output_names, output_dtypes)):
        unwritten = None
        for variant, outs in enumerate(results):
            bits = _bytes_per_element(outs[k])
            poison = _poison(dt, variant).view(np.uint8)
            hit = (bits == poison).all(axis=1)
            unwritten = hit if unwritten is None else unwritten & hit
        if unwritten is not None and unwritten.any():
            i = int(np.flatnonzero(unwritten)[0])
            raise SimulatorError(
                f"kernel '{name}': output {oname} element {i} never written "
                f"({int(unwritten.sum())} of {unwritten.size} elements still hold the poison value; "
                "pass allow_unwritten=True if that is intended, or init_value)")
