"""``python -m eagle3fn.cli`` (also what torchrun launches)."""

from eagle3fn.cli.main import main

if __name__ == "__main__":
    main()
