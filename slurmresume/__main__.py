"""`python -m slurmresume` = the `slurmresume` command."""

from .cli import main

main()
