"""Builds CUDA C++ kernels at first use with NVRTC and launches them through the CUDA driver API, both via ctypes.

No compiler is needed at install time and no Python package beyond torch: NVRTC ships with every CUDA build of torch
(the nvidia-cuda-nvrtc wheel, or the CUDA toolkit's lib64), and the driver library is the one torch itself uses.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

NVRTC_LIBRARY_ENV = "KVKERNELS_NVRTC_LIBRARY"
_NVRTC_SONAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")
_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


class CudaBuildUnavailable(RuntimeError):
    """NVRTC or the CUDA driver cannot be found or used here; callers fall back to the Triton kernels."""


class CudaBuildError(RuntimeError):
    """NVRTC rejected the source (a bug in this package): the message carries the compiler log."""


_lock = threading.Lock()
_nvrtc: ctypes.CDLL | None = None
_driver: ctypes.CDLL | None = None


def _candidate_nvrtc_paths() -> list[str]:
    configured = os.environ.get(NVRTC_LIBRARY_ENV)
    if configured:
        return [configured]
    found: list[str] = list(_NVRTC_SONAMES)
    for site in sys.path:
        found += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libnvrtc.so*")))
        found += sorted(glob.glob(os.path.join(site, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
    return [path for path in found if "builtins" not in Path(path).name and ".alt." not in Path(path).name]


def _preload_builtins(path: str) -> None:
    """NVRTC dlopens libnvrtc-builtins by name at compile time; for a library found by path (a pip wheel's folder, not
    on the loader's path) that fails unless the builtins beside it are loaded first."""
    if os.sep not in path:
        return
    for builtins in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*"))):
        if ".alt." not in Path(builtins).name:
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)


def nvrtc_library() -> ctypes.CDLL:
    """The NVRTC shared library (cached); CudaBuildUnavailable names where it was looked for."""
    global _nvrtc
    with _lock:
        if _nvrtc is None:
            tried = _candidate_nvrtc_paths()
            for path in tried:
                try:
                    _preload_builtins(path)
                    library = ctypes.CDLL(path)
                except OSError:
                    continue
                library.nvrtcGetErrorString.restype = ctypes.c_char_p
                _nvrtc = library
                break
            else:
                raise CudaBuildUnavailable(
                    f"NVRTC not found (tried {', '.join(tried[:6])}...); set {NVRTC_LIBRARY_ENV} to libnvrtc.so"
                )
        return _nvrtc


def _driver_library() -> ctypes.CDLL:
    global _driver
    with _lock:
        if _driver is None:
            try:
                _driver = ctypes.CDLL("libcuda.so.1")
            except OSError as error:
                raise CudaBuildUnavailable(f"the CUDA driver library cannot be loaded: {error}") from None
        return _driver


def _check_nvrtc(library: ctypes.CDLL, status: int, what: str) -> None:
    if status != 0:
        raise CudaBuildError(f"{what}: {library.nvrtcGetErrorString(status).decode()}")


def _check_driver(status: int, what: str) -> None:
    if status != 0:
        text = ctypes.c_char_p()
        _driver_library().cuGetErrorString(status, ctypes.byref(text))
        raise RuntimeError(f"{what} failed: CUDA error {status} ({(text.value or b'?').decode()})")


def compile_cubin(source: str, name: str, arch: int, defines: dict[str, int]) -> bytes:
    """Machine code for sm_<arch> (e.g. 90) of `source`, compiled with -D<key>=<value> for each define."""
    library = nvrtc_library()
    program = ctypes.c_void_p()
    _check_nvrtc(
        library,
        library.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        options = [f"--gpu-architecture=sm_{arch}", "--std=c++17", "--use_fast_math"]
        options += [f"-D{key}={value}" for key, value in sorted(defines.items())]
        encoded = (ctypes.c_char_p * len(options))(*[option.encode() for option in options])
        status = library.nvrtcCompileProgram(program, len(options), encoded)
        if status != 0:
            size = ctypes.c_size_t()
            library.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            library.nvrtcGetProgramLog(program, log)
            raise CudaBuildError(f"{name} did not compile ({' '.join(options)}):\n{log.value.decode()[-4000:]}")
        size = ctypes.c_size_t()
        _check_nvrtc(library, library.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check_nvrtc(library, library.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return cubin.raw
    finally:
        library.nvrtcDestroyProgram(ctypes.byref(program))


# Argument kinds of a kernel signature: a device pointer, a 32-bit int, a 64-bit int, a float.
ArgKind = type[ctypes.c_void_p] | type[ctypes.c_int32] | type[ctypes.c_int64] | type[ctypes.c_float]
Arg = torch.Tensor | int | float


@dataclass
class CudaKernel:
    """One loaded kernel function on one device, with its argument kinds."""

    function: ctypes.c_void_p
    module: ctypes.c_void_p
    signature: tuple[ArgKind, ...]
    shared_bytes: int
    _resident: dict[int, int] = field(default_factory=dict, repr=False)

    def resident_blocks(self, threads: int) -> int:
        """Blocks of `threads` threads that fit on one multiprocessor at once (registers, shared memory, warps), as
        the driver computes it from the loaded code: a host-side query (cached), no work on the device."""
        if threads not in self._resident:
            blocks = ctypes.c_int()
            _check_driver(
                _driver_library().cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    ctypes.byref(blocks), self.function, ctypes.c_int(threads), ctypes.c_size_t(self.shared_bytes)
                ),
                "cuOccupancyMaxActiveBlocksPerMultiprocessor",
            )
            self._resident[threads] = blocks.value
        return self._resident[threads]

    def launch(self, grid: tuple[int, int, int], threads: int, stream: int, args: Sequence[Arg]) -> None:
        if len(args) != len(self.signature):
            raise TypeError(f"the kernel takes {len(self.signature)} arguments, got {len(args)}")
        values: list[ctypes.c_void_p | ctypes.c_int32 | ctypes.c_int64 | ctypes.c_float] = []
        for kind, arg in zip(self.signature, args, strict=True):
            if isinstance(arg, torch.Tensor):
                values.append(ctypes.c_void_p(arg.data_ptr()))
            elif kind is ctypes.c_float:
                values.append(ctypes.c_float(float(arg)))
            else:
                values.append(kind(int(arg)))
        pointers = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
        _check_driver(
            _driver_library().cuLaunchKernel(
                self.function,
                *(ctypes.c_uint(n) for n in grid),
                ctypes.c_uint(threads),
                ctypes.c_uint(1),
                ctypes.c_uint(1),
                ctypes.c_uint(self.shared_bytes),
                ctypes.c_void_p(stream),
                pointers,
                None,
            ),
            "cuLaunchKernel",
        )


def load_kernel(
    cubin: bytes, function_name: str, device: torch.device, signature: tuple[ArgKind, ...], shared_bytes: int
) -> CudaKernel:
    """Loads `cubin` into `device`'s primary context (the one torch uses) and allows `shared_bytes` of dynamic
    shared memory for `function_name`."""
    driver = _driver_library()
    with torch.cuda.device(device):
        torch.cuda.current_stream(device)  # makes torch create and bind the primary context first
        module = ctypes.c_void_p()
        _check_driver(driver.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
        function = ctypes.c_void_p()
        _check_driver(
            driver.cuModuleGetFunction(ctypes.byref(function), module, function_name.encode()), "cuModuleGetFunction"
        )
        _check_driver(
            driver.cuFuncSetAttribute(function, _MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_int(shared_bytes)),
            "cuFuncSetAttribute",
        )
    return CudaKernel(function, module, signature, shared_bytes)
