"""The package's version, for the modules that record it (a checkpoint's metadata, a model card, the Hub client's
user agent) and for setup.cfg, which reads it without importing anything."""

__version__ = "0.1.0"
