"""``tokenmesh bench``: load generation and the figures callers judge a mesh by."""
