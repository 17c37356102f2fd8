"""Checking exported models against the PyTorch reference: validation (one model) and parity (every backend)."""
