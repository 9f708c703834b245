"""Image decoding (libjpeg-turbo's fused crop+scale where built, else OpenCV) and ImageNet
augmentors (OpenCV, uint8 in and out)."""

from feedline.producer.image.color import Brightness, ColorJitter, Contrast, Lighting, Saturation
from feedline.producer.image.decode import CorruptImage, decode, jpeg_size, reduction_for, to_rgb
from feedline.producer.image.geometry import CenterCrop, Flip, RandomResizedCrop, ResizeShortestEdge
from feedline.producer.image.prepared import is_prepared, prepare_jpeg
from feedline.producer.image.presets import Augment, Decode, ImageNetTrain, ImageNetVal
from feedline.producer.image.turbo import decoder_info

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
    "decoder_info",
    "is_prepared",
    "jpeg_size",
    "prepare_jpeg",
    "reduction_for",
    "to_rgb",
]
