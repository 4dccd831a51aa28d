"""The text pipeline's first step (a Triton Python model): text in, token ids out.

BERT's WordPiece over the ``vocab.txt`` beside this file (one token a line, its line number its
id, written with the pipeline by ``plugserve.server.control.examples.pipelines``): each text is
lower-cased and split into words and punctuation, each word into the longest vocabulary pieces
from its start (continuations spelled ``##piece``), a word with no spelling in the vocabulary
is ``[UNK]``; ``[CLS]`` first and ``[SEP]`` last, cut to the output's length and padded with
``[PAD]`` (id 0), which the encoder leaves out of its average.

Bounds: a word over ``MAX_WORD`` characters is ``[UNK]`` (BERT's rule: the greedy match is
quadratic in the word), a text is read only until its first ``length`` tokens are found (a
megabyte of long words took 11-40 s of the model's only instance when the whole text was
encoded first), and a request holds at most ``MAX_TEXTS`` texts (each row becomes ~8 KB of the
encoder's tensors in the server: 400,000 empty texts, a 1.6 MB request, grew it 3.3 GB).
"""

import json
import os
import re

import numpy as np
import triton_python_backend_utils as pb_utils

MAX_WORD = 100
MAX_TEXTS = 1024
_WORDS = re.compile(r"\w+|[^\w\s]")


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        folder = os.path.join(args["model_repository"], args["model_version"])
        with open(os.path.join(folder, "vocab.txt"), encoding="utf-8") as f:
            self.vocab = {line.rstrip("\n"): i for i, line in enumerate(f)}
        self.unk, self.cls, self.sep = (self.vocab[t] for t in ("[UNK]", "[CLS]", "[SEP]"))
        output = pb_utils.get_output_config_by_name(config, "INPUT_IDS")
        self.length = int(output["dims"][-1])
        self.dtype = pb_utils.triton_string_to_numpy(output["data_type"])

    def execute(self, requests):
        responses = []
        for request in requests:
            texts = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(-1)
            if len(texts) > MAX_TEXTS:
                error = pb_utils.TritonError(
                    f"TEXT holds {len(texts)} texts; at most {MAX_TEXTS} a request",
                    pb_utils.TritonError.INVALID_ARG,
                )
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            ids = np.zeros((len(texts), self.length), self.dtype)
            for row, text in enumerate(texts):
                if isinstance(text, bytes):
                    text = text.decode("utf-8", "replace")
                tokens = [self.cls, *self.encode(str(text), self.length - 2), self.sep]
                ids[row, : len(tokens)] = tokens
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("INPUT_IDS", ids)])
            )
        return responses

    def encode(self, text, most):
        """The first ``most`` WordPiece ids of ``text``: each word's longest pieces, left to
        right, read only as far as they go."""
        ids = []
        for match in _WORDS.finditer(text.lower()):  # (lowering is C's: milliseconds a MB)
            if len(ids) >= most:
                break
            word = match.group()
            if len(word) > MAX_WORD:
                ids.append(self.unk)
                continue
            pieces, start = [], 0
            while start < len(word):
                end = len(word)
                while end > start:
                    piece = word[start:end] if start == 0 else "##" + word[start:end]
                    if piece in self.vocab:
                        pieces.append(self.vocab[piece])
                        break
                    end -= 1
                if end == start:  # no piece spells it: the whole word is unknown
                    pieces = [self.unk]
                    break
                start = end
            ids += pieces
        return ids[:most]
