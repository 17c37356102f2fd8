"""Reports: parity against the PyTorch reference, latency, the accuracy-vs-K trade-off, and
their JSON (versioned schema), Markdown and self-contained HTML renderings."""
