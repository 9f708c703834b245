"""Geometric augmentors: ResizeShortestEdge, RandomResizedCrop, CenterCrop, Flip.

An augmentor is a callable ``aug(img, rng) -> img`` on an HxWxC uint8 array; ``rng`` is the
numpy Generator of the current pass (a function of seed, epoch and worker), so augmentors
hold no random state and stay picklable. Inputs are never modified in place.
"""

from __future__ import annotations

import math

import cv2
import numpy as np

from feedline.errors import ConfigError


def resize(img: np.ndarray, w: int, h: int) -> np.ndarray:
    """Resize with area averaging when shrinking by more than 2x (no aliasing), else
    bilinear (as tf.image.resize)."""
    shrink = min(img.shape[1] / max(w, 1), img.shape[0] / max(h, 1))
    interp = cv2.INTER_AREA if shrink > 2.0 else cv2.INTER_LINEAR
    return cv2.resize(img, (w, h), interpolation=interp)


class ResizeShortestEdge:
    """Scale so the shorter side is ``size`` (aspect ratio kept)."""

    def __init__(self, size: int) -> None:
        self.size = int(size)

    def output_hw(self, h: int, w: int) -> tuple[int, int]:
        s = self.size / min(h, w)
        return max(1, round(h * s)), max(1, round(w * s))

    def __call__(self, img: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        oh, ow = self.output_hw(*img.shape[:2])
        return resize(img, ow, oh)


class CenterCrop:
    """The central ``size x size`` region (smaller images are returned as they are)."""

    def __init__(self, size: int) -> None:
        self.size = int(size)

    def __call__(self, img: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        h, w = img.shape[:2]
        y0, x0 = max(0, (h - self.size) // 2), max(0, (w - self.size) // 2)
        return img[y0:y0 + self.size, x0:x0 + self.size]


class RandomResizedCrop:
    """Inception-style crop: a region of ``scale`` of the area and aspect ratio in ``ratio``
    (log-uniform), resized to ``size x size``; after 10 failed draws, a centre crop."""

    def __init__(self, size: int, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> None:
        self.size = int(size)
        self.scale: tuple[float, float] = (float(scale[0]), float(scale[1]))
        self.ratio: tuple[float, float] = (float(ratio[0]), float(ratio[1]))
        if not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise ConfigError(f"scale must satisfy 0 < lo <= hi <= 1, got {scale}")

    def sample_box(self, h: int, w: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
        """``(y0, x0, ch, cw)`` of the region to keep, in source pixels."""
        area = h * w
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            ar = math.exp(rng.uniform(log_lo, log_hi))
            cw = round(math.sqrt(target * ar))
            ch = round(math.sqrt(target / ar))
            if 0 < cw <= w and 0 < ch <= h:
                y0 = int(rng.integers(0, h - ch + 1))
                x0 = int(rng.integers(0, w - cw + 1))
                return y0, x0, ch, cw
        in_ratio = w / h
        if in_ratio < self.ratio[0]:
            cw, ch = w, round(w / self.ratio[0])
        elif in_ratio > self.ratio[1]:
            ch, cw = h, round(h * self.ratio[1])
        else:
            cw, ch = w, h
        return (h - ch) // 2, (w - cw) // 2, ch, cw

    def __call__(self, img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        y0, x0, ch, cw = self.sample_box(img.shape[0], img.shape[1], rng)
        return resize(img[y0:y0 + ch, x0:x0 + cw], self.size, self.size)


class Flip:
    """Mirror left-right with probability ``prob``."""

    def __init__(self, prob: float = 0.5) -> None:
        self.prob = float(prob)

    def __call__(self, img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        if rng.random() < self.prob:
            return cv2.flip(img, 1)
        return img
