"""Model architectures, each reading like the transformer it implements."""
