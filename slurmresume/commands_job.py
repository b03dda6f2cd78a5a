"""Job commands (submit, drill): registered on the app in cli.py."""
