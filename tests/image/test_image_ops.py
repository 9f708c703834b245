"""Image decoding and augmentors: shapes, dtypes, equivalence of reduced decode, seeding."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from feedline.producer.dataflow import make_rng
from feedline.producer.image import (
    Brightness,
    CenterCrop,
    ColorJitter,
    Contrast,
    CorruptImage,
    Flip,
    ImageNetTrain,
    ImageNetVal,
    Lighting,
    RandomResizedCrop,
    ResizeShortestEdge,
    Saturation,
    decode,
    jpeg_size,
    reduction_for,
)
from feedline.producer.image.geometry import resize
from tests.support.jpeg_data import make_image


def jpeg(h: int, w: int, index: int = 0, **kw) -> np.ndarray:
    ok, enc = cv2.imencode(".jpg", make_image(index, h, w), [cv2.IMWRITE_JPEG_QUALITY, 92])
    assert ok
    return enc.reshape(-1)


def test_jpeg_size_reads_the_header_without_decoding() -> None:
    for h, w in [(375, 500), (17, 923), (1024, 8)]:
        assert jpeg_size(jpeg(h, w)) == (h, w)
    ok, png = cv2.imencode(".png", make_image(0, 10, 10))
    assert jpeg_size(png.reshape(-1)) is None
    assert jpeg_size(np.frombuffer(b"\xff\xd8\xff", np.uint8)) is None


def test_decode_full_and_reduced_and_corrupt() -> None:
    buf = jpeg(301, 403)
    assert decode(buf).shape == (301, 403, 3)
    for r in (2, 4, 8):
        assert decode(buf, r).shape == (-(-301 // r), -(-403 // r), 3)
    with pytest.raises(CorruptImage):
        decode(np.frombuffer(b"\xff\xd8\xff\xe0 not really a jpeg", np.uint8))
    with pytest.raises(CorruptImage):
        decode(b"")
    truncated = buf[: buf.size // 3]
    try:  # libjpeg may fill a truncated scan with grey: either outcome is acceptable
        assert decode(truncated).shape == (301, 403, 3)
    except CorruptImage:
        pass


def test_reduction_never_enlarges_the_kept_region() -> None:
    assert reduction_for((1000, 1000), (900, 900), (224, 224)) == 4
    assert reduction_for((1000, 1000), (447, 900), (224, 224)) == 1
    assert reduction_for((1000, 1000), (448, 448), (224, 224)) == 2
    assert reduction_for((400, 350), (300, 300), (224, 224)) == 1


def test_reduced_decode_gives_what_the_model_sees_at_full_decode() -> None:
    """Same crop, same output size: DCT-domain scaling vs a full decode and a resize."""
    buf = jpeg(1200, 1600, index=3)
    full = ImageNetTrain(224, seed=1, reduced_decode=False)
    red = ImageNetTrain(224, seed=1, reduced_decode=True)
    diffs = []
    for epoch in range(4):
        full.reseed(epoch)
        red.reseed(epoch)
        for _ in range(5):
            a, b = full(buf), red(buf)
            assert a.shape == b.shape == (224, 224, 3) and a.dtype == b.dtype == np.uint8
            diffs.append(np.abs(a.astype(int) - b.astype(int)).mean())
    assert np.mean(diffs) < 4.0, diffs  # grey levels out of 255, on a smooth image
    v_full, v_red = ImageNetVal(reduced_decode=False)(buf), ImageNetVal()(buf)
    assert np.abs(v_full.astype(int) - v_red.astype(int)).mean() < 4.0


def test_presets_output_uint8_rgb_and_are_seeded() -> None:
    buf = jpeg(350, 400, index=1)
    bgr = decode(buf)
    val = ImageNetVal(224, 256)(buf)
    assert val.shape == (224, 224, 3) and val.dtype == np.uint8
    # RGB out: the mean colour of the centre matches the BGR decode, channels reversed.
    centre = CenterCrop(224)(ResizeShortestEdge(256)(bgr))
    assert np.allclose(val.mean((0, 1)), centre[..., ::-1].mean((0, 1)), atol=1.0)
    t1 = ImageNetTrain(seed=7, color_jitter=0.4, lighting=0.1)
    t2 = ImageNetTrain(seed=7, color_jitter=0.4, lighting=0.1)
    for t in (t1, t2):
        t.reseed(3)
    a = [t1(buf) for _ in range(4)]
    b = [t2(buf) for _ in range(4)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[0], a[1])
    t2.reseed(4)
    assert not np.array_equal(t2(buf), a[0])


def test_geometry_augmentors() -> None:
    img = make_image(0, 300, 400)
    rng = make_rng(0, 0)
    assert ResizeShortestEdge(150)(img).shape == (150, 200, 3)
    assert CenterCrop(100)(img).shape == (100, 100, 3)
    assert CenterCrop(500)(img).shape == (300, 400, 3)
    crop = RandomResizedCrop(64)
    for _ in range(20):
        y0, x0, ch, cw = crop.sample_box(300, 400, rng)
        assert 0 <= y0 and y0 + ch <= 300 and 0 <= x0 and x0 + cw <= 400
        assert 0.08 * 120000 * 0.9 <= ch * cw <= 120000
    assert crop(img, rng).shape == (64, 64, 3)
    flipped = Flip(1.0)(img, rng)
    assert np.array_equal(flipped, img[:, ::-1]) and np.array_equal(Flip(0.0)(img, rng), img)
    assert resize(img, 40, 30).shape == (30, 40, 3)


@pytest.mark.parametrize("aug", [Brightness(30), Contrast(), Saturation(0.4), ColorJitter(),
                                 Lighting(0.1)], ids=lambda a: type(a).__name__)
def test_color_augmentors_keep_uint8_and_change_pixels(aug) -> None:
    img = make_image(2, 64, 80)
    before = img.copy()
    rng = make_rng(1, 0)
    outs = [aug(img, rng) for _ in range(5)]
    assert np.array_equal(img, before), "input not modified"
    assert all(o.shape == img.shape and o.dtype == np.uint8 for o in outs)
    assert any(not np.array_equal(o, img) for o in outs)


def test_grey_image_is_unchanged_by_saturation(tmp_path: Path) -> None:
    grey = np.full((10, 10, 3), 100, np.uint8)
    out = Saturation(0.4)(grey, make_rng(0, 0))
    assert np.abs(out.astype(int) - 100).max() <= 1
