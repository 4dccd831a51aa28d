"""The BATCH virtual device: concurrent requests gathered into batches on one device."""

from plugserve.plugins.batch.plugin import BatchPlugin

__all__ = ["BatchPlugin"]
