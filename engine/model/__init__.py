"""Decoder models over a flat token batch, one file per family (`registry.py`), and their weight loader."""
