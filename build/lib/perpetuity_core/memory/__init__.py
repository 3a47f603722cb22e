"""Memory: the store and everything derived from its rows (retrieval index and scan, heat,
chains, bindings), the frame built from them, and the jobs that keep it whole. Open it with
memory.schema.open_memory, the composition root that wires the derivers into the store."""
