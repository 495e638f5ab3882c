"""Running processes on hosts: launching stages (locally and over ssh), tying their lifetime to ours,
memory placement and layer planning."""
