"""Generative models: a Hugging Face model folder served with continuous batching.

The package's modules, one job each: ``types`` (what goes in and out of the engine),
``tokenizer`` (the folder's tokenizer and special tokens), ``chat_template`` (the folder's
template, sandboxed), ``detokenizer`` (text as tokens arrive, stop strings held back). The
engine is split as vLLM v1 splits its engine core: ``engine`` (the loop: inbox, schedule,
execute, update), ``scheduler`` (each step's plan), ``runner`` (the model run: forwards and the
cache's arrangement), ``output`` (sampling applied, stop checks, detokenizing, events),
beside ``kvcache``, ``sampler`` and ``spans`` (a traced request's spans); ``network`` serves the
model folder as a network. docs/generate.md describes the whole.
"""
