"""Image decoding and ImageNet augmentors (OpenCV, uint8 in and out)."""

from producer.image.color import Brightness, ColorJitter, Contrast, Lighting, Saturation
from producer.image.decode import CorruptImage, decode, jpeg_size, reduction_for, to_rgb
from producer.image.geometry import CenterCrop, Flip, RandomResizedCrop, ResizeShortestEdge
from producer.image.presets import Augment, Decode, ImageNetTrain, ImageNetVal

__all__ = [
    "Augment",
    "Brightness",
    "CenterCrop",
    "ColorJitter",
    "Contrast",
    "CorruptImage",
    "Decode",
    "Flip",
    "ImageNetTrain",
    "ImageNetVal",
    "Lighting",
    "RandomResizedCrop",
    "ResizeShortestEdge",
    "Saturation",
    "decode",
    "jpeg_size",
    "reduction_for",
    "to_rgb",
]
