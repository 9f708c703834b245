"""ImageNet preprocessing presets: JPEG bytes in, ``size x size x 3`` uint8 RGB out.

uint8 keeps batches small on the wire (4x less than float32); mean/std normalisation belongs
on the accelerator. Each preset is a picklable callable on the image component with
``reseed(epoch)``: its random draws are a function of (seed, epoch, worker), so two runs with
the same seed and worker layout give the same images.

Decoders (``decoder``): ``"auto"`` decodes JPEGs with the fused crop-and-scale decoder
(:mod:`feedline.producer.image.turbo`) when it is built and OpenCV otherwise; ``"opencv"`` always
uses OpenCV (its 1/2, 1/4, 1/8 reduced decode with ``reduced_decode``). Other formats, and
the JPEGs the fused decoder leaves to OpenCV (CMYK/YCCK, 12-bit, lossless), go to OpenCV
with the same crop box. ``reduced_decode=False`` is the reference: a full OpenCV decode, then
crop and resize. ``max_pixels`` bounds the declared size of an image any decoder takes: a
larger one is a :class:`~feedline.producer.image.decode.CorruptImage`, refused before anything of
its
size is allocated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from feedline.errors import ConfigError
from feedline.producer.dataflow.worker import get_worker, make_rng
from feedline.producer.image import turbo
from feedline.producer.image.color import ColorJitter, Lighting
from feedline.producer.image.decode import (
    MAX_PIXELS,
    as_buffer,
    decode,
    jpeg_size,
    reduction_for,
    to_rgb,
)
from feedline.producer.image.geometry import (
    CenterCrop,
    Flip,
    RandomResizedCrop,
    ResizeShortestEdge,
    resize,
)

DECODERS = ("auto", "opencv")


def _fused(decoder: str, reduced_decode: bool) -> bool:
    if decoder not in DECODERS:
        raise ConfigError(f"decoder must be one of {DECODERS}, got {decoder!r}")
    return reduced_decode and decoder == "auto" and turbo.AVAILABLE


def _jpeg_header(buf: np.ndarray, data: Any) -> tuple[int, int] | None:
    """libjpeg's (height, width) of a JPEG the fused decoder takes, else None (not a JPEG,
    or one left to OpenCV). A corrupt JPEG raises CorruptImage naming its file."""
    if buf.size < 2 or buf[0] != 0xFF or buf[1] != 0xD8:
        return None
    try:
        return turbo.header(buf, data)
    except turbo.Unsupported:
        return None


class _Seeded:
    """A generator per pass, made when first drawn from: exact delivery reseeds once per
    sample, and making a generator (~40 us) is wasted on a sample that draws nothing."""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        self.reseed(0)

    def reseed(self, epoch: int) -> None:
        """Start pass ``epoch`` (the worker index is the calling worker's)."""
        self._pass = (epoch, get_worker().index)
        self._rng: np.random.Generator | None = None

    @property
    def rng(self) -> np.random.Generator:
        if self._rng is None:
            self._rng = make_rng(self.seed, *self._pass)
        return self._rng


class ImageNetTrain(_Seeded):
    """Decode -> RandomResizedCrop(size) -> horizontal flip [-> colour jitter -> lighting].

    The crop box is drawn from the JPEG header's size before decoding. The fused decoder
    then decodes only the box's region at the smallest DCT scale M/8 that keeps it at least
    ``size`` on both sides; with OpenCV, a box at least 2x (4x, 8x) the output size is
    decoded at 1/2 (1/4, 1/8) scale (``reduced_decode``). Either way, the same region at the
    same output size.
    """

    def __init__(self, size: int = 224, seed: int = 0, scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (3 / 4, 4 / 3), flip: bool = True,
                 color_jitter: float = 0.0, lighting: float = 0.0,
                 reduced_decode: bool = True, decoder: str = "auto",
                 max_pixels: int = MAX_PIXELS) -> None:
        super().__init__(seed)
        self.size = int(size)
        self.fused = _fused(decoder, reduced_decode)
        self.decoder, self.max_pixels = decoder, int(max_pixels)
        self.crop = RandomResizedCrop(size, (scale[0], scale[1]), (ratio[0], ratio[1]))
        self.flip = Flip() if flip else None
        self.jitter = ColorJitter(30.0 * color_jitter / 0.4, color_jitter, color_jitter) \
            if color_jitter else None
        self.lighting = Lighting(lighting) if lighting else None
        self.reduced_decode = reduced_decode

    def __call__(self, data: Any) -> np.ndarray:
        buf = as_buffer(data)
        rng = self.rng
        if self.fused:
            hw = _jpeg_header(buf, data)
            if hw is not None:
                y0, x0, ch, cw = self.crop.sample_box(hw[0], hw[1], rng)
                # The flip's draw, as Flip makes it (next after the box): the resampler
                # then writes the image mirrored, which costs nothing.
                flip = self.flip is not None and rng.random() < self.flip.prob
                # Colour augmentors work in BGR (OpenCV's order); without them, decode to RGB.
                bgr = self.jitter is not None or self.lighting is not None
                try:
                    img = turbo.decode_box(buf, hw, (y0, x0, y0 + ch, x0 + cw),
                                           (self.size, self.size), bgr, data, self.max_pixels,
                                           flip=flip, index=getattr(data, "jpeg_index", None))
                except turbo.Unsupported:
                    img = decode(buf, source=data, max_pixels=self.max_pixels)
                    img = resize(img[y0:y0 + ch, x0:x0 + cw], self.size, self.size, flip)
                    bgr = True
                return self._augment(img, rng, bgr, flipped=True)
        hw = jpeg_size(buf) if self.reduced_decode else None
        if hw is None:
            img = decode(buf, source=data, max_pixels=self.max_pixels)
            y0, x0, ch, cw = self.crop.sample_box(img.shape[0], img.shape[1], rng)
        else:
            y0, x0, ch, cw = self.crop.sample_box(hw[0], hw[1], rng)
            r = reduction_for(hw, (ch, cw), (self.size, self.size))
            img = decode(buf, r, source=data, max_pixels=self.max_pixels)
            if r > 1:  # the box in reduced pixels (libjpeg rounds sizes up)
                y1, x1 = min(img.shape[0], -(-(y0 + ch) // r)), min(img.shape[1],
                                                                   -(-(x0 + cw) // r))
                y0, x0 = y0 // r, x0 // r
                ch, cw = y1 - y0, x1 - x0
        img = resize(img[y0:y0 + ch, x0:x0 + cw], self.size, self.size)
        return self._augment(img, rng, True)

    def _augment(self, img: np.ndarray, rng: np.random.Generator, bgr: bool,
                 flipped: bool = False) -> np.ndarray:
        """The augmentors after the crop; ``flipped``: the flip was drawn and applied."""
        if self.flip is not None and not flipped:
            img = self.flip(img, rng)
        if self.jitter is not None:
            img = self.jitter(img, rng)
        if self.lighting is not None:
            img = self.lighting(img, rng)
        return to_rgb(img) if bgr else img


class ImageNetVal(_Seeded):
    """Decode -> ResizeShortestEdge(resize) -> CenterCrop(size); deterministic.

    With ``reduced_decode`` the fused decoder decodes only the region that survives the
    centre crop, at the smallest DCT scale M/8 that keeps the shorter side >= ``resize``
    (that region then at least ``size``); OpenCV decodes the whole image at the largest
    1/2^k scale whose shorter side is still >= ``resize``.
    """

    def __init__(self, size: int = 224, resize: int = 256, reduced_decode: bool = True,
                 seed: int = 0, decoder: str = "auto", max_pixels: int = MAX_PIXELS) -> None:
        super().__init__(seed)
        self.size, self.resize_to = int(size), int(resize)
        self.max_pixels = int(max_pixels)
        self.short = ResizeShortestEdge(resize)
        self.center = CenterCrop(size)
        self.reduced_decode = reduced_decode
        self.fused = _fused(decoder, reduced_decode)
        self.decoder = decoder

    def crop_box(self, h: int, w: int) -> tuple[tuple[float, float, float, float],
                                                 tuple[int, int]]:
        """The source box ``(y0, x0, y1, x1)`` that resize-then-centre-crop keeps, and the
        output's ``(height, width)``: the same pixel grid as resizing the whole image."""
        oh, ow = self.short.output_hw(h, w)
        ch, cw = min(self.size, oh), min(self.size, ow)
        cy, cx = max(0, (oh - self.size) // 2), max(0, (ow - self.size) // 2)
        fy, fx = h / oh, w / ow
        return (cy * fy, cx * fx, (cy + ch) * fy, (cx + cw) * fx), (ch, cw)

    def __call__(self, data: Any) -> np.ndarray:
        buf = as_buffer(data)
        hw = _jpeg_header(buf, data) if self.fused else None
        if hw is not None:
            box, out_hw = self.crop_box(*hw)
            try:
                return turbo.decode_box(buf, hw, box, out_hw, False, data, self.max_pixels,
                                        index=getattr(data, "jpeg_index", None))
            except turbo.Unsupported:
                img = decode(buf, source=data, max_pixels=self.max_pixels)
                return to_rgb(np.ascontiguousarray(self.center(self.short(img))))
        hw = jpeg_size(buf) if self.reduced_decode else None
        r = 1
        if hw is not None:
            s = min(hw)
            r = reduction_for(hw, (s, s), (self.resize_to, self.resize_to))
        img = self.center(self.short(decode(buf, r, source=data, max_pixels=self.max_pixels)))
        return to_rgb(np.ascontiguousarray(img))


class Augment(_Seeded):
    """Apply a list of augmentors (``aug(img, rng)``) in order, to an array."""

    def __init__(self, augmentors: Sequence[Any], seed: int = 0) -> None:
        super().__init__(seed)
        self.augmentors = list(augmentors)

    def __call__(self, img: np.ndarray) -> np.ndarray:
        for aug in self.augmentors:
            img = aug(img, self.rng)
        return img


class Decode:
    """JPEG/PNG bytes -> HxWx3 uint8 (RGB unless ``bgr``)."""

    def __init__(self, bgr: bool = False) -> None:
        self.bgr = bgr

    def __call__(self, data: Any) -> np.ndarray:
        img = decode(data)
        return img if self.bgr else to_rgb(img)
