"""Colour augmentors on uint8 images: Brightness, Contrast, Saturation, ColorJitter, Lighting.

Same calling convention as :mod:`feedline.producer.image.geometry`. Arithmetic saturates to uint8 in
OpenCV (no float copy of the image). Images are BGR (OpenCV's order) until the preset
converts them; ``Saturation`` and ``Lighting`` take the channel order into account.
"""

from __future__ import annotations

import cv2
import numpy as np

# AlexNet's PCA of ImageNet RGB pixels (0-255 scale), rows of eigvec are R, G, B.
EIGVAL = np.array([0.2175, 0.0188, 0.0045]) * 255.0
EIGVEC = np.array([[-0.5675, 0.7192, 0.4009],
                   [-0.5808, -0.0045, -0.8140],
                   [-0.5836, -0.6948, 0.4203]])


class Brightness:
    """Add a uniform delta in ``[-delta, delta]`` to every pixel."""

    def __init__(self, delta: float) -> None:
        self.delta = float(delta)

    def __call__(self, img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        d = rng.uniform(-self.delta, self.delta)
        return cv2.convertScaleAbs(img, alpha=1.0, beta=d) if d >= 0 else \
            cv2.subtract(img, np.full_like(img, round(-d)))


class Contrast:
    """Blend with the image's mean grey by a factor drawn from ``factor_range``."""

    def __init__(self, factor_range: tuple[float, float] = (0.6, 1.4)) -> None:
        self.lo, self.hi = map(float, factor_range)

    def __call__(self, img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        a = rng.uniform(self.lo, self.hi)
        mean = float(cv2.cvtColor(img, cv2.COLOR_BGR2GRAY).mean())
        return cv2.addWeighted(img, a, img, 0.0, mean * (1.0 - a))


class Saturation:
    """Blend with the grey image by a factor in ``[1 - alpha, 1 + alpha]``."""

    def __init__(self, alpha: float = 0.4) -> None:
        self.alpha = float(alpha)

    def __call__(self, img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        a = 1.0 + rng.uniform(-self.alpha, self.alpha)
        grey = cv2.cvtColor(cv2.cvtColor(img, cv2.COLOR_BGR2GRAY), cv2.COLOR_GRAY2BGR)
        return cv2.addWeighted(img, a, grey, 1.0 - a, 0.0)


class ColorJitter:
    """Brightness, contrast and saturation, each if non-zero, in a random order
    (tensorpack's fbresnet augmentor)."""

    def __init__(self, brightness: float = 30.0, contrast: float = 0.4,
                 saturation: float = 0.4) -> None:
        self.augs: list = []
        if brightness:
            self.augs.append(Brightness(brightness))
        if contrast:
            self.augs.append(Contrast((1 - contrast, 1 + contrast)))
        if saturation:
            self.augs.append(Saturation(saturation))

    def __call__(self, img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        for i in rng.permutation(len(self.augs)):
            img = self.augs[i](img, rng)
        return img


class Lighting:
    """AlexNet-style PCA lighting noise: add ``eigvec @ (alpha * eigval)``, alpha ~ N(0, std)."""

    def __init__(self, std: float = 0.1) -> None:
        self.std = float(std)

    def __call__(self, img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        alpha = rng.normal(0.0, self.std, 3)
        rgb = EIGVEC @ (alpha * EIGVAL)
        delta = np.array([rgb[2], rgb[1], rgb[0]], np.float32)  # BGR
        out = img.astype(np.int16) + np.round(delta).astype(np.int16)
        return np.clip(out, 0, 255).astype(np.uint8)
