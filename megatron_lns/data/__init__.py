"""Tokenizers, corpora and datasets."""
