"""opencomposer: train coding agents in the harness they are deployed in."""

__version__ = "0.1.0"
