"""The image pipeline's first step (a Triton Python model): an encoded image's bytes in (PNG,
JPEG, or any format Pillow reads, as UINT8, the way Triton's image examples send them), the
picture as the classifier takes it out: RGB, resized to the output's height and width, scaled
to [0, 1], channels first, one image per request.

Bounds: an image over ``MAX_PIXELS`` pixels is refused before it is decoded (Pillow reads the
size from the header), and JPEGs are decoded at a reduced scale when that is still larger than
the output (Pillow's ``draft``), so a request's memory is bounded by its picture's size.

Pillow is imported when the model loads, not at its first request: without it the load fails
saying what to install, and the server's other models load. Each load starts the model's
process anew, so once Pillow is installed, loading the model again (``plugserve load
image_decoder --repository``) or a restart finds it.
"""

import io
import json

import numpy as np
import triton_python_backend_utils as pb_utils

MAX_PIXELS = 40_000_000

#: what the load's error says when this Python has no Pillow
NEEDS_PILLOW = (
    "image_decoder needs Pillow to read images and {python} has none: pip install pillow "
    "(or 'plugserve[image]'), then load it again: plugserve load image_decoder --repository "
    "(or restart the server)"
)


class TritonPythonModel:
    def initialize(self, args):
        try:
            from PIL import Image
        except ImportError:
            import sys

            raise pb_utils.TritonModelException(
                NEEDS_PILLOW.format(python=sys.executable)
            ) from None
        self.image = Image
        config = json.loads(args["model_config"])
        output = pb_utils.get_output_config_by_name(config, "PIXELS")
        self.height, self.width = (int(d) for d in output["dims"][-2:])

    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy()
            try:
                pixels = self.decode(data.tobytes())
            except (OSError, ValueError) as exc:
                error = pb_utils.TritonError(
                    f"IMAGE is not an image this step reads: {exc}",
                    pb_utils.TritonError.INVALID_ARG,
                )
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            tensor = pb_utils.Tensor("PIXELS", pixels)
            responses.append(pb_utils.InferenceResponse(output_tensors=[tensor]))
        return responses

    def decode(self, data):
        Image = self.image
        try:
            opened = Image.open(io.BytesIO(data))
        except Image.UnidentifiedImageError:
            raise ValueError(
                f"{len(data)} bytes that are no image format Pillow reads (PNG, JPEG, ...); send "
                "the file's bytes as they are"
            ) from None
        except Image.DecompressionBombError as exc:  # (some formats check at open: a 500)
            raise ValueError(f"over {MAX_PIXELS} pixels: {exc}") from None
        with opened as image:
            width, height = image.size
            if width * height > MAX_PIXELS:
                raise ValueError(f"{width}x{height} is over {MAX_PIXELS} pixels")
            image.draft("RGB", (self.width, self.height))
            rgb = image.convert("RGB").resize((self.width, self.height), Image.BILINEAR)
        array = np.asarray(rgb, dtype=np.float32) / 255.0
        return array.transpose(2, 0, 1)[np.newaxis].copy()
