"""``python -m neo_rs.serve``."""

from neo_rs.serve.cli import main

if __name__ == "__main__":  # tensor-parallel workers are spawned and import the main module
    main()
