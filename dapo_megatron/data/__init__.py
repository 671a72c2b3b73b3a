"""Prompt datasets: DAPO-Math schema files (parquet / jsonl, prompts.py), the DAPO template, synthetic
tasks (synthetic.py), the embedded tiny model and its tokenizer. The package itself imports nothing, so
that a light module (tiny_tokenizer.py, read by the memory plan) does not load the others.
"""
