"""`python -m gradflow` is the `gradflow` command line."""

from gradflow.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
