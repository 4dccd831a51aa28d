"""Run inside the openvino venv (openvino-genai): greedy ids of an optimum-intel IR folder for
each prompt's ids, as openvino-genai's LLMPipeline generates them in f32 with ``ignore_eos``, and
its tokenizer's (openvino_tokenizer.xml) ids for each prompt's text. Prints one JSON line.

    python openvino_greedy.py FOLDER CASES_JSON MAX_NEW_TOKENS
"""

import json
import sys
from pathlib import Path

import numpy as np
import openvino as ov
import openvino_genai as ov_genai


def main(folder: str, cases_path: str, max_new: str) -> None:
    pipe = ov_genai.LLMPipeline(folder, "CPU", INFERENCE_PRECISION_HINT="f32")
    tokenizer = pipe.get_tokenizer()
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = int(max_new)
    config.do_sample = False
    config.ignore_eos = True
    results = {}
    for case in json.loads(Path(cases_path).read_text()):
        ids = np.array([case["prompt_ids"]], dtype=np.int64)
        inputs = ov_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        out = pipe.generate(inputs, config)
        encoded = tokenizer.encode(case["text"], add_special_tokens=case["add_special_tokens"])
        results[case["name"]] = {
            "ids": [int(t) for t in out.tokens[0]],
            "tokenized": [int(t) for t in encoded.input_ids.data[0]],
        }
    print(json.dumps({"openvino_genai": ov_genai.__version__, "cases": results}))


if __name__ == "__main__":
    main(*sys.argv[1:])
