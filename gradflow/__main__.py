"""`python -m gradflow` is the `gradflow` command line."""

from gradflow.cli import run

if __name__ == "__main__":
    run()
