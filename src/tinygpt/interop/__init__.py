"""Conversions between tinygpt and other implementations' weights and files."""
