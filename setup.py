"""Builds the native CPU kernels (cpu_kernels/src) as an extension of the package.

The kernels include XLA's FFI headers, which ship with jaxlib (a build requirement). A machine
without a C++ compiler still installs jmoe: the build is skipped with a warning and every CPU
kernel call runs the XLA reference instead.
"""

import os
import sys
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def ffi_include_dir() -> str:
    import jaxlib

    return os.path.join(os.path.dirname(jaxlib.__file__), "include")


def compiling_sources_at_once(compiler) -> None:
    """Compile an extension's sources side by side (each a compiler process of its own; setuptools
    compiles one after another): the two translation units take about 35 s and 15 s alone."""
    one_by_one = compiler.compile

    def compile(sources, *args, **kwargs):
        with ThreadPoolExecutor(max(1, min(len(sources), os.cpu_count() or 1))) as pool:
            parts = pool.map(lambda source: one_by_one([source], *args, **kwargs), sources)
            return [obj for objects in parts for obj in objects]

    compiler.compile = compile


class OptionalBuildExt(build_ext):
    def build_extensions(self):
        for ext in self.extensions:
            ext.include_dirs.append(ffi_include_dir())
        compiling_sources_at_once(self.compiler)
        try:
            super().build_extensions()
        except Exception as e:  # no compiler, or headers missing: jmoe runs the XLA reference
            print(f"warning: the native CPU kernels were not built ({e}); the XLA reference runs instead",
                  file=sys.stderr)


native = Extension(
    "cpu_kernels._native",
    sources=["cpu_kernels/src/kernels.cc", "cpu_kernels/src/attention.cc"],
    depends=["cpu_kernels/src/gemm.inc", "cpu_kernels/src/int8_dot.inc", "cpu_kernels/src/int8_dot_rows.inc",
             "cpu_kernels/src/int8_dot_avx2.inc",
             "cpu_kernels/src/attention_body.inc", "cpu_kernels/src/parallel.h", "cpu_kernels/src/isa.h"],
    language="c++",
    # -g0: Python's own flags ask for debug info, which takes a quarter of the build's time and
    # most of the object's size; the symbol table (what a profiler names functions by) stays
    extra_compile_args=["-O3", "-g0", "-std=c++17", "-Wno-psabi", "-Wno-attributes",
                        "-Wno-return-type"],
)

setup(ext_modules=[native], cmdclass={"build_ext": OptionalBuildExt})
