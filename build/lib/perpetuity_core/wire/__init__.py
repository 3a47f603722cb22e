"""The wire: the neutral conversation model, routing, identity, SSE, and one adapter per provider
wire format (protocols/). Imports nothing else of the package but errors."""
