"""Run inside the optimum venv (sentence-transformers, torch): the encoder folder's embeddings of
the sentences as sentence-transformers computes them (its modules.json: Transformer, Pooling,
Normalize), in f32, written as JSON; also each sentence's token ids.

    python embeddings.py ENCODER_DIR SENTENCES_JSON OUT_JSON
"""

import json
import sys
from pathlib import Path

import sentence_transformers
import torch
import transformers
from sentence_transformers import SentenceTransformer


def main(folder: str, sentences_json: str, out_path: str) -> None:
    sentences = json.loads(sentences_json)
    model = SentenceTransformer(folder, device="cpu")
    with torch.no_grad():
        vectors = model.encode(sentences, convert_to_numpy=True, batch_size=len(sentences))
    pooling = json.loads(Path(folder, "1_Pooling", "config.json").read_text())
    modules = json.loads(Path(folder, "modules.json").read_text())
    result = {
        "sentence_transformers": sentence_transformers.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "pooling": "cls" if pooling["pooling_mode_cls_token"] else "mean",
        "normalize": any(m["type"].endswith("Normalize") for m in modules),
        "sentences": sentences,
        "input_ids": [model.tokenizer(s).input_ids for s in sentences],
        "embeddings": vectors.astype(float).tolist(),
    }
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
