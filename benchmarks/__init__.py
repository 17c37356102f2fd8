"""Side-by-side benchmarks of the exports, the kernel and their peers: each module is a script,
`python -m benchmarks.<name>`, that prints ratios and writes its results to
benchmarks/results/<name>.json (benchmarks/README.md)."""
