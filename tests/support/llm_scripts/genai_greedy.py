"""Run inside the genai venv (onnxruntime-genai): greedy ids of a model-builder folder for each
prompt's ids, as onnxruntime-genai generates them (stopping at an EOS), and its own tokenizer's
ids for each prompt's text. Prints one JSON line.

    python genai_greedy.py FOLDER CASES_JSON MAX_NEW_TOKENS

CASES_JSON: a list of {"name", "text", "prompt_ids", "add_special_tokens"}.
"""

import json
import sys
from pathlib import Path

import onnxruntime_genai as og


def main(folder: str, cases_path: str, max_new: str) -> None:
    model = og.Model(folder)
    tokenizer = og.Tokenizer(model)
    results = {}
    for case in json.loads(Path(cases_path).read_text()):
        prompt = case["prompt_ids"]
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(prompt) + int(max_new))
        generator = og.Generator(model, params)
        generator.append_tokens(prompt)
        ids = []
        while not generator.is_done():
            generator.generate_next_token()
            ids.append(int(generator.get_next_tokens()[0]))
        results[case["name"]] = {
            "ids": ids,
            "tokenized": [int(t) for t in tokenizer.encode(case["text"])],
            "decoded": tokenizer.decode(ids),
        }
    print(json.dumps({"onnxruntime_genai": og.__version__, "cases": results}))


if __name__ == "__main__":
    main(*sys.argv[1:])
