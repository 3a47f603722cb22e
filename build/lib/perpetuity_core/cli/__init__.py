"""The `perpetuity` command: main dispatches to one module per noun."""
