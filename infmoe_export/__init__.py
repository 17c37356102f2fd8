"""infmoe-export: deployment pipeline for ∞-MoE language models (see shared SPEC)."""

__version__ = "0.1.0"
