"""Both example pipelines' last step (a Triton Python model): logits in, the best label and its
probability out. The labels are the model's ``labels`` parameter in its config.pbtxt, comma
separated, one per logit: the same file serves the text pipeline (negative, positive) and the
image pipeline (its colors)."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        text = config["parameters"]["labels"]["string_value"]
        self.labels = [label.strip().encode() for label in text.split(",")]

    def execute(self, requests):
        responses = []
        for request in requests:
            logits = pb_utils.get_input_tensor_by_name(request, "LOGITS").as_numpy()
            if logits.shape[-1] != len(self.labels):
                error = pb_utils.TritonError(
                    f"LOGITS has {logits.shape[-1]} classes, the model's labels are "
                    f"{len(self.labels)}",
                    pb_utils.TritonError.INVALID_ARG,
                )
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            rows = logits.reshape(-1, len(self.labels)).astype(np.float64)
            odds = np.exp(rows - rows.max(axis=1, keepdims=True))
            probabilities = odds / odds.sum(axis=1, keepdims=True)
            best = probabilities.argmax(axis=1)
            label = np.array([self.labels[i] for i in best], dtype=object)
            score = probabilities[np.arange(len(best)), best].astype(np.float32)
            tensors = [pb_utils.Tensor("LABEL", label), pb_utils.Tensor("SCORE", score)]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
