"""The command line: one module per command, on top of export, runtimes, verify and report."""
