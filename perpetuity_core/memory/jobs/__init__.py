"""Jobs run by hand over a whole memory: maintenance (purge, dictionary flip), the
integrity check, transfer between backends, importers."""
