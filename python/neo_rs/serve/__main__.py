"""``python -m neo_rs.serve``."""

from neo_rs.serve.cli import main

main()
