"""textkit: small helpers (the smoke suite's fixture project)."""
