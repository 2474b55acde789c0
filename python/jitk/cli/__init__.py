"""The command line, `python -m jitk`: main.py assembles the commands."""
