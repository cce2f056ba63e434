"""recis_async: an asynchronous event-bus hook engine for PyTorch training loops."""
