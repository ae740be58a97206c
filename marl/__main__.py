"""``python -m marl COMMAND ...``: the ``marl`` console script without the installed script."""

from marl.apps.cli import main

if __name__ == "__main__":
    main()
