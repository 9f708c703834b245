"""The optional C extension; everything else about the package is in pyproject.toml.

``feedline.producer.image._jpegturbo`` decodes a JPEG's crop region at a DCT scale of M/8 over
libjpeg-turbo (``jpeglib.h``). It needs a C compiler and the libjpeg-turbo headers (Debian:
``gcc libjpeg62-turbo-dev``; Fedora: ``gcc libjpeg-turbo-devel``). Where either is missing
the build says so and goes on: the package installs without it and OpenCV decodes instead
(``feedline.producer.image.decoder_info()`` and ``feedline --version`` say which decoder runs).
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

IMAGE = "feedline/producer/image"


class OptionalBuildExt(build_ext):
    """``build_ext`` that drops an extension it cannot build instead of failing the install."""

    def build_extensions(self) -> None:
        for ext in list(self.extensions):
            try:
                self.build_extension(ext)
            except Exception as e:  # no compiler, no headers, a link error: all the same
                # Dropped from the list, so that nothing later (the in-place copy of an
                # editable install, the wheel's file list) looks for its output.
                self.extensions.remove(ext)
                print(f"WARNING: feedline: {ext.name} not built ({type(e).__name__}: {e}); "
                      "JPEGs will be decoded by OpenCV. Install a C compiler and the "
                      "libjpeg-turbo headers (Debian: gcc libjpeg62-turbo-dev) and reinstall "
                      "to build it.", file=sys.stderr)


setup(
    ext_modules=[
        Extension("feedline.producer.image._jpegturbo",
                  [f"{IMAGE}/_jpegturbo.c", f"{IMAGE}/_jpgidx.c", f"{IMAGE}/_mcuindex.c",
                   f"{IMAGE}/_prepare.c", f"{IMAGE}/_resample.c"],
                  depends=[f"{IMAGE}/_jt.h", f"{IMAGE}/_jpgidx.h", f"{IMAGE}/_mcuindex.h"],
                  libraries=["jpeg"]),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
