"""Data loading: text for causal LMs, and the embedded default corpus."""
