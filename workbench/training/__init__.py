"""Training what the project ships: the corpus (Python's standard library) and the tokenizer."""
