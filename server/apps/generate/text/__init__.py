"""Text in and out of the engine: the tokenizer, its class's quirks, chat templates, the
incremental detokenizer and the grammars of constrained decoding."""
