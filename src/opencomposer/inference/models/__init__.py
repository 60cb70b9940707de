"""The engine's own model implementations (paged attention). See ``transformer.py``."""
