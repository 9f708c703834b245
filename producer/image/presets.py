"""ImageNet preprocessing presets: JPEG bytes in, ``size x size x 3`` uint8 RGB out.

uint8 keeps batches small on the wire (4x less than float32); mean/std normalisation belongs
on the accelerator. Each preset is a picklable callable on the image component with
``reseed(epoch)``: its random draws are a function of (seed, epoch, worker), so two runs with
the same seed and worker layout give the same images.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from producer.dataflow.worker import make_rng
from producer.image.color import ColorJitter, Lighting
from producer.image.decode import as_buffer, decode, jpeg_size, reduction_for, to_rgb
from producer.image.geometry import CenterCrop, Flip, RandomResizedCrop, ResizeShortestEdge, resize


class _Seeded:
    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        self.rng = make_rng(self.seed, 0)

    def reseed(self, epoch: int) -> None:
        """Start pass ``epoch`` (the worker index is the calling worker's)."""
        self.rng = make_rng(self.seed, epoch)


class ImageNetTrain(_Seeded):
    """Decode -> RandomResizedCrop(size) -> horizontal flip [-> colour jitter -> lighting].

    The crop box is drawn from the JPEG header's size before decoding; when the box is at
    least 2x (4x, 8x) the output size the JPEG is decoded at 1/2 (1/4, 1/8) scale by libjpeg
    (``reduced_decode``), then cropped and resized: the same region at the same output size.
    """

    def __init__(self, size: int = 224, seed: int = 0, scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (3 / 4, 4 / 3), flip: bool = True,
                 color_jitter: float = 0.0, lighting: float = 0.0,
                 reduced_decode: bool = True) -> None:
        super().__init__(seed)
        self.size = int(size)
        self.crop = RandomResizedCrop(size, (scale[0], scale[1]), (ratio[0], ratio[1]))
        self.flip = Flip() if flip else None
        self.jitter = ColorJitter(30.0 * color_jitter / 0.4, color_jitter, color_jitter) \
            if color_jitter else None
        self.lighting = Lighting(lighting) if lighting else None
        self.reduced_decode = reduced_decode

    def __call__(self, data: Any) -> np.ndarray:
        buf = as_buffer(data)
        rng = self.rng
        hw = jpeg_size(buf) if self.reduced_decode else None
        if hw is None:
            img = decode(buf)
            y0, x0, ch, cw = self.crop.sample_box(img.shape[0], img.shape[1], rng)
        else:
            y0, x0, ch, cw = self.crop.sample_box(hw[0], hw[1], rng)
            r = reduction_for(hw, (ch, cw), (self.size, self.size))
            img = decode(buf, r)
            if r > 1:  # the box in reduced pixels (libjpeg rounds sizes up)
                y1, x1 = min(img.shape[0], -(-(y0 + ch) // r)), min(img.shape[1],
                                                                   -(-(x0 + cw) // r))
                y0, x0 = y0 // r, x0 // r
                ch, cw = y1 - y0, x1 - x0
        img = resize(img[y0:y0 + ch, x0:x0 + cw], self.size, self.size)
        if self.flip is not None:
            img = self.flip(img, rng)
        if self.jitter is not None:
            img = self.jitter(img, rng)
        if self.lighting is not None:
            img = self.lighting(img, rng)
        return to_rgb(img)


class ImageNetVal(_Seeded):
    """Decode -> ResizeShortestEdge(resize) -> CenterCrop(size); deterministic.

    With ``reduced_decode`` the JPEG is decoded at the largest 1/2^k scale whose shorter
    side is still >= ``resize``.
    """

    def __init__(self, size: int = 224, resize: int = 256, reduced_decode: bool = True,
                 seed: int = 0) -> None:
        super().__init__(seed)
        self.size, self.resize_to = int(size), int(resize)
        self.short = ResizeShortestEdge(resize)
        self.center = CenterCrop(size)
        self.reduced_decode = reduced_decode

    def __call__(self, data: Any) -> np.ndarray:
        buf = as_buffer(data)
        hw = jpeg_size(buf) if self.reduced_decode else None
        r = 1
        if hw is not None:
            s = min(hw)
            r = reduction_for(hw, (s, s), (self.resize_to, self.resize_to))
        img = self.center(self.short(decode(buf, r)))
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
