"""Generative models: a Hugging Face model folder served with continuous batching.

The package's modules, one job each: ``types`` (what goes in and out of the engine),
``tokenizer`` (the folder's tokenizer and special tokens), ``chat_template`` (the folder's
template, sandboxed), ``detokenizer`` (text as tokens arrive, stop strings held back). The
engine, its scheduler, sampler and KV cache, and the model folder as a served network follow
in their own modules; docs/generate.md describes the whole.
"""
