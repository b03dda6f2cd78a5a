"""Checkpoint commands (status, prune, verify, latest): registered on the app in cli.py."""
