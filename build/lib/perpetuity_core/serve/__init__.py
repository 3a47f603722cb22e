"""Serving: the orchestrator (pipeline: request -> identity -> store -> retrieve -> render), the
frame plan per conversation, the relay for the recall tools loop, and the mitmproxy addon."""
