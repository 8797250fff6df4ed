"""autopar."""
