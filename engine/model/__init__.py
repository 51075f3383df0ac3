"""Llama-family decoder models over a flat token batch, and their weight loader."""
