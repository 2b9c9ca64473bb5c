"""interfaces."""
