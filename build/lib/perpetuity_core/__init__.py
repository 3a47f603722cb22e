"""Perpetuity: a memory for AI agents, run between the harness and its model provider."""

__version__ = "0.1.0"
