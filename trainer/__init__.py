"""Trainer: losses, the version-filtered batch builder and the torchrun entry point (trainer issue)."""
