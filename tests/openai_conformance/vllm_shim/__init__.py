"""A ``vllm`` package for vLLM's OpenAI server tests run against plugserve (see
test_vllm_openai.py): only the names their test modules import at import time, each a
fixture-level adaptation (what the test uses to read the model, not the server under test).
"""
