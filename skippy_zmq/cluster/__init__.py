"""A cluster of hosts: measuring them (measure.py), workers that join a driver with a token, fetch only
their stage's checkpoint items over the authenticated link, and run their stages as children (docs/cluster.md)."""
