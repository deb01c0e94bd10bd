"""Only the C runtime needs setup.py: everything else is declared in pyproject.toml."""
from glob import glob

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "fucina.runtime._rt",
    sorted(glob("fucina/runtime/*.c")),
    depends=sorted(glob("fucina/runtime/*.h")),
    extra_compile_args=["-O2", "-pthread", "-std=c11"],
    extra_link_args=["-pthread"],
)])
