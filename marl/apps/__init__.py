"""The programs: the command line, evaluation and the demo."""
