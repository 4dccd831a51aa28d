"""ImageDecoder through Pillow, an optional dependency (``pip install 'plugserve[image]'``).

Decoding JPEG, PNG, BMP, TIFF, WebP, PNM and JPEG 2000 is a codec library's job, not numpy's;
Pillow is the one onnx's reference implementation uses, so its pixels are the expected ones.
Without Pillow the node is refused at load with the command that installs it, and QueryNetwork
reports it unsupported, so HETERO can place it elsewhere.

A request's few bytes can decode to gigabytes (a 21 KB 1-bit PNG of 13,370 x 13,370 pixels is
1.5 GB decoded: Pillow's RGBX buffer, the array, the BGR copy), so the size is read from the
header first (Pillow's ``open`` reads no pixels) and an image over :data:`MAX_PIXELS` is refused
as a bad input before it is decoded; below that, its decoded bytes are within the run's room
(``plugins/amplify.py``), as every output a request's values size.
"""

from __future__ import annotations

import io

import numpy as np

from plugserve.plugins import amplify, run_context
from plugserve.plugins.api import InvalidInput
from plugserve.plugins.numpy.kernels.registry import KernelContext, register

#: Pillow's mode for each ``pixel_format``, and whether its channels are reversed after.
_FORMATS = {"RGB": ("RGB", False), "BGR": ("RGB", True), "Grayscale": ("L", False)}

#: Most pixels an image may have (64 Mpixel: a 9,000 x 7,000 photograph fits); decoding one to
#: RGB holds ~10 bytes a pixel at its peak (Pillow's 4, the array's 3, BGR's copy 3)
MAX_PIXELS = 64 << 20

#: what decoding holds per pixel and output channel at most (Pillow's buffer, the array, a copy)
_DECODE_GROWTH = 4


def _pillow_image():
    """PIL.Image, or None when Pillow is not installed."""
    try:
        from PIL import Image
    except ImportError:
        return None
    return Image


@register("ImageDecoder", 20)
def image_decoder(ctx: KernelContext):
    """uint8 [H, W, 3] for RGB and BGR, [H, W, 1] for Grayscale, whatever the file's own mode
    (palette, RGBA and 16-bit images are converted, as onnxruntime does)."""
    pixel_format = ctx.attr("pixel_format", "RGB")
    if pixel_format not in _FORMATS:
        raise ctx.unsupported(f"pixel_format {pixel_format!r} (expected RGB, BGR or Grayscale)")
    image_module = _pillow_image()
    if image_module is None:
        raise ctx.unsupported(
            "decoding images needs Pillow, which is not installed: pip install 'plugserve[image]'"
        )
    mode, reverse = _FORMATS[pixel_format]
    node = ctx.name

    def run(encoded: np.ndarray) -> np.ndarray:
        try:
            with image_module.open(io.BytesIO(np.ascontiguousarray(encoded).tobytes())) as img:
                _check_size(node, img.size, 1 if mode == "L" else 3)
                pixels = np.asarray(img.convert(mode) if img.mode != mode else img)
        except (OSError, ValueError, SyntaxError) as exc:  # Pillow's "cannot identify" etc.
            raise InvalidInput(
                f"node {node!r} (ImageDecoder): not a decodable image: {exc}"
            ) from exc
        except image_module.DecompressionBombError as exc:  # Pillow's own bound, at open
            raise InvalidInput(f"node {node!r} (ImageDecoder): {exc}") from exc
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        if reverse:
            pixels = pixels[:, :, ::-1]
        return np.ascontiguousarray(pixels, dtype=np.uint8)

    return run


def _check_size(node: str, size: tuple[int, int], channels: int) -> None:
    """Refuse an image over :data:`MAX_PIXELS`, or whose decoding would outgrow the run's
    room, from its header, before its pixels are read."""
    width, height = size
    if width * height > MAX_PIXELS:
        raise InvalidInput(
            f"node {node!r} (ImageDecoder): the image is {width:,} x {height:,} pixels, over "
            f"the {MAX_PIXELS:,} pixels an image may have here; send a smaller image"
        )
    amplify.check_bytes(
        _DECODE_GROWTH * width * height * channels,
        f"node {node!r} (ImageDecoder) decoding a {width:,} x {height:,} image",
        run_context.current(),
    )
