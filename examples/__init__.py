"""Examples of embedding asyncpin; run them from the repository root."""
