"""shardline: one large language model across a fleet of ordinary PCs."""

__version__ = "0.1.0"
