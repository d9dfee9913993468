"""Command-line entry points. Heavy modules are imported lazily, inside the commands."""
