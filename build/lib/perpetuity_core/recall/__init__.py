"""The recall tools the model calls mid-reply: specs and dispatch (tools), the six queries, and
how answers read."""
