"""Torch-free text work: chat templates, detokenizer, reasoning split, tool-call parsing."""
