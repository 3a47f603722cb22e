"""What is derived from the store's rows, one writer each: the retrieval index, heat,
chains, bindings, and the in-memory arena the scan reads."""
