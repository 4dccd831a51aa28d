"""ImageDecoder through Pillow, an optional dependency (``pip install 'plugserve[image]'``).

Decoding JPEG, PNG, BMP, TIFF, WebP, PNM and JPEG 2000 is a codec library's job, not numpy's;
Pillow is the one onnx's reference implementation uses, so its pixels are the expected ones.
Without Pillow the node is refused at load with the command that installs it, and QueryNetwork
reports it unsupported, so HETERO can place it elsewhere.
"""

from __future__ import annotations

import io

import numpy as np

from plugserve.plugins.api import InvalidInput
from plugserve.plugins.numpy.kernels.registry import KernelContext, register

#: Pillow's mode for each ``pixel_format``, and whether its channels are reversed after.
_FORMATS = {"RGB": ("RGB", False), "BGR": ("RGB", True), "Grayscale": ("L", False)}


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
                pixels = np.asarray(img.convert(mode) if img.mode != mode else img)
        except (OSError, ValueError, SyntaxError) as exc:  # Pillow's "cannot identify" etc.
            raise InvalidInput(
                f"node {node!r} (ImageDecoder): not a decodable image: {exc}"
            ) from exc
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        if reverse:
            pixels = pixels[:, :, ::-1]
        return np.ascontiguousarray(pixels, dtype=np.uint8)

    return run
