"""Engines: the embedded numpy reference (default), and optional real engines at the edges."""
