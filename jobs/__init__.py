"""Entrypoints: the ``adbatch`` console script and the ``ray job submit`` jobs."""
