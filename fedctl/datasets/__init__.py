"""Dataset builders and their ``fedctl data`` commands."""
